"""A new user's first day, through the real CLI: any checkpoint by path, the hub's answers as one line,
prompts truncated only when asked, and a fresh MLflow store shared by processes that start together."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ddtree.pipeline import schema as C

TINY = ("dataset=tiny", "dataset.max_samples=1", "max_new_tokens=8", "warmup=false")


def _one_line(proc, expected: str) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    return lines[0]


class _StandInHub(BaseHTTPRequestHandler):
    """Answers file lookups the way the Hugging Face hub does for a missing and for a gated repo."""

    def do_HEAD(self):  # noqa: N802 - http.server's spelling
        code, error = (403, "GatedRepo") if "/gated/" in self.path else (404, "RepoNotFound")
        self.send_response(code)
        self.send_header("X-Error-Code", error)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD  # noqa: N815

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in_hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _StandInHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _cli_env(tmp_path: Path, **env: str):
    def run(*args: str) -> subprocess.CompletedProcess:
        full = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "0", "DDTREE_TRACEBACK": "",
                "HF_HOME": str(tmp_path / "hf"), **env}
        return subprocess.run([sys.executable, "-m", "ddtree.run", *args, f"runs_dir={tmp_path / 'runs'}",
                               f"hydra.run.dir={tmp_path / 'job'}"], cwd=tmp_path, env=full,
                              capture_output=True, text=True, timeout=300)
    return run


@pytest.mark.slow  # ~20 s of CLI processes
def test_online_hub_answers_are_one_line(tmp_path, stand_in_hub):
    """A repo that does not exist, a gated one, and no network: each one line before any store or load."""
    online = _cli_env(tmp_path, HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0", HF_ENDPOINT=stand_in_hub)
    _one_line(online("model=hf", "model.name_or_path=nobody/no-such-model", "method=ar"),
              "model.name_or_path: nobody/no-such-model does not exist on the hub")
    _one_line(online("drafter=pretrained", "drafter.name_or_path=org/gated"),
              "drafter.name_or_path: org/gated is gated")
    dead = _cli_env(tmp_path, HF_HUB_OFFLINE="0", TRANSFORMERS_OFFLINE="0", HF_ENDPOINT="http://127.0.0.1:9")
    line = _one_line(dead("model=qwen3_8b", "drafter=none", "method=ar"), "the hub cannot be reached")
    assert "hf download Qwen/Qwen3-8B" in line
    assert not (tmp_path / "runs" / "mlflow.db").exists() and not (tmp_path / "job" / "samples.jsonl").exists()


@pytest.fixture(scope="module")
def local_pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny hybrid target saved as a checkpoint (config, weights, tokenizer) and a drafter saved for it."""
    from ddtree.engine.drafter import DFlashDrafter
    from ddtree.tiny import slow_decay_, tiny_model, tiny_tokenizer

    root = tmp_path_factory.mktemp("pair")
    target = slow_decay_(tiny_model("qwen3_5_text", seed=0, attn_implementation="sdpa"))
    target.save_pretrained(root / "my-hybrid")
    tiny_tokenizer(target.config.get_text_config().vocab_size).save_pretrained(root / "my-hybrid")
    DFlashDrafter.random_for_target(target.config, num_layers=1, block_size=4, seed=0).save_pretrained(
        root / "my-drafter")
    return root / "my-hybrid", root / "my-drafter"


@pytest.mark.slow  # two CLI processes, ~15 s (CI time: make test stays near 11 minutes)
def test_any_checkpoint_by_path_records_its_name_and_family(cli, tmp_path, local_pair):
    target, drafter = local_pair
    job = tmp_path / "job"
    proc = cli("model=hf", f"model.name_or_path={target}", "drafter=pretrained", f"drafter.name_or_path={drafter}",
               "method=ddtree", "budget=4", *TINY, "tracking=none", f"hydra.run.dir={job}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((job / "summary.json").read_text())
    assert (summary["model"], summary["match_rate"]) == ("my-hybrid", 1.0)
    assert summary["drafter"] == str(drafter) and summary["dataset"] == "tiny"
    resolved = (job / "config_resolved.yaml").read_text()
    assert "ddtree.hybrid: 'true'" in resolved and "ddtree.model_type: qwen3_5_text" in resolved  # its config.json
    # without a drafter, model=hf says how to give one
    _one_line(cli("model=hf", f"model.name_or_path={target}", *TINY, f"hydra.run.dir={tmp_path / 'j2'}"),
              "drafter=pretrained drafter.name_or_path=")


@pytest.mark.slow  # two CLI processes, ~20 s (CI time: make test stays near 11 minutes)
def test_long_prompt_is_truncated_only_when_asked(cli, tmp_path):
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"id": "long", "turns": ["count " * 400]}) + "\n")
    common = ("model=tiny_qwen3", "dataset=jsonl", f"dataset.path={long}", "max_new_tokens=8", "method=ar",
              "warmup=false", "tracking=none")
    _one_line(cli(*common, f"hydra.run.dir={tmp_path / 'a'}"), "dataset.path: prompt 'long' is 2425 tokens")  # context 2048
    job = tmp_path / "b"
    proc = cli(*common, "dataset.truncate=true", f"hydra.run.dir={job}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    (rec,) = [json.loads(ln) for ln in (job / "samples.jsonl").read_text().splitlines()]
    assert 0 < rec["num_new_tokens"] <= 8


@pytest.mark.slow  # four CLI processes at once, ~30 s
def test_fresh_store_first_use_by_processes_started_together(tmp_path):
    """Four processes open one fresh SQLite store at once: one creates it, all can use it (no alembic race)."""
    uri = f"sqlite:///{tmp_path}/store/m.db"
    code = ("import sys; from ddtree.pipeline.tracking import MlflowTracker; "
            f"t = MlflowTracker({uri!r}, 'ddtree'); print('ok', t.experiment_id())")
    env = {**os.environ, "MLFLOW_DISABLE_TELEMETRY": "true"}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-1500:] for _, e in outs]
    ids = {o.split()[1] for o, _ in outs}
    assert len(ids) == 1  # one experiment, whichever process made it
    from mlflow import MlflowClient

    assert MlflowClient(tracking_uri=uri).get_experiment_by_name("ddtree") is not None


def test_a_store_mlflow_cannot_open_is_one_line(cli, tmp_path):
    db = tmp_path / "broken.db"
    db.write_text("this is not a database\n")
    line = _one_line(cli("model=tiny_qwen3", *TINY, f"tracking.uri=sqlite:///{db}", f"hydra.run.dir={tmp_path / 'j'}"),
                     "tracking.uri: MLflow cannot open the store")
    assert f"move {db} aside" in line and not (tmp_path / "j" / "samples.jsonl").exists()


@pytest.mark.slow
def test_jobs_started_together_on_a_fresh_store_all_finish(tmp_path):
    """The first-day failure: jobs in separate shells, one fresh default store; each must record its run."""
    uri = f"sqlite:///{tmp_path}/runs/mlflow.db"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    procs = [subprocess.Popen([sys.executable, "-m", "ddtree.run", "model=tiny_qwen3", *TINY, f"seed={i}",
                               f"tracking.uri={uri}", f"hydra.run.dir={tmp_path / f'job{i}'}"], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e[-1500:] for _, e in outs]
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("ddtree").experiment_id])
    assert len(runs) == 3 and {r.info.status for r in runs} == {"FINISHED"}
    assert C.REPO_ROOT.is_dir()


@pytest.mark.slow  # two real jobs, one killed mid-run (about a minute alone, minutes on a busy box)
def test_a_killed_job_resumes_at_its_first_unfinished_prompt(tmp_path):
    """SIGKILL a real job after two finished prompts; the rerun reuses them, runs the rest, ends the dead run."""
    import signal
    import time

    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    args = ["model=tiny_qwen3", "dataset=tiny", "method=dflash", "max_new_tokens=96", "warmup=false",
            f"tracking.uri={uri}", f"runs_dir={tmp_path / 'runs'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MLFLOW_DISABLE_TELEMETRY": "true"}
    first, second = tmp_path / "first", tmp_path / "second"
    proc = subprocess.Popen([sys.executable, "-m", "ddtree.run", *args, f"hydra.run.dir={first}"], cwd=tmp_path,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples = first / "samples.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:  # prompt 0 (1 turn) and prompt 1 (2 turns), both roles
        if samples.is_file() and len(samples.read_text().splitlines()) >= 6:
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the job finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    kept = [json.loads(ln) for ln in samples.read_text().splitlines() if ln.endswith("}")]
    finished_ids = {r["id"] for r in kept if r["role"] == "method"} & {r["id"] for r in kept if r["role"] == "baseline"}
    client = MlflowClient(tracking_uri=uri)
    (dead,) = client.search_runs([client.get_experiment_by_name("ddtree").experiment_id])
    assert dead.info.status == "RUNNING"  # a killed process cannot say otherwise

    out = subprocess.run([sys.executable, "-m", "ddtree.run", *args, f"hydra.run.dir={second}"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    reused = int(out.stdout.split("resuming: ")[1].split()[0])
    assert 2 <= reused <= len(finished_ids) and f"of 6 prompts were finished by {first}" in out.stdout
    recs = [json.loads(ln) for ln in (second / "samples.jsonl").read_text().splitlines()]
    assert sum(1 for r in recs if r.get("resumed_from") == str(first)) >= 6  # prompts 0 and 1, both roles
    assert [r["id"] for r in recs if r.get("resumed_from")][:1] == ["tiny-0"]
    summary = json.loads((second / "summary.json").read_text())
    assert summary["num_prompts"] == 6 and summary["match_rate"] == 1.0
    runs = {r.info.run_id: r for r in client.search_runs([dead.info.experiment_id])}
    old, new = runs[dead.info.run_id], next(r for i, r in runs.items() if i != dead.info.run_id)
    assert old.info.status == "KILLED" and old.data.tags["ddtree.superseded_by"] == new.info.run_id
    assert new.info.status == "FINISHED" and new.data.tags["ddtree.resumed_from"] == old.info.run_id


@pytest.mark.slow  # a six-job CLI sweep, ~16 s (CI time: make test stays near 11 minutes)
def test_sweep_runs_dflash_once_and_its_table_shows_what_varies(cli, tmp_path):
    sweep = tmp_path / "sweep"
    proc = cli("model=tiny_qwen3", *TINY, "max_new_tokens=4", "tracking=none", "force=true", "method=dflash,ddtree",
               "budget=4,8", "attention.target=sdpa,eager", f"hydra.sweep.dir={sweep}", "-m")
    assert proc.returncode == 0, proc.stderr[-3000:]
    ran = sorted(p.parent.name for p in sweep.glob("*/summary.json"))
    skipped = {p.parent.name: json.loads(p.read_text()) for p in sweep.glob("*/skipped.json")}
    assert len(ran) == 6 and len(skipped) == 2  # dflash x 2 attentions once each; ddtree x 2 budgets x 2
    assert all(s["method"] == "dflash" and "ignores the budget" in s["note"] for s in skipped.values())
    table = proc.stdout.split(f"sweep {sweep}:\n")[1].splitlines()
    assert table[0].split()[:4] == ["model", "method", "budget", "attention.target"] and table[0].endswith("note")
    assert len(table) == 9 and sum("skipped: same job as" in row for row in table) == 2
    assert {row.split()[3] for row in table[1:]} == {"sdpa", "eager"}


def test_device_all_without_cuda_says_so_and_exits_0(tmp_path):
    """bench/device_all.sh on a machine without CUDA (this one): one line saying so, exit 0, the line under OUTDIR."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(["bash", str(root / "bench" / "device_all.sh"), str(tmp_path / "out")], capture_output=True,
                         text=True, env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "no CUDA device" in out.stdout
    assert "no CUDA device" in (tmp_path / "out" / "status.txt").read_text()
