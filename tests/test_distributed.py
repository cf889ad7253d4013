"""Scale out inside one job: data-parallel ranks (torchrun, gloo on CPU) and a target split by a device map.

The 2-process run is compared with a single-process run of the same config, prompt for prompt;
the dispatched target with HF greedy decoding of an undispatched copy.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddtree
from ddtree.engine.drafter import DFlashDrafter
from ddtree.errors import ConfigError
from ddtree.pipeline import distributed as D
from ddtree.pipeline import models as M
from ddtree.testing.reference import hf_greedy
from ddtree.tiny import tiny_model

# ---------------------------------------------------------------- ranks, shards, merge (no processes)


def test_world_from_env():
    assert D.world_from_env({}) == D.World(0, 1, 0, 1)
    w = D.world_from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (w.rank, w.world_size, w.local_rank, w.local_world_size, w.is_main, w.is_distributed) == (3, 4, 1, 2,
                                                                                                    False, True)
    assert D.world_from_env({"RANK": "0", "WORLD_SIZE": "2"}).local_rank == 0
    for bad in ({"RANK": "2", "WORLD_SIZE": "2"}, {"WORLD_SIZE": "two"}):
        with pytest.raises(ConfigError):
            D.world_from_env(bad)


def test_rank_device(monkeypatch):
    two = D.World(1, 2, 1, 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert D.rank_device("cuda", two) == "cuda:1"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert D.rank_device("cuda", two, device_map="auto") == "cuda:4"  # the first GPU of rank 1's half
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # one GPU bound to each task
    assert D.rank_device("cuda", two) == "cuda:0"
    assert D.rank_device("cpu", two) == "cpu" and D.rank_device("cuda:3", two) == "cuda:3"
    assert D.rank_device("cuda", D.World()) == "cuda"


def test_each_rank_gets_its_own_slice_of_gpus_for_a_device_map(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=100))
    assert D.rank_max_memory(D.World()) is None  # one rank: accelerate sees every GPU
    assert D.rank_max_memory(D.World(3, 4, 1, 2)) == {4: 90, 5: 90, 6: 90, 7: 90}
    with pytest.raises(ConfigError, match="nproc_per_node"):
        D.rank_max_memory(D.World(0, 16, 0, 16))


def test_shards_cover_the_prompts_once_and_merge_back_in_order():
    ids = [f"p{i}" for i in range(7)]
    worlds = [D.World(r, 3, r, 3) for r in range(3)]
    shards = [D.shard(ids, w) for w in worlds]
    assert shards == [["p0", "p3", "p6"], ["p1", "p4"], ["p2", "p5"]]
    # two records per prompt (baseline then method), in the order each rank wrote them
    per_rank = [[{"id": p, "role": role} for p in s for role in ("baseline", "method")] for s in shards]
    merged = D.merge_in_order(per_rank, ids)
    assert [(r["id"], r["role"]) for r in merged] == [(p, role) for p in ids for role in ("baseline", "method")]
    with pytest.raises(ValueError, match="not in this job"):
        D.merge_in_order([[{"id": "stranger"}]], ids)


def test_ranks_above_zero_send_hydra_output_to_a_scratch_dir():
    argv = ["budget=4", "hydra.run.dir=/somewhere", "-m"]
    assert D.hydra_argv_for_rank(argv, D.World()) == argv
    assert D.hydra_argv_for_rank(argv, D.World(0, 2, 0, 2)) == argv
    out = D.hydra_argv_for_rank(argv, D.World(1, 2, 1, 2))
    assert out[0] == "budget=4" and out[-1] == "-m" and "hydra.run.dir=/somewhere" not in out
    assert D.hydra_argv_for_rank(["-m"], D.World(1, 2, 1, 2))[0] == "-m"
    run_dir = next(a for a in out if a.startswith("hydra.run.dir=")).split("=", 1)[1]
    assert Path(run_dir).parent.is_dir() and "hydra.output_subdir=null" in out


def test_device_map_setting_is_checked():
    D.check_device_map(None)
    D.check_device_map("auto")
    D.check_device_map({"model.embed_tokens": "cpu", "lm_head": "disk"})
    for bad, setting in (("everywhere", "model.device_map"), ({"lm_head": "gpu0"}, "model.device_map.lm_head"),
                         ({"lm_head": 99}, "model.device_map.lm_head")):
        with pytest.raises(ConfigError) as e:
            D.check_device_map(bad)
        assert e.value.setting == setting


# ---------------------------------------------------------------- a target split by a device map


def per_layer_map(model, device="cpu") -> dict[str, str]:
    """One device-map entry per decoder layer (and per other top-level module): the finest split."""
    out: dict[str, str] = {}

    def visit(prefix: str, module) -> None:
        for name, child in module.named_children():
            full = prefix + name
            if isinstance(child, torch.nn.ModuleList):
                out.update({f"{full}.{i}": device for i in range(len(child))})
            elif any(isinstance(m, torch.nn.ModuleList) for m in child.modules()):
                visit(full + ".", child)
            else:
                out[full] = device

    visit("", model)
    return out


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_dispatched_target_is_lossless(model_type):
    """accelerate hooks on every layer (one per device-map entry) and the outputs still equal plain greedy.

    Every entry is "cpu" here: this proves the dispatched code path (hooks moving inputs, cache layers
    filled inside hooked modules, commit through them), not transfers between two real devices.
    """
    vocab = 12  # random drafts get accepted several tokens deep
    plain = tiny_model(model_type, seed=2, attn_implementation="sdpa", vocab_size=vocab)
    target = D.dispatch(tiny_model(model_type, seed=2, attn_implementation="sdpa", vocab_size=vocab),
                        per_layer_map(plain))
    layers = [m for n, m in target.named_modules() if n.count(".") == 2 and ".layers." in n]
    assert len(layers) == 4 and all(hasattr(m, "_hf_hook") for m in layers)
    assert str(D.input_device(target)) == "cpu" and D.placement(target)["devices"] == ["cpu"]
    drafter = DFlashDrafter.random_for_target(target.config, block_size=4, seed=1, num_layers=1)
    g = torch.Generator().manual_seed(3)
    deepest = 0
    for n in (1, 9):
        ids = torch.randint(0, vocab, (1, n), generator=g)
        ref = hf_greedy(plain, ids, 12)
        for method, budget in (("ar", None), ("dflash", None), ("ddtree", 8)):
            res = ddtree.generate(target, drafter if method != "ar" else None, ids, method=method, budget=budget,
                                  max_new_tokens=12)
            assert res.output_ids == ref, (method, n)
            deepest = max(deepest, max(res.acceptance_lengths))
    assert deepest >= 2  # trees were accepted past the root, so commits went through the hooked layers


def test_a_gdn_module_hooked_before_the_patch_runs_the_patched_forward():
    """accelerate keeps the forward a module had when its hook was attached (`_old_forward`); a session points a
    hooked GDN module at its class's current, patched forward, or tree verification bypasses the tree-exact GDN."""
    from accelerate.hooks import ModelHook, add_hook_to_module

    from ddtree.engine import gdn

    was_installed = gdn.is_installed()
    gdn.uninstall()
    try:
        vocab = 12  # random drafts get accepted several tokens deep
        plain = tiny_model("qwen3_5_text", seed=2, attn_implementation="sdpa", vocab_size=vocab)
        target = tiny_model("qwen3_5_text", seed=2, attn_implementation="sdpa", vocab_size=vocab)
        classes = tuple(gdn.target_classes())
        hooked = [m for m in target.modules() if isinstance(m, classes)]
        for module in hooked:
            add_hook_to_module(module, ModelHook())
        before = [module._old_forward for module in hooked]
        drafter = DFlashDrafter.random_for_target(target.config, block_size=4, seed=1, num_layers=1)
        ids = torch.randint(0, vocab, (1, 9), generator=torch.Generator().manual_seed(3))
        with ddtree.Engine(target, drafter, method="ddtree", budget=8) as engine:
            res = engine.generate(ids, max_new_tokens=12)
            assert hooked and all(m._old_forward is not old for m, old in zip(hooked, before, strict=True))
        assert res.output_ids == hf_greedy(plain, ids, 12) and max(res.acceptance_lengths) >= 2
        assert all(m._old_forward is old for m, old in zip(hooked, before, strict=True))  # put back on close
    finally:
        (gdn.install if was_installed else gdn.uninstall)()


def test_run_loads_a_device_mapped_target(tmp_path, monkeypatch, small, compose):
    """model.device_map through the run CLI's loader: placed by accelerate, inputs on the embeddings' device."""
    from ddtree.pipeline import job as R

    monkeypatch.chdir(tmp_path)
    dmap = per_layer_map(tiny_model("qwen3", vocab_size=128))
    cfg = compose(*small, "dataset.max_samples=3", "device=cpu", "tracking=none", "warmup=false",
                  "compat.enabled=false", f"model.device_map={_hydra_dict(dmap)}", hydra_node=False)
    M.MODELS.clear()
    try:
        summary = R.run_job(cfg)
        assert M.MODELS.target.hf_device_map == dmap and hasattr(M.MODELS.target.model.layers[1], "_hf_hook")
    finally:
        M.MODELS.clear()
    assert summary["match_rate"] == 1.0 and summary["placement"]["devices"] == ["cpu"]
    assert summary["placement"]["device_map"]["model.layers.3"] == "cpu"


def _hydra_dict(d: dict[str, str]) -> str:
    return "{" + ",".join(f"{k}:{v}" for k, v in d.items()) + "}"


# ---------------------------------------------------------------- data parallel, in process and with torchrun


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _key(r: dict) -> tuple:
    return r["id"], r["turn"], r["role"], r["method"]


def test_ranks_shard_and_rank0_gathers_in_process(tmp_path, monkeypatch, small, compose):
    """run_job's rank logic with the collectives replaced by a recording: rank 1 runs first and hands its
    records over; rank 0 gets them from `gather`, merges, summarizes, and alone writes samples.jsonl."""
    from ddtree.pipeline import job as R

    monkeypatch.chdir(tmp_path)
    cfg = compose(*small, "dataset.max_samples=4", "device=cpu", "tracking=none", "warmup=false",
                  "compat.enabled=false", hydra_node=False)
    single = R.run_job(cfg)
    reference = _records(tmp_path / "samples.jsonl")
    (tmp_path / "samples.jsonl").unlink()
    (tmp_path / "summary.json").unlink()

    handed: list = []
    monkeypatch.setattr(D, "init", lambda world, device: None)
    monkeypatch.setattr(D, "broadcast", lambda obj, world: obj)

    def fake_gather(obj, world):
        if not world.is_main:
            handed.append(obj)
            return None
        return [obj, *handed]

    monkeypatch.setattr(D, "gather", fake_gather)
    for rank in (1, 0):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        out = R.run_job(cfg)
        assert (out is None) == (rank == 1)
        if rank == 1:
            assert not (tmp_path / "samples.jsonl").exists() and not (tmp_path / "summary.json").exists()
    M.MODELS.clear()
    assert {r["id"] for r in _records(tmp_path / "samples.rank1.jsonl")} == {"tiny-1", "tiny-3"}
    assert {r["id"] for r in _records(tmp_path / "samples.rank0.jsonl")} == {"tiny-0", "tiny-2"}
    gathered = _records(tmp_path / "samples.jsonl")
    assert [_key(r) for r in gathered] == [_key(r) for r in reference]
    assert [r["output_ids"] for r in gathered] == [r["output_ids"] for r in reference]
    assert out["world_size"] == 2 and out["num_prompts"] == single["num_prompts"] == 4
    assert out["match_rate"] == 1.0 and out["new_tokens"] == single["new_tokens"]


def _torchrun(args: list[str], cwd: Path, nproc: int, launcher: str = "torchrun") -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0", "DDTREE_TRACEBACK": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    else:  # accelerate's multi-GPU launcher is torchrun underneath; with no GPU the ranks use gloo on the CPU
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={nproc}",
               "--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no", "--main_process_port=0"]
    return subprocess.run([*cmd, "-m", "ddtree.run", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_two_gloo_ranks_equal_one_process(cli, tmp_path, small):
    """torchrun, 2 processes, gloo: the gathered samples equal a single-process run's, prompt for prompt;
    one MLflow run (rank 0's), with the world size recorded."""
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    common = (*small, "dataset.max_samples=3", "method=ddtree", "budget=8", f"runs_dir={tmp_path / 'runs'}")
    one = cli(*common, "tracking=none", f"hydra.run.dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-3000:]
    two = _torchrun([*common, f"tracking.uri={uri}", f"hydra.run.dir={tmp_path / 'two'}"], tmp_path, 2)
    assert two.returncode == 0, two.stderr[-5000:]
    assert two.stdout.count("speedup") == 1  # rank 0 alone prints the table

    ref, got = _records(tmp_path / "one" / "samples.jsonl"), _records(tmp_path / "two" / "samples.jsonl")
    assert [_key(r) for r in got] == [_key(r) for r in ref]
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in ref]
    ranks = [{r["id"] for r in _records(tmp_path / "two" / f"samples.rank{k}.jsonl")} for k in (0, 1)]
    assert ranks == [{"tiny-0", "tiny-2"}, {"tiny-1"}]
    summary = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["match_rate"] == 1.0 and summary["num_prompts"] == 3

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("ddtree").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["world_size"] == "2"
    assert run.data.metrics["world_size"] == 2 and run.data.metrics["num_prompts"] == 3

    # the same job again: rank 0 finds it finished and every rank skips it
    again = _torchrun([*common, f"tracking.uri={uri}", f"hydra.run.dir={tmp_path / 'three'}"], tmp_path, 2)
    assert again.returncode == 0, again.stderr[-5000:]
    assert again.stdout.count("skipped") == 1 and not (tmp_path / "three" / "samples.rank1.jsonl").exists()
    assert len(client.search_runs([run.info.experiment_id])) == 1


@pytest.mark.slow
def test_accelerate_launch_runs_the_same_ranks(cli, tmp_path, small):
    """`accelerate launch --multi_gpu --num_processes 2 -m ddtree.run`: the same rank environment as torchrun."""
    common = (*small, "dataset.max_samples=3", "method=dflash", "tracking=none", f"runs_dir={tmp_path / 'runs'}")
    one = cli(*common, f"hydra.run.dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-3000:]
    two = _torchrun([*common, f"hydra.run.dir={tmp_path / 'two'}"], tmp_path, 2, launcher="accelerate")
    assert two.returncode == 0, two.stderr[-5000:]
    ref, got = _records(tmp_path / "one" / "samples.jsonl"), _records(tmp_path / "two" / "samples.jsonl")
    assert [(_key(r), r["output_ids"]) for r in got] == [(_key(r), r["output_ids"]) for r in ref]
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["world_size"] == 2
