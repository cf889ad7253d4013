"""Training stage `train`: a short run, resume, checkpoints, online features, data-parallel ranks."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from train_support import MASK, _losses, _Payload, _pipeline_cfg, _same_weights, _target, _train

from ddtree.engine.drafter import DFlashDrafter
from ddtree.errors import ConfigError
from ddtree.train.config import OptimConfig, to_train_config
from ddtree.train.trainer import latest_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")


def test_short_training_run_loss_falls_and_resumes(tmp_path: Path):
    torch.manual_seed(0)
    target = _target()
    drafter, summary, losses = _train(tmp_path, target, 100)
    assert len(losses) == 20
    assert losses[-1] < 0.6 * losses[0], losses
    assert summary["final_tau_proxy"] > 1.5
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    assert ckpt is not None and ckpt.name == "step_000100"
    assert len(list((tmp_path / "checkpoints").glob("step_*"))) == 2  # keep_checkpoints

    # resume: a run that stopped at step 90 and is restarted ends where an uninterrupted run ends
    shutil.rmtree(tmp_path / "checkpoints" / "step_000100")
    resumed, _, more = _train(tmp_path, target, 100)
    assert len(more) == 2  # steps 95 and 100 only
    for (k, a), b in zip(drafter.state_dict().items(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_trained_checkpoint_loads_back_and_generates_losslessly(tmp_path: Path, model_type: str):
    import ddtree

    torch.manual_seed(0)
    target = _target(model_type, seed=1)
    drafter, _, _ = _train(tmp_path, target, 20)
    drafter.save_pretrained(tmp_path / "drafter")
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["dflash_config"] == {"target_layer_ids": [1, 3], "mask_token_id": MASK}
    loaded = DFlashDrafter.from_pretrained(tmp_path / "drafter")
    for (k, a), b in zip(drafter.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), k

    prompt = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        ref = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, prompt.shape[1]:].tolist()
    for method, budget in (("dflash", None), ("ddtree", 8)):
        out = ddtree.generate(target, loaded, prompt, method=method, budget=budget, max_new_tokens=24)
        assert out.output_ids == ref, (method, out.output_ids, ref)


def test_tampered_trainer_state_is_refused_in_one_line(tmp_path: Path):
    from ddtree.train.trainer import STATE, TrainState, make_optimizer, resume, save_checkpoint

    target = _target()
    drafter = DFlashDrafter.random_for_target(target.config, num_layers=1, block_size=4, target_layer_ids=[1, 3],
                                              mask_token_id=MASK)
    opt = make_optimizer(drafter, OptimConfig())
    ckpt = save_checkpoint(drafter, opt, TrainState(step=5, micro=5), tmp_path, keep=2)
    state, path = resume(tmp_path, drafter, opt, torch.device("cpu"))
    assert (state.step, path) == (5, ckpt)

    marker = tmp_path / "code_ran"
    torch.save({"optimizer": opt.state_dict(), "step": 5, "micro": 5, "x": _Payload(marker)}, ckpt / STATE)
    with pytest.raises(ConfigError) as e:
        resume(tmp_path, drafter, opt, torch.device("cpu"))
    assert not marker.exists()
    msg = str(e.value)
    assert "\n" not in msg and STATE in msg and "force=[train]" in msg


def test_online_features_train_the_offline_drafter_step_by_step(tmp_path: Path, capsys):
    """features=online (target in the loop, nothing on disk) == offline shards: losses per step and the drafter."""
    from ddtree.train.pipeline import run

    quiet = {"tracking.backend": "none", "eval.every": None}
    run(to_train_config(_pipeline_cfg(tmp_path, "offline", **quiet)))
    off = _losses(capsys.readouterr().out)
    run(to_train_config(_pipeline_cfg(tmp_path, "online", features="online", **quiet)))
    on = _losses(capsys.readouterr().out)
    assert (tmp_path / "offline" / "features" / "manifest.json").exists()
    assert not (tmp_path / "online" / "features").exists()
    assert [s for s, _ in off] == list(range(1, 7)) and [s for s, _ in on] == list(range(1, 7))
    assert [v for _, v in on] == pytest.approx([v for _, v in off], abs=2e-4)  # logged with 4 decimals
    assert off[-1][1] < off[0][1]
    _same_weights(tmp_path / "offline" / "drafter", tmp_path / "online" / "drafter")

    # online resume: a run stopped after step 3 and restarted ends with the same drafter
    shutil.copytree(tmp_path / "online" / "drafter", tmp_path / "uninterrupted")
    shutil.rmtree(tmp_path / "online" / "checkpoints" / "step_000006")
    shutil.rmtree(tmp_path / "online" / "drafter")
    run(to_train_config(_pipeline_cfg(tmp_path, "online", features="online", **quiet)))
    assert [s for s, _ in _losses(capsys.readouterr().out)] == [4, 5, 6]
    _same_weights(tmp_path / "uninterrupted", tmp_path / "online" / "drafter")


@pytest.mark.slow
@pytest.mark.parametrize("features,fsdp", [("offline", False), ("online", False), ("offline", True)])
def test_two_gloo_processes_train_the_one_process_drafter_with_grad_accum_2(tmp_path: Path, features: str,
                                                                            fsdp: bool):
    """torchrun --nproc_per_node=2 (CPU, gloo, each rank its own target; answers regenerated on both ranks)
    == 1 process with optim.grad_accum=2: the same sequences and the same drafter."""
    import subprocess
    import sys

    from ddtree.train.pipeline import run

    held_out = tmp_path / "prompts.jsonl"
    held_out.write_text("".join(json.dumps({"id": f"p{i}", "turns": [f"say {i}" * (1 + i % 3)]}) + "\n"
                                for i in range(12)))
    gen = {"data.source": "generate", "data.prompts": str(held_out), "data.max_new_tokens": 10, "data.batch_size": 3}
    run(to_train_config(_pipeline_cfg(tmp_path, "one", features=features, **{
        "tracking.backend": "none", "eval.every": None, "optim.grad_accum": 2, **gen})))
    cfg = _pipeline_cfg(tmp_path, "two")
    args = [f"out_dir={tmp_path / 'two'}", f"target.name_or_path={cfg['target']['name_or_path']}",
            f"features={features}", "data.source=generate", f"data.prompts={held_out}", "data.max_new_tokens=10",
            "data.batch_size=3", "stages=[data,extract,train]", "extract.dtype=float32", "extract.batch_size=4",
            "tracking=none", "device=cpu", "drafter.num_layers=1", "drafter.block_size=4",
            "drafter.target_layer_ids=[1,3]", "extract.shard_size=8", "optim.lr=3e-3", "optim.warmup_steps=2",
            "optim.batch_size=4", "optim.anchors_per_seq=4", "optim.max_steps=6", "optim.log_every=1",
            "optim.save_every=3", "optim.loss_decay=null", "optim.grad_accum=1", f"optim.fsdp={str(fsdp).lower()}"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    p = subprocess.run([*torchrun, "-m", "ddtree.train", *args], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr[-3000:]
    assert "x 2 proc" in p.stdout
    sequences = [(tmp_path / n / "data" / "sequences.jsonl").read_text() for n in ("one", "two")]
    assert sequences[0] == sequences[1] and (tmp_path / "two" / "data" / "rank1").is_dir()
    _same_weights(tmp_path / "one" / "drafter", tmp_path / "two" / "drafter")
