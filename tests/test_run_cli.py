"""End to end through the real CLI (`python -m ddtree.run`) on tiny random models and a temporary SQLite store.

The real engine (ddtree.generate) and drafter (DFlashDrafter.random_for_target) run here; the MLflow
store is read back with MlflowClient.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import copy_checkout

from ddtree.pipeline import config_checks as V
from ddtree.pipeline import models as M


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _runs(uri: str):
    client = _client(uri)
    exp = client.get_experiment_by_name("ddtree")
    return [] if exp is None else client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def _artifacts(uri: str, run_id: str) -> set[str]:
    return {a.path for a in _client(uri).list_artifacts(run_id)}


def _ok(proc) -> str:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc.stdout


@pytest.mark.slow  # ~1 min of CLI subprocesses: make test-slow (the crash-keeps-samples test stays in make test)
def test_single_run_sweep_and_resume(cli, tmp_path, small):
    runs_dir, uri = tmp_path / "runs", f"sqlite:///{tmp_path}/store/mlflow.db"
    common = (*small, f"runs_dir={runs_dir}", f"tracking.uri={uri}")

    # 1. a single run: a plain MLflow run with params, metrics, tags and artifacts
    job = tmp_path / "single"
    out = _ok(cli(*common, "method=ddtree", "budget=16", f"hydra.run.dir={job}"))
    assert "speedup" in out and "tiny_qwen3" in out  # the table
    samples = [json.loads(line) for line in (job / "samples.jsonl").read_text().splitlines()]
    # 2 prompts, the second has 2 turns: 3 generations for the method and 3 for the AR baseline
    assert sorted((r["role"], r["method"]) for r in samples) == [("baseline", "ar")] * 3 + [("method", "ddtree")] * 3
    assert {"id", "turn", "output_ids", "text", "acceptance_lengths", "stage_seconds", "tokens_per_s"} <= set(samples[0])
    assert all(0 < len(r["output_ids"]) <= 8 for r in samples)
    summary = json.loads((job / "summary.json").read_text())
    assert (summary["method"], summary["budget"], summary["block_size"], summary["temperature"]) == ("ddtree", 16, 16, 0.0)
    assert summary["match_rate"] == 1.0  # greedy DDTree must reproduce AR exactly
    assert summary["tau"] >= 1.0 and summary["speedup"] > 0 and summary["baseline_tokens_per_s"] > 0
    assert set(summary["stage_seconds_mean"]) == {"draft", "tree", "verify", "commit"}
    assert {"torch", "transformers", "python"} <= set(summary["versions"]) and summary["device"] == "cpu"
    assert "applied" in summary["compat"]

    (run,) = _runs(uri)
    assert run.info.status == "FINISHED" and run.data.tags["ddtree.role"] == "run"
    assert "mlflow.parentRunId" not in run.data.tags
    p = run.data.params
    assert (p["method"], p["budget"], p["model.name"], p["drafter.kind"], p["attention.target"]) == (
        "ddtree", "16", "tiny_qwen3", "random", "sdpa")
    assert run.data.metrics["match_rate"] == 1.0 and run.data.metrics["tau"] == pytest.approx(summary["tau"])
    assert {"tokens_per_s", "baseline_tokens_per_s", "speedup", "stage_seconds_mean.verify"} <= set(run.data.metrics)
    assert {"torch_version", "transformers_version", "python_version", "device_name", "compat.applied"} <= set(run.data.tags)
    assert (run.data.tags["ddtree.model"], run.data.tags["ddtree.drafter"], run.data.tags["ddtree.dataset"]) == (
        "tiny_qwen3", "random", "tiny")  # the names of what ran
    assert {"samples.jsonl", "summary.json", "acceptance_hist.png", "config.yaml"} <= _artifacts(uri, run.info.run_id)

    # 2. a sweep over budget: one parent, one child per job; the models load once (one process)
    sweep = tmp_path / "sweep"
    out = _ok(cli(*common, "budget=4,8", f"hydra.sweep.dir={sweep}", "-m"))
    assert out.count("speedup") == 3 and (sweep / "mlflow_parent.json").is_file()  # 2 jobs + the sweep table
    parent_id = json.loads((sweep / "mlflow_parent.json").read_text())["run_id"]
    runs = _runs(uri)
    parent = next(r for r in runs if r.info.run_id == parent_id)
    assert parent.data.tags["ddtree.role"] == "sweep" and parent.info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_id]
    assert sorted(r.data.params["budget"] for r in children) == ["4", "8"]
    assert all(r.info.status == "FINISHED" and r.data.tags["ddtree.role"] == "job" for r in children)
    assert all("summary.json" in _artifacts(uri, r.info.run_id) for r in children)
    assert len(runs) == 4

    # 3. the same sweep again, in a new sweep dir: every job already finished, so each is skipped
    out = _ok(cli(*common, "budget=4,8", f"hydra.sweep.dir={tmp_path / 'sweep2'}", "-m"))
    assert out.count("skipped") == 2 and "force=true" in out
    assert len(_runs(uri)) == 4  # (force=true is tested in-process below, where the models are already loaded)


BAD_INPUTS = {
    "unknown group option": (["model=no_such_model"], "model: unknown option 'no_such_model'"),
    "budget <= 0": (["budget=0"], "budget: must be >= 1"),
    "temperature < 0": (["temperature=-1"], "temperature: must be >= 0"),
    "missing prompt file": (["dataset=jsonl", "dataset.path=missing.jsonl"], "dataset.path: no such file"),
    "malformed jsonl line": (["dataset=jsonl", "dataset.path=bad.jsonl"], "line 2 is not valid JSON"),
    "drafter incompatible with target": (["drafter=qwen3_8b"], "trained for Qwen/Qwen3-8B"),
    "attention backend not installed": (["method=dflash", "attention=flash_attention_2"], "pip install flash-attn"),
    "tree method on a flash backend": (["method=ddtree", "attention=flash_attention_2"], "use attention=sdpa"),
    "mistyped value": (["budget=lots"], "budget: must be a whole number or auto, got 'lots'"),
    "no streams": (["concurrency=0"], "concurrency: must be a whole number >= 1, got 0"),
    "an engine without a batched round": (["engine=upstream", "upstream.path=ddtree-checkout", "concurrency=2"],
                                          "concurrency: engine=upstream decodes one prompt at a time"),
    # preflight (ddtree.pipeline.preflight): the sources and prompts, before the store or any weights
    "model folder missing": (["model=hf", "model.name_or_path=./no_such_dir", "method=ar"],
                             "model.name_or_path: no such folder"),
    "model folder lacks config.json": (["model=hf", "model.name_or_path=./empty", "method=ar"], "has no config.json"),
    "hub model not cached, offline": (["model=qwen3_8b", "drafter=none", "method=ar"],
                                      "hf download Qwen/Qwen3-8B"),
    "hub id malformed": (["model=qwen3_8b", "model.name_or_path=a//b", "drafter=none", "method=ar"],
                         "model.name_or_path: no such folder"),
    "drafter folder missing": (["drafter=pretrained", "drafter.name_or_path=./no_drafter"],
                               "drafter.name_or_path: no such folder"),
    "tokenizer folder lacks files": (["model.tokenizer=./empty", "method=ar"], "model.tokenizer:"),
    "prompt file not UTF-8": (["dataset=jsonl", "dataset.path=latin1.jsonl"], "latin1.jsonl is not UTF-8"),
    "prompt longer than the context": (["dataset=jsonl", "dataset.path=long.jsonl"],
                                       "exceeds the target's context of 2048 tokens"),
    # a whitespace prompt under a word-level tokenizer: no tokens at all
    "prompt of no tokens": (["model.tokenizer=./wordlevel", "dataset=jsonl", "dataset.path=blank.jsonl",
                             "dataset.chat_template=false"], "dataset.path: prompt 'blank' ('   ') is no tokens"),
    "tree too large for memory": (["method=ddtree", "budget=100000"], "budget: a tree of 100000 nodes needs about"),
    "backend the target's class does not take": (["attention=flex_attention"],
                                                 "Qwen3_5ForCausalLM (model_type 'qwen3_5_text') does not take"),
    "experiment misspelled": (["experiment=toyy"], "experiment: unknown option 'toyy'"),
    "CUDA asked for without one": (["device=cuda"], "device: cuda requested but CUDA is not available"),
}


# Every case runs in-process (composition and the job's `configure`, the code path of the CLI up to its one line,
# ~1 s each); a few also through a CLI process (~8 s each: a composition error, a ConfigError of the config
# checks and one of the pre-load checks), the others through the CLI under `make test-slow`
FAST_BAD_INPUTS = ("unknown group option", "budget <= 0", "tree too large for memory")


def _bad_input_files(tmp_path: Path) -> None:
    """The files the battery's cases name, in the directory the job runs from."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    (tmp_path / "bad.jsonl").write_text('{"id": 1, "turns": ["fine"]}\n{"id": 2, "turns": ["broken"\n')
    (tmp_path / "latin1.jsonl").write_bytes('{"id": 1, "turns": ["café"]}\n'.encode("latin-1"))
    (tmp_path / "long.jsonl").write_text(json.dumps({"id": "long", "turns": ["count " * 2000]}) + "\n")
    (tmp_path / "blank.jsonl").write_text(json.dumps({"id": "blank", "turns": ["   "]}) + "\n")
    (tmp_path / "empty").mkdir()
    copy_checkout("fake_upstream", tmp_path)  # (a stand-in of the authors' repository: ddtree-checkout)
    words = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "</s>": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()  # whitespace is no token at all
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", eos_token="</s>").save_pretrained(
        tmp_path / "wordlevel")


def _skip_if_not_a_mistake_here(case: str) -> None:
    import torch

    if case == "attention backend not installed" and V.importlib.util.find_spec("flash_attn") is not None:
        pytest.skip("flash_attn is installed here")
    if case == "CUDA asked for without one" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_line_before_model_work_in_process(case, compose, tmp_path, monkeypatch):
    """The message the CLI prints (`error: ` + this line), from composition and the job's checks before any load."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from ddtree.errors import ConfigError
    from ddtree.pipeline import job as R
    from ddtree.pipeline.console import one_line

    _skip_if_not_a_mistake_here(case)
    _bad_input_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    args, expected = BAD_INPUTS[case]
    load = M.load_target
    monkeypatch.setattr(M, "load_target", lambda *a: pytest.fail(f"a model was loaded for {case}") or load(*a))
    try:
        R.configure(compose(*args, f"runs_dir={tmp_path / 'runs'}", hydra_node=False))
    except ConfigError as e:
        line = str(e)
    except (HydraException, OmegaConfBaseException) as e:
        line = one_line(e)
    else:
        pytest.fail(f"{case}: accepted")
    assert expected in line and "\n" not in line, line
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("case", [c if c in FAST_BAD_INPUTS else pytest.param(c, marks=pytest.mark.slow)
                                  for c in BAD_INPUTS])
def test_bad_input_exits_with_one_line(cli, tmp_path, case):
    _skip_if_not_a_mistake_here(case)
    _bad_input_files(tmp_path)
    args, expected = BAD_INPUTS[case]
    proc = cli(*args, f"runs_dir={tmp_path / 'runs'}", f"hydra.run.dir={tmp_path / 'job'}")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    # refused before any model work: no tracking store was opened and nothing was generated
    assert not (tmp_path / "runs" / "mlflow.db").exists() and not (tmp_path / "job" / "samples.jsonl").exists()


def test_load_time_drafter_check_and_crash_keeps_samples(tmp_path, monkeypatch, small, compose):
    """In-process: a drafter that does not fit its target is refused right after loading (before any
    generation), and a job that crashes mid-way ends its MLflow run FAILED with the samples it finished."""
    import ddtree.engine.loop
    from ddtree.errors import ConfigError
    from ddtree.pipeline import job as R

    monkeypatch.chdir(tmp_path)  # outside Hydra a job writes to the cwd
    uri = f"sqlite:///{tmp_path}/mlflow.db"

    def cfg(*extra):
        return compose(*small, "device=cpu", f"tracking.uri={uri}", "warmup=false", "baseline=false",
                       "compat.enabled=false", *extra, hydra_node=False)

    with pytest.raises(ConfigError) as e:  # layer 9 does not exist in a 4-layer target
        R.run_job(cfg("drafter.target_layer_ids=[1,9]"))
    assert "target_layer_ids" in e.value.setting and not _runs(uri)

    real, calls = ddtree.engine.loop.Engine.generate, []

    def crash_on_second_prompt(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("simulated crash")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ddtree.engine.loop.Engine, "generate", crash_on_second_prompt)
    with pytest.raises(RuntimeError, match="simulated crash"):
        R.run_job(cfg())
    (run,) = _runs(uri)
    assert run.info.status == "FAILED" and "simulated crash" in run.data.tags["error"]
    assert "samples.jsonl" in _artifacts(uri, run.info.run_id)
    kept = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert len(kept) == 1 and json.loads(kept[0])["id"] == "tiny-0"
    target = M.MODELS.target
    monkeypatch.setattr(ddtree.engine.loop.Engine, "generate", real)
    assert R.run_job(cfg("budget=8"))["match_rate"] is None  # no baseline in this job
    assert M.MODELS.target is target  # the cached models were reused, not reloaded
    assert R.run_job(cfg("budget=8")) is None  # finished before: skipped
    assert R.run_job(cfg("budget=8", "force=true"))["budget"] == 8  # force=true reruns it
    assert [r.info.status for r in _runs(uri)] == ["FAILED", "FINISHED", "FINISHED"]
    assert R.run_job(cfg("budget=8", "tracking=none"))["budget"] == 8  # no store, nothing skipped
    assert len(_runs(uri)) == 3
    M.MODELS.clear()


def test_cli_works_from_any_cwd_and_prints_help(cli, tmp_path: Path):
    proc = cli("--cfg", "job", "model=tiny_llama", cwd=tmp_path)
    assert proc.returncode == 0 and "tiny_llama" in proc.stdout and "budget: 64" in proc.stdout


def test_baseline_reused_within_a_process(tmp_path, monkeypatch, small, compose):
    """A later job of the same process on the same prompts and settings takes the AR baseline from the
    earlier one (the paper runs AR once per prompt); any setting the baseline depends on breaks the reuse."""
    from ddtree.pipeline import job as R

    monkeypatch.chdir(tmp_path)
    M.MODELS.clear()

    def cfg(*extra):
        return compose(*small, "device=cpu", "tracking=none", "warmup=false", "compat.enabled=false", *extra,
                       hydra_node=False)

    def baseline(summary_path=tmp_path / "samples.jsonl"):
        rows = [json.loads(x) for x in summary_path.read_text().splitlines()]
        return [r for r in rows if r["role"] == "baseline"]

    first = R.run_job(cfg("method=dflash"))
    ran = baseline()
    assert first["baseline_reused_from"] is None and not any("reused_from" in r for r in ran)

    second = R.run_job(cfg("method=ddtree", "budget=8"))
    got = baseline()
    assert second["baseline_reused_from"] == str(tmp_path)
    assert [r["output_ids"] for r in got] == [r["output_ids"] for r in ran]
    assert [r["total_s"] for r in got] == [r["total_s"] for r in ran]  # the same timings, not a rerun
    assert all(r["reused_from"] == str(tmp_path) for r in got)
    assert second["baseline_tokens_per_s"] == first["baseline_tokens_per_s"] and second["match_rate"] == 1.0

    for extra in (("max_new_tokens=6",), ("seed=1", "temperature=1"), ("dataset.max_samples=1",),
                  ("baseline_reuse=false",)):
        s = R.run_job(cfg("method=ddtree", "budget=8", *extra))
        assert s["baseline_reused_from"] is None, extra
    M.MODELS.clear()
    assert R.run_job(cfg("method=ddtree", "budget=8"))["baseline_reused_from"] is None  # new target: AR again
    M.MODELS.clear()


def test_only_the_entry_point_reads_the_process_model_cache():
    """A job's phases get what they need in a JobContext; the per-process cache (models.MODELS) is read by run_job
    alone, which hands it over."""
    import ast
    import inspect

    from ddtree.pipeline import job as R
    from ddtree.pipeline import output_verdicts

    for module in (R, output_verdicts):
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.FunctionDef) and node.name != "run_job":
                names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                assert "MODELS" not in names, f"{module.__name__}.{node.name} reads the module-level cache"
    params = inspect.signature(R._generate_shard).parameters
    assert list(params)[0] == "ctx" and len(params) <= 5


def test_a_drafter_that_failed_to_load_is_not_taken_for_the_cached_one(small, compose):
    """A misfit drafter refused at load leaves the cache without a drafter key: the next job with the drafter
    loaded before loads it again (it used to find the old key and no drafter)."""
    from ddtree.errors import ConfigError

    def rc(*extra):
        from ddtree.pipeline.schema import to_run_config

        return to_run_config(compose(*small, "device=cpu", "tracking=none", *extra, hydra_node=False))

    cache = M.ModelCache()
    assert M.get_models(rc(), "cpu", cache)[2] is not None
    with pytest.raises(ConfigError):
        M.get_models(rc("drafter.target_layer_ids=[1,9]"), "cpu", cache)
    assert M.get_models(rc(), "cpu", cache)[2] is not None
