"""The compiled round where users start it: `python -m ddtree.run compile=true` with the compat registry on.

The compat row `sliding-window` wraps transformers' attention functions; the DFlash drafter calls one inside the
compiled draft graph, where a wrapt proxy failed dynamo's guards ("FuncDefaultsGuardAccessor: Not a function on
self.drafter._attend"): compat now puts plain functions in a module's place (compat.core.Patcher.wrap). These runs go
through the real CLI (Hydra, the registry applied as a user's run applies it) with sliding-window drafters, pure and
hybrid targets and every method, the graphs traced by dynamo (DDTREE_COMPILE_BACKEND=eager: seconds; the slow test
runs inductor, as a user's run does). References: the AR baseline in the same job (match 1.0), the validator's
teacher-forced verdicts. `compile=auto` on CUDA takes the same path as `compile=true` here (`static_round_for`):
the compiled round runs where it can, or the run says why not.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddtree.engine.drafter import DFlashDrafter
from ddtree.pipeline.sweep_table import format_table
from ddtree.tiny import tiny_model

COMMON = ("dataset=tiny", "dataset.max_samples=2", "max_new_tokens=8", "tracking=none", "warmup=false")


def _sliding_drafter(tmp_path: Path, model_type: str) -> Path:
    """A random two-layer DFlash drafter with a sliding layer (window 4) for the CLI's tiny target, saved."""
    target = tiny_model(model_type, seed=0, vocab_size=128, num_hidden_layers=4)
    drafter = DFlashDrafter.random_for_target(target.config, num_layers=2, block_size=8, seed=1,
                                              layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    out = tmp_path / f"drafter-{model_type}"
    drafter.save_pretrained(out)
    return out


def _summaries(sweep: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"), key=lambda p: int(p.parent.name))]


def _ok(proc) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    return proc.stdout


@pytest.mark.parametrize(("model", "methods"), [
    # the pure target's compiled round through the CLI: tests/test_dflash2.py (slow) and tests/test_compile.py
    pytest.param("tiny_qwen3", "ar,dflash,ddtree", marks=pytest.mark.slow),
    ("tiny_qwen3_5", "ar,dflash,ddtree,mtp")])
def test_compile_true_through_the_cli_with_compat_on(cli, tmp_path, monkeypatch, model, methods):
    monkeypatch.setenv("DDTREE_COMPILE_BACKEND", "eager")  # dynamo's graphs, no code generation (seconds)
    drafter = _sliding_drafter(tmp_path, "qwen3" if model == "tiny_qwen3" else "qwen3_5_text")
    sweep = tmp_path / "sweep"
    out = _ok(cli(f"model={model}", "drafter=pretrained", f"drafter.name_or_path={drafter}", f"method={methods}",
                  "budget=16", "compile=true", *COMMON, f"runs_dir={tmp_path / 'runs'}", f"hydra.sweep.dir={sweep}",
                  "-m", timeout=600))
    summaries = _summaries(sweep)
    assert [s["method"] for s in summaries] == methods.split(",")
    for s in summaries:
        assert s["compat"]["patches"]["sliding-window"] == "applied"
        assert s["round"] == {"ran": "compiled", "why": None, "fallback": False}, s["round"]
        if s["method"] != "ar":  # (method=ar is its own baseline)
            assert s["baseline_round"] == {"ran": "compiled", "why": None, "fallback": False}
        assert s["method"] == "ar" or s["match_rate"] == 1.0, s["method"]  # the AR baseline's tokens
        assert s["validation"]["suspect"] == 0  # the teacher-forced verdicts (fp32: exact where a baseline runs)
        assert s["method"] == "ar" or s["validation"]["exact"] >= 2, s["validation"]
    table = out[out.rindex("sweep "):].splitlines()[1:]  # the sweep table: a round column, every row compiled
    assert table[0].split()[-1] == "round" and all(row.split()[-1] == "compiled" for row in table[1:])


@pytest.mark.slow  # inductor's code generation: minutes on this CPU
def test_compile_true_with_concurrency_runs_the_compiled_batched_round(cli, tmp_path, monkeypatch):
    """compile=true concurrency=2 on the hybrid (a sliding-window drafter): the method's and the baseline's streams
    through the compiled batched round (ddtree.engine.batch.CompiledRound), the AR baseline's tokens (match 1.0),
    the verdicts, and the summary saying the rounds were compiled."""
    monkeypatch.setenv("DDTREE_COMPILE_BACKEND", "eager")
    drafter = _sliding_drafter(tmp_path, "qwen3_5_text")
    job = tmp_path / "job"
    _ok(cli("model=tiny_qwen3_5", "drafter=pretrained", f"drafter.name_or_path={drafter}", "method=ddtree",
            "budget=16", "compile=true", "concurrency=2", *COMMON, f"runs_dir={tmp_path / 'runs'}",
            f"hydra.run.dir={job}", timeout=600))
    s = json.loads((job / "summary.json").read_text())
    assert s["concurrency"] == 2 and s["match_rate"] == 1.0 and s["validation"]["suspect"] == 0
    assert s["round"] == s["baseline_round"] == {"ran": "compiled", "why": None, "fallback": False}, s["round"]


@pytest.mark.slow  # inductor's code generation of the toy pair (~2 min on 2 shared cores); the fast suite's compile=true
# CLI job is the hybrid one above (dynamo's graphs), inductor's round: tests/test_compile.py (slow)
def test_the_issue_command_compiles_the_toy_pair(cli, tmp_path):
    job = tmp_path / "job"
    _ok(cli("method=ddtree", "budget=16", "compile=true", "dataset.max_samples=2", "tracking=none",
            f"runs_dir={tmp_path / 'runs'}", f"hydra.run.dir={job}", timeout=1200))
    s = json.loads((job / "summary.json").read_text())
    assert s["round"]["ran"] == "compiled" and s["match_rate"] == 1.0


@pytest.mark.slow  # fast: the engine's note in process (tests/test_compile.py::test_compile_settings_and_refusals), the
# summary's round through the CLI (compiled, above); every default CLI job of the fast suite runs compile=auto eagerly
def test_compile_auto_on_a_cpu_says_why_the_round_is_eager(cli, tmp_path):
    job = tmp_path / "job"
    _ok(cli("model=tiny_qwen3_5", "method=ddtree", "budget=8", *COMMON, f"runs_dir={tmp_path / 'runs'}",
            f"hydra.run.dir={job}"))
    s = json.loads((job / "summary.json").read_text())
    assert s["compile"] == "auto" and s["round"]["ran"] == "eager" and not s["round"]["fallback"]
    assert "compile=auto compiles on CUDA only" in s["round"]["why"]


def test_the_table_marks_a_fallback_and_says_why():
    base = {"model": "m", "method": "ddtree", "budget": 16, "block_size": 16, "num_prompts": 2, "tau": 3.0,
            "tokens_per_s": 10.0, "baseline_tokens_per_s": 5.0, "speedup": 2.0, "match_rate": 1.0}
    rows = [{**base, "round": {"ran": "compiled", "why": None, "fallback": False}},
            {**base, "round": {"ran": "eager", "why": "compile=auto: the compiled round failed (X: y)",
                               "fallback": True}}]
    table = format_table(rows).splitlines()
    assert table[0].split()[-2:] == ["round", "note"]
    assert table[1].rstrip().endswith("compiled")
    assert "eager*" in table[2] and table[2].endswith("*compile=auto: the compiled round failed (X: y)")
