"""Sweeps in separate processes: the launcher configs (conf/hydra/launcher), the sweep's MLflow parent run
handed to every job, and a real sweep through submitit's local executor (the SLURM code path, no cluster)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from ddtree.pipeline import tracking as T

# our conf/hydra/launcher files shadow the plugins' configs of the same name (ddtree.run silences this too)
pytestmark = pytest.mark.filterwarnings(r"ignore:\s*'hydra/launcher/\w+' is validated against ConfigStore schema")

LAUNCHERS = {  # conf/hydra/launcher/<name>.yaml -> (plugin module, schema class, launcher class)
    "submitit_slurm": ("hydra_plugins.hydra_submitit_launcher", "SlurmQueueConf", "SlurmLauncher"),
    "submitit_local": ("hydra_plugins.hydra_submitit_launcher", "LocalQueueConf", "LocalLauncher"),
    "ray": ("hydra_plugins.hydra_ray_launcher", "RayLauncherConf", "RayLauncher"),
}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


@pytest.mark.parametrize("name", list(LAUNCHERS))
def test_launcher_config_composes_and_matches_the_plugin(name, compose):
    module, schema, launcher = LAUNCHERS[name]
    cfg = compose(f"hydra/launcher={name}", "hydra.launcher.timeout_min=30" if "submitit" in name else
                   "hydra.launcher.ray.init.address=auto")
    node = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    assert node["_target_"].startswith(module + ".") and node["_target_"].endswith("." + launcher)
    if not _installed(module):
        assert name == "ray", f"{module} is a test dependency (pip install -e '.[test]')"
        pytest.skip(f"{module} is not installed: checked the composition only")
    conf = importlib.import_module(module + ("._config" if name == "ray" else ".config"))
    fields = {f.name for f in dataclasses.fields(getattr(conf, schema))}
    assert set(node) <= fields, f"not fields of {schema}: {set(node) - fields}"
    if "submitit" in name:
        assert set(node) == fields  # this file shadows the plugin's: every field is spelled out
        assert node["submitit_folder"] == "${hydra.sweep.dir}/.submitit/%j" and node["timeout_min"] == 30


def test_missing_launcher_plugin_is_one_line(cli, tmp_path, small):
    if _installed("hydra_plugins.hydra_ray_launcher"):
        pytest.skip("hydra-ray-launcher is installed here")
    proc = cli(*small, "hydra/launcher=ray", f"runs_dir={tmp_path / 'runs'}", f"hydra.sweep.dir={tmp_path / 's'}",
               "-m", timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "pip install hydra-ray-launcher" in lines[0], proc.stderr
    assert not (tmp_path / "runs" / "mlflow.db").exists()  # no parent run was left behind


def _runs(uri: str):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("ddtree")
    return [] if exp is None else client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])


def _sweep_cfg(*overrides: str, sweep: str, compose):
    """The launching process's config of `-m ... <sweep>` (compose takes no sweep, so it is added as Hydra does)."""
    from omegaconf import read_write

    cfg = compose(*overrides)
    with read_write(cfg.hydra.overrides):
        cfg.hydra.overrides.task.append(sweep)
    return cfg


def test_sweep_parent_is_made_at_start_and_handed_to_jobs(tmp_path, monkeypatch, compose, small):
    """on_multirun_start creates the parent in the launching process and adds it to hydra.job.env_set
    (what every launcher recomposes a job from); a parent whose jobs were all skipped is removed."""
    from mlflow import MlflowClient

    monkeypatch.delenv(T.PARENT_ENV, raising=False)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    sweep = tmp_path / "sweep"
    cfg = _sweep_cfg(*small, f"tracking.uri={uri}", f"hydra.sweep.dir={sweep}", sweep="budget=4,8", compose=compose)
    T.SweepCallback().on_multirun_start(cfg)
    record = json.loads((sweep / T.PARENT_FILE).read_text())
    assert f"++hydra.job.env_set.{T.PARENT_ENV}={record['run_id']}" in list(cfg.hydra.overrides.hydra)
    (parent,) = _runs(uri)
    assert parent.info.run_id == record["run_id"] and parent.data.tags[T.TAG_ROLE] == "sweep"

    # a job (any process, any machine) gets the id from its environment, without reading the sweep dir
    monkeypatch.setenv(T.PARENT_ENV, record["run_id"])
    tracker = T.MlflowTracker(uri, "ddtree")
    assert tracker.sweep_parent(tmp_path / "elsewhere", "x") == record["run_id"]
    monkeypatch.delenv(T.PARENT_ENV)
    assert T.finish_sweep(sweep) is None  # no child: every job was skipped, so the parent goes
    assert not (sweep / T.PARENT_FILE).exists() and _runs(uri) == []

    # with a child, the parent is closed FINISHED; a sweep over the store itself leaves it to the jobs
    sweep2 = tmp_path / "sweep2"
    cfg = _sweep_cfg(*small, f"tracking.uri={uri}", f"hydra.sweep.dir={sweep2}", sweep="budget=4,8", compose=compose)
    T.SweepCallback().on_multirun_start(cfg)
    pid = json.loads((sweep2 / T.PARENT_FILE).read_text())["run_id"]
    tracker.start(run_name="child", params={}, tags={}, config_hash="h", sweep_dir=sweep2).end()
    assert T.finish_sweep(sweep2) == pid and MlflowClient(uri).get_run(pid).info.status == "FINISHED"
    cfg = _sweep_cfg(*small, f"tracking.uri={uri}", f"hydra.sweep.dir={tmp_path / 's3'}", sweep="tracking.experiment=a,b", compose=compose)
    T.SweepCallback().on_multirun_start(cfg)
    assert not (tmp_path / "s3" / T.PARENT_FILE).exists()


# ---------------------------------------------------------------- submitit's local executor, end to end


def _submitit_logs(sweep: Path) -> dict[str, str]:
    return {p.parent.name + "/" + p.name: p.read_text() for p in sorted((sweep / ".submitit").glob("*/*_log.out"))}


def _multirun(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_FULL_ERROR": "1", "DDTREE_TRACEBACK": "1"}
    env.pop(T.PARENT_ENV, None)
    return subprocess.run([sys.executable, "-m", "ddtree.run", *args, "-m"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_submitit_local_sweep_parent_children_and_resume(tmp_path, small):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    common = (*small, "method=ddtree", f"runs_dir={tmp_path / 'runs'}", f"tracking.uri={uri}",
              "hydra/launcher=submitit_local")
    sweep = tmp_path / "sweep"
    proc = _multirun(tmp_path, *common, "budget=4,8", f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-5000:]
    logs = _submitit_logs(sweep)
    job_ids = {k.split("/")[0] for k in logs}
    assert len(job_ids) == 2 and str(os.getpid()) not in job_ids  # two processes of their own
    assert sum(log.count("speedup") for log in logs.values()) == 2

    parent_id = json.loads((sweep / T.PARENT_FILE).read_text())["run_id"]
    runs = _runs(uri)
    parent = next(r for r in runs if r.info.run_id == parent_id)
    assert parent.data.tags[T.TAG_ROLE] == "sweep" and parent.info.status == "FINISHED"
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_id]
    assert sorted(r.data.params["budget"] for r in children) == ["4", "8"] and len(runs) == 3
    assert all(r.info.status == "FINISHED" and r.data.tags[T.TAG_ROLE] == "job" for r in children)
    assert {r.data.tags["job_dir"] for r in children} == {str(sweep / "0"), str(sweep / "1")}
    assert all((sweep / n / "samples.jsonl").is_file() and (sweep / n / "summary.json").is_file() for n in "01")

    # the sweep again, in a new dir: both jobs find their config finished and skip; no parent is left
    sweep2 = tmp_path / "sweep2"
    proc = _multirun(tmp_path, *common, "budget=4,8", f"hydra.sweep.dir={sweep2}")
    assert proc.returncode == 0, proc.stderr[-5000:]
    logs = _submitit_logs(sweep2)
    assert len(logs) == 2 and all("skipped" in log and "force=true" in log for log in logs.values())
    assert len(_runs(uri)) == 3 and not (sweep2 / T.PARENT_FILE).exists()


@pytest.mark.slow
def test_submitit_tasks_are_data_parallel_ranks(tmp_path, small):
    """hydra.launcher.tasks_per_node=2: the job runs as 2 gloo ranks (SLURM's multi-task jobs, locally)."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    sweep = tmp_path / "sweep"
    proc = _multirun(tmp_path, *small, "dataset.max_samples=3", "method=dflash", f"runs_dir={tmp_path / 'runs'}",
                     f"tracking.uri={uri}", "hydra/launcher=submitit_local", "hydra.launcher.tasks_per_node=2",
                     f"hydra.sweep.dir={sweep}")
    assert proc.returncode == 0, proc.stderr[-5000:]
    job = sweep / "0"
    ranks = [{json.loads(line)["id"] for line in (job / f"samples.rank{k}.jsonl").read_text().splitlines()}
             for k in (0, 1)]
    assert ranks == [{"tiny-0", "tiny-2"}, {"tiny-1"}]
    summary = json.loads((job / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["num_prompts"] == 3 and summary["match_rate"] == 1.0
    runs = _runs(uri)
    assert len(runs) == 2  # the parent and the one job run (rank 0's); rank 1 recorded nothing
    child = next(r for r in runs if r.data.tags.get(T.TAG_ROLE) == "job")
    assert child.data.tags["world_size"] == "2" and child.info.status == "FINISHED"


@pytest.mark.slow
def test_ray_local_sweep_parent_children_and_resume(tmp_path, small):
    """hydra/launcher=ray on a Ray started for the sweep (no GPU asked): the parent reaches the jobs through
    hydra.job.env_set; a rerun skips both jobs. Runs only where hydra-ray-launcher is installed."""
    pytest.importorskip("hydra_plugins.hydra_ray_launcher")
    uri = f"sqlite:///{tmp_path}/store/mlflow.db"
    common = (*small, f"runs_dir={tmp_path / 'runs'}", f"tracking.uri={uri}", "hydra/launcher=ray",
              "hydra.launcher.ray.remote.num_gpus=0", "hydra.launcher.ray.remote.num_cpus=1",
              "+hydra.launcher.ray.init.num_cpus=2", "+hydra.launcher.ray.init.include_dashboard=false", "budget=4,8")
    proc = _multirun(tmp_path, *common, f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert proc.returncode == 0, proc.stderr[-5000:]
    runs = _runs(uri)
    parent = next(r for r in runs if r.data.tags.get(T.TAG_ROLE) == "sweep")
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FINISHED" and sorted(r.data.params["budget"] for r in children) == ["4", "8"]
    proc = _multirun(tmp_path, *common, f"hydra.sweep.dir={tmp_path / 'sweep2'}")
    assert proc.returncode == 0 and (proc.stdout + proc.stderr).count("skipped") == 2, proc.stderr[-5000:]
    assert len(_runs(uri)) == 3
