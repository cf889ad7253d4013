"""Verdicts in the pipeline: summary.json, samples.jsonl, MLflow metrics, the table, strict, the re-check CLI.

The engine's validator itself is tested in test_output_check.py against HF greedy decoding.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from ddtree.engine import loop
from ddtree.errors import ConfigError
from ddtree.pipeline.config_checks import validate
from ddtree.pipeline.output_verdicts import SuspectOutputs
from ddtree.pipeline.recheck import main, recheck
from ddtree.pipeline.sweep_table import verdict_cell
from ddtree.pipeline.tracking import numeric_metrics

# the shared small job with three prompts of twelve tokens
MORE = ("dataset.max_samples=3", "max_new_tokens=12", "device=cpu")


def _recheck(capsys, *args: str) -> tuple[int, str, str]:
    """`python -m ddtree.validate ARGS` in this process: (exit code, stdout, stderr)."""
    capsys.readouterr()
    try:
        main(list(args))
        code = 0
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_verdict_cell():
    assert verdict_cell({"exact": 12, "tie": 4, "ok": 0, "suspect": 0}) == "16 ok (12 exact, 4 tie)"
    assert verdict_cell({"exact": 3, "tie": 0, "ok": 0, "suspect": 0}) == "3 ok (3 exact)"
    assert verdict_cell({"exact": 0, "tie": 0, "ok": 5, "suspect": 0}) == "5 ok"
    assert verdict_cell({"exact": 14, "tie": 0, "ok": 0, "suspect": 2}) == "2 SUSPECT"
    assert verdict_cell(None) == "-"


def test_bf16_job_records_verdicts_and_the_recheck_finds_a_planted_fault(cli, tmp_path, capsys, small):
    job = tmp_path / "job"
    proc = cli(*small, *MORE, "model.dtype=bfloat16", "method=ddtree", "budget=16", f"hydra.run.dir={job}", "tracking=none")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "verdicts" in proc.stdout and " ok (" in proc.stdout  # the table's column
    summary = json.loads((job / "summary.json").read_text())
    v = summary["validation"]
    assert v["checked"] == 4 and v["suspect"] == 0 and v["exact"] + v["tie"] == 4  # 3 prompts, one with 2 turns
    assert v["tolerance"]["dtype"] == "bfloat16" and v["tolerance"]["calibrated_positions"] > 0
    assert 0 < v["share_of_job"] < 1 and v["seconds"] > 0
    samples = [json.loads(line) for line in (job / "samples.jsonl").read_text().splitlines()]
    assert {r["validation"]["verdict"] for r in samples if r["role"] == "method"} <= {"exact", "tie"}
    assert {r["validation"]["verdict"] for r in samples if r["role"] == "baseline"} == {"ok"}

    metrics = numeric_metrics(summary)  # what the job logs to MLflow
    assert metrics["validation.checked"] == 4 and metrics["validation.suspect"] == 0

    # the re-check of the finished job agrees; then a token planted in one method output is found
    again = recheck(job)
    assert json.loads((job / "validation.json").read_text())["validation"]["checked"] == 4
    assert (again["exact"], again["tie"], again["suspect"]) == (v["exact"], v["tie"], 0)
    rec = next(r for r in samples if r["role"] == "method" and len(r["output_ids"]) > 6)
    rec["output_ids"][5] = (rec["output_ids"][5] + 1) % 128
    (job / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    code, out, err = _recheck(capsys, str(job), "--strict")
    assert code == 3 and "1 SUSPECT" in out, out + err
    assert f"prompt {rec['id']} turn {rec['turn']}: method: token {rec['output_ids'][5]} at position 5" in out


def test_recheck_of_a_dir_without_a_job_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("DDTREE_TRACEBACK", raising=False)
    code, _, err = _recheck(capsys, str(tmp_path))
    assert code == 2 and err.startswith("error: job_dir:") and len(err.splitlines()) == 1


def test_validation_off_and_bad_settings(tmp_path, monkeypatch, small, compose):
    from ddtree.pipeline.job import run_job

    monkeypatch.chdir(tmp_path)  # without a Hydra runtime the job writes to the cwd
    assert run_job(compose(*small, *MORE, "validation=off", "tracking=none", "max_new_tokens=4",
                           hydra_node=False))["validation"] is None
    assert "validation" not in json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0])
    for bad in ("validation.mode=always", "validation.rescore_dtype=int8", "validation.false_alarm=0"):
        with pytest.raises(ConfigError, match=bad.split("=")[0]):
            validate(compose(*small, *MORE, bad))


def test_strict_job_with_a_wrong_token_fails_after_recording_it(tmp_path, monkeypatch, small, compose):
    from ddtree.pipeline.job import run_job

    real, planted = loop.walk, []

    def wrong_token(tree, choice):
        w = real(tree, choice)
        if not planted and len(tree) > 1:  # the method's first round: the output gets a token the target did not pick
            planted.append(w.tokens[-1])
            w = dataclasses.replace(w, tokens=w.tokens[:-1] + [(w.tokens[-1] + 1) % 100])
        return w

    monkeypatch.setattr(loop, "walk", wrong_token)
    # the fault sits in walk(), which a lazy-head round (a greedy tree of 65+ nodes) does not call
    monkeypatch.setattr("ddtree.engine.target.LAZY_HEAD_MIN", 10**9)
    monkeypatch.chdir(tmp_path)  # without a Hydra runtime the job writes to the cwd
    cfg = compose(*small, *MORE, "validation=strict", "tracking=none", "warmup=false", "baseline_reuse=false",
                  hydra_node=False)
    with pytest.raises(SuspectOutputs, match="validation.strict: 1 of 4 outputs are suspect"):
        run_job(cfg)
    assert planted
    v = json.loads((tmp_path / "summary.json").read_text())["validation"]
    assert v["suspect"] == 1 and v["first_suspects"][0]["side"] == "method"


# ---------------------------------------------------------------- MoE targets in bf16: routers near a tie

MOE_TYPES = ("minimax_m2", "qwen3_moe", "gpt_oss", "deepseek_v3", "glm4_moe", "laguna")


def _moe_job(cli, tmp_path, model_type: str, seed: int, *overrides: str) -> list[dict]:
    """The summaries of `python -m ddtree.run` on a tiny random bf16 MoE target, default settings otherwise."""
    sweep = tmp_path / f"{model_type}-{seed}"
    proc = cli("model=tiny_qwen3", f"model.tiny.model_type={model_type}", f"model.tiny.seed={seed}",
               f"model.name=tiny_{model_type}", "model.dtype=bfloat16", "dataset=tiny", "tracking=none",
               f"hydra.sweep.dir={sweep}", *overrides, "-m", timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]


def _assert_no_suspect(summaries: list[dict]) -> None:
    for s in summaries:
        v = s["validation"]
        assert v["suspect"] == 0 and v["baseline_suspect"] == 0, v["first_suspects"]
        assert v["exact"] + v["tie"] + v["ok"] == v["checked"] > 0  # ok: a later turn after a divergence
        assert "routing_flips" in v["tolerance"] and "shape_ties" in v  # the MoE evidence is recorded


@pytest.mark.slow  # fast: a bf16 job through the CLI (above), router ties in process (tests/test_output_check.py)
def test_a_bf16_moe_job_through_the_cli_has_no_suspect(cli, tmp_path):
    """MiniMax-M2 (issue 47's target), DDTree with the default budget, 2 prompts, 24 tokens."""
    _assert_no_suspect(_moe_job(cli, tmp_path, "minimax_m2", 0, "dataset.max_samples=2", "max_new_tokens=24"))


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("model_type", MOE_TYPES)
def test_bf16_moe_grid_through_the_cli_has_no_suspect(cli, tmp_path, model_type, seed):
    """Issue 47's grid: tiny random bf16 MoE targets, a random DFlash drafter, DFlash and DDTree with the default
    budget, the 6 built-in prompts, 64 new tokens: every output of a correct engine `exact` or `tie`."""
    _assert_no_suspect(_moe_job(cli, tmp_path, model_type, seed, "max_new_tokens=64", "method=dflash,ddtree"))
