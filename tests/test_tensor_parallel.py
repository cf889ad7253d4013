"""Tensor parallel (model.tp_plan=auto): a target sharded over torchrun's ranks (gloo on the CPU), through the CLI.

Every method is compared, prompt for prompt, with a single-process AR run of the whole target (the engine's AR is
HF greedy decoding: tests/test_methods.py); the engine's own paths (lean forward, split tree attention) are shown to
run on the shards by tests/tp_worker.py, which counts them on each rank and compares every method with
HF greedy decoding of the whole target directly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from ddtree.errors import ConfigError
from ddtree.pipeline import distributed as D

# ---------------------------------------------------------------- layout and refusals (no processes)


def _model(**kw):
    base = dict(tp_plan="auto", tp_size=None, device_map=None, quantization=None)
    return SimpleNamespace(**{**base, **kw})


def test_layout_and_refusals_before_loading():
    four = D.World(3, 4, 3, 4)
    tp = D.tensor_parallel(_model(tp_size=2), four)
    assert (tp.size, tp.group, tp.rank, tp.groups) == (2, 1, 1, 2)
    assert D.data_world(_model(tp_size=2), four) == D.World(1, 2, 0, 1)  # prompts split over the two groups
    assert D.tensor_parallel(_model(), four).groups == 1 and D.tensor_parallel(_model(tp_plan=None), four) is None
    recs = [[{"id": "a", "turn": 0, "role": "method", "output_ids": [1, 2]}] for _ in range(4)]
    assert D.first_of_each_group(recs, 2) == [recs[0], recs[2]]
    recs[3] = [{**recs[3][0], "output_ids": [1, 3]}]
    with pytest.raises(RuntimeError, match="ranks 2 and 3 decoded different tokens"):
        D.first_of_each_group(recs, 2)

    two = D.World(0, 2, 0, 2)
    toy = json.loads((Path(__file__).resolve().parents[1] / "assets" / "toy" / "target" / "config.json").read_text())
    qwen36 = json.loads((Path(__file__).resolve().parents[1] / "bench" / "configs" / "qwen3_6_27b.json")
                        .read_text())["text_config"]
    D.check_tensor_parallel(_model(), two, qwen36)  # 24 heads, 4 key/value heads, 16/48 GDN heads: TP 2 and 4
    D.check_tensor_parallel(_model(tp_size=4), D.World(0, 4, 0, 4), qwen36)
    for model, world, config, message in [
        (_model(), two, toy, "model.tp_size: 2 ranks cannot share the target's 3 key/value heads"),
        (_model(), two, {"model_type": "rwkv", "num_attention_heads": 4}, "no tensor-parallel plan for the 'rwkv'"),
        (_model(device_map="auto"), two, None, "model.tp_plan: and model.device_map both split"),
        (_model(tp_size=3), D.World(0, 4, 0, 4), None, "model.tp_size: 3 does not divide the job's 4 ranks"),
        (_model(tp_size=8), D.World(0, 8, 0, 8), qwen36, "8 ranks cannot share the target's 4 key/value heads"),
        (_model(), D.World(), None, "this is one"),
        (_model(tp_plan="colwise"), two, None, "unknown plan 'colwise'"),
        (_model(tp_plan=None, tp_size=2), two, None, "model.tp_size: is 2 but model.tp_plan is null"),
    ]:
        with pytest.raises(ConfigError, match=message):
            D.check_tensor_parallel(model, world, config)
        assert "\n" not in str(pytest.raises(ConfigError, D.check_tensor_parallel, model, world, config).value)


def test_cli_refuses_the_toy_in_one_line_before_loading(cli):
    """Through `python -m ddtree.run` as rank 0 of two (no process group is made: the refusal comes first)."""
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        proc = cli("model=toy", "model.tp_plan=auto", "tracking=none", timeout=120)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines == ["error: model.tp_size: 2 ranks cannot share the target's 3 key/value heads: each rank holds "
                     "whole heads — drop model.tp_plan: data-parallel ranks (each the whole target) or model.device_map"], proc.stderr[-2000:]
    assert "Loading weights" not in proc.stderr


# ---------------------------------------------------------------- ranks (torchrun, gloo)

SMALL = ("dataset=tiny", "dataset.max_samples=2", "max_new_tokens=8", "tracking=none", "budget=8")


def _torchrun(args: list[str], cwd: Path, nproc: int, module: str = "ddtree.run") -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0", "DDTREE_TRACEBACK": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    what = [str(Path(__file__).with_name(module))] if module.endswith(".py") else ["-m", module]  # a script here
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *what]
    return subprocess.run([*cmd, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _outputs(job: Path) -> dict[tuple, list[int]]:
    return {(r["id"], r["turn"], r["role"]): r["output_ids"] for r in _records(job / "samples.jsonl")}


def _greedy(cli, tmp_path: Path, model: str, *extra: str) -> dict[tuple[str, int], list[int]]:
    """The single-process AR decoding of the whole target, per prompt and turn."""
    one = cli(f"model={model}", *SMALL, *extra, "method=ar", f"runs_dir={tmp_path / 'runs1'}", f"hydra.run.dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-3000:]
    return {k[:2]: v for k, v in _outputs(tmp_path / "one").items()}  # (method=ar: its records are the baseline)


def _sweep(tmp_path: Path, name: str, model: str, *args: str) -> list[dict]:
    """A multirun under torchrun with the target sharded over 2 ranks; the summaries of the jobs that ran."""
    sweep = tmp_path / name
    proc = _torchrun([f"model={model}", *SMALL, "model.tp_plan=auto", f"runs_dir={tmp_path / 'runs'}",
                      f"hydra.sweep.dir={sweep}", *args, "-m"], tmp_path, 2)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "tensor parallel: 2 ranks a group x 1 group(s); lean layers 4 of 4" in proc.stdout
    jobs = []
    for path in sorted(sweep.glob("*/summary.json")):
        jobs.append({**json.loads(path.read_text()), "_outputs": _outputs(path.parent)})
    return jobs


@pytest.mark.slow  # 3 torchrun sweeps and a single-process run per target (~2-3 min on 2 shared cores)
@pytest.mark.parametrize("model", ["tiny_qwen3", "tiny_qwen3_5"])
def test_every_method_is_exact_under_tensor_parallel(cli, tmp_path, model):
    """AR, DFlash, DDTree, DFlash2 (chain, DDTree under both scorings) and, on the hybrid, MTP (chain and tree):
    every output of every job (the method and its AR baseline, both on the shards) equals the single-process
    greedy decoding of the whole target, in fp32."""
    from ddtree.testing.dflash2 import save_random_dflash2
    from ddtree.tiny import tiny_model

    greedy = _greedy(cli, tmp_path, model)
    mtp = ("method=ar,dflash,ddtree,mtp", "mtp.topk=1,2") if model == "tiny_qwen3_5" else ("method=ar,dflash,ddtree",)
    jobs = _sweep(tmp_path, "sweep", model, *mtp)
    drafter = save_random_dflash2(tiny_model("qwen3_5_text" if model == "tiny_qwen3_5" else "qwen3", seed=0),
                                  tmp_path / "dflash2", seed=4)
    jobs += _sweep(tmp_path, "sweep2", model, "drafter=dflash2", f"drafter.name_or_path={drafter}",
                   "method=dflash,ddtree", "scoring=marginal,pair")
    ran = {(j["method"], j.get("scoring") if j["method"] == "ddtree" else None, (j.get("mtp") or {}).get("topk"))
           for j in jobs}
    expected = {("ar", None, None), ("dflash", None, None), ("ddtree", "marginal", None), ("ddtree", "pair", None)}
    if model == "tiny_qwen3_5":  # the MTP chain and tree
        expected |= {("mtp", None, 1), ("mtp", None, 2)}
    assert ran == expected, ran
    for job in jobs:
        assert job["world_size"] == 2 and job["tensor_parallel"]["tp_size"] == 2, job["tensor_parallel"]
        assert job["tensor_parallel"]["lean_layers"] == job["tensor_parallel"]["layers"] == 4
        assert job["match_rate"] in (None, 1.0) and job["validation"]["suspect"] == 0, (job["method"], job["validation"])
        for (pid, turn, role), out in job["_outputs"].items():
            assert out == greedy[pid, turn], (job["method"], job.get("scoring"), role, pid, turn)


@pytest.mark.slow  # four processes (~1-2 min)
def test_two_groups_of_two_split_the_prompts(cli, tmp_path):
    """world 4, model.tp_size=2: two tensor-parallel groups, the prompts split over them as over data-parallel ranks;
    each group's two ranks decode the same prompts; the merged samples equal one process's; one MLflow run."""
    greedy = _greedy(cli, tmp_path, "tiny_qwen3", "dataset.max_samples=3")
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    args = ["model=tiny_qwen3", *(a for a in SMALL if a != "tracking=none"), f"tracking.uri={uri}",
            "dataset.max_samples=3", "method=ddtree", "model.tp_plan=auto", "model.tp_size=2",
            f"runs_dir={tmp_path / 'runs'}", f"hydra.run.dir={tmp_path / 'four'}"]
    proc = _torchrun(args, tmp_path, 4)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "tensor parallel: 2 ranks a group x 2 group(s)" in proc.stdout
    job = tmp_path / "four"
    ranks = [{r["id"] for r in _records(job / f"samples.rank{k}.jsonl")} for k in range(4)]
    assert ranks == [{"tiny-0", "tiny-2"}, {"tiny-0", "tiny-2"}, {"tiny-1"}, {"tiny-1"}]
    summary = json.loads((job / "summary.json").read_text())
    assert summary["num_prompts"] == 3 and summary["tensor_parallel"]["groups"] == 2
    for (pid, turn, _role), out in _outputs(job).items():
        assert out == greedy[pid, turn], (pid, turn)

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("ddtree").experiment_id])  # rank 0's alone
    assert run.info.status == "FINISHED" and run.data.tags["tp_size"] == "2" and run.data.tags["world_size"] == "4"


@pytest.mark.slow  # two processes (~60 s)
def test_bf16_verdicts_and_sampled_tokens_agree_on_every_rank(tmp_path):
    """bf16, greedy and T = 1: no suspect verdict; at T > 0 each rank samples from the same logits (the collectives
    hand every rank the same bytes) with the same seeded generator, so the ranks of a group draw the same tokens (the
    job refuses a group that does not: ddtree.pipeline.distributed.first_of_each_group); here each rank's own
    records are compared."""
    sweep = tmp_path / "sweep"
    args = ["model=tiny_qwen3_5", *SMALL, "method=dflash", "model.dtype=bfloat16", "temperature=0,1",
            "model.tp_plan=auto", f"runs_dir={tmp_path / 'runs'}", f"hydra.sweep.dir={sweep}", "-m"]
    proc = _torchrun(args, tmp_path, 2)
    assert proc.returncode == 0, proc.stderr[-5000:]
    for job in (sweep / "0", sweep / "1"):
        per_rank = [[(r["id"], r["turn"], r["role"], r["output_ids"]) for r in _records(job / f"samples.rank{k}.jsonl")]
                    for k in (0, 1)]
        assert per_rank[0] == per_rank[1] and {r[2] for r in per_rank[0]} == {"baseline", "method"}
        summary = json.loads((job / "summary.json").read_text())
        assert summary["validation"]["suspect"] == 0, summary["validation"]
    assert json.loads((sweep / "1" / "summary.json").read_text())["temperature"] == 1


@pytest.mark.slow  # two processes (~30 s)
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_the_engine_runs_its_own_paths_on_the_shards(tmp_path, model_type):
    """The lean forward runs every layer on each rank's shards (the plain model call never runs in a round), DDTree's
    verification goes through the split tree attention, the GDN on its gathered projections; every rank decodes
    the same tokens, equal to HF greedy decoding of the whole target."""
    methods = "ar,ddtree:8,pair:8" + (",mtp,mtp:8" if model_type == "qwen3_5_text" else "")
    out = tmp_path / "tp.json"
    proc = _torchrun([str(out), "--model-type", model_type, "--methods", methods], tmp_path, 2,
                     module="tp_worker.py")
    assert proc.returncode == 0, proc.stderr[-5000:]
    rep = json.loads(out.read_text())
    attention_layers = 4 if model_type == "qwen3" else 1  # (the tiny hybrid: 3 Gated DeltaNet layers, 1 attention)
    assert rep["world"] == 2 and rep["ranks_agree"]
    assert rep["paths"]["lean_layers"] == rep["paths"]["layers"] == 4 and rep["paths"]["sharded_projections"] > 0
    assert not any("transformers' forward" in n or "lean forward: off" in n for n in rep["paths"]["notes"])
    assert "the target is tensor-parallel" in rep["compiled_round"]  # compile=auto: the eager round, saying why
    for spec, m in rep["methods"].items():
        assert all(m["exact"]), spec
        assert m["model_calls"] == 0 and m["lean_layer_calls"] > 0, spec
        assert m["collectives_per_round"] > 0 and m["syncs_per_round"] < 1.5, (spec, m)
        if spec != "ar":  # every verification of a drafted block or tree, in each attention layer: split
            assert m["split_attention_calls"] == m["rounds"] * attention_layers, (spec, m)
