"""MLflow tracking: one parent run per multirun sweep, one child run per job, a plain run otherwise.

No engine imports; mlflow and matplotlib load on first use, so a config error never pays for them.

The sweep's parent run is created in the launching process when the sweep starts (SweepCallback),
recorded in the sweep directory (`mlflow_parent.json`) and handed to every job through
`hydra.job.env_set` as DDTREE_MLFLOW_PARENT_RUN_ID, so jobs in other processes or on other machines
(submitit, Ray) agree on it without a shared file system. A job that finds no id creates the parent
itself, under a lock on the sweep dir file. An outer tool may set DDTREE_MLFLOW_PARENT_RUN_ID itself:
ddtree then neither creates nor closes a parent. A sweep whose jobs were all skipped (already
finished) leaves no parent behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import subprocess
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PARENT_FILE = "mlflow_parent.json"
PARENT_ENV = "DDTREE_MLFLOW_PARENT_RUN_ID"
TAG_HASH = "ddtree.config_hash"
TAG_ROLE = "ddtree.role"  # sweep | job | run
TAG_SWEEP_DIR = "ddtree.sweep_dir"
TAG_SUPERSEDED_BY = "ddtree.superseded_by"  # on a dead job's run: the run that continued it
TAG_RESUMED_FROM = "ddtree.resumed_from"  # on that run: the dead one whose finished prompts it reused
_MAX_PARAM = 6000  # MLflow's limit on a param value


def config_hash(identity: dict[str, Any]) -> str:
    """A stable hash of what decides a job's results (see ddtree.pipeline.schema.identity_dict)."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:20]


def numeric_metrics(summary: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Every finite number in a (nested) summary, keys joined with '.'; bools and strings left out."""
    out: dict[str, float] = {}
    for k, v in summary.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(numeric_metrics(v, key + "."))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            out[key] = float(v)
    return out


def param_value(v: Any) -> str:
    s = v if isinstance(v, str) else json.dumps(v, default=str)
    return s[:_MAX_PARAM]


def git_commit(repo: Path) -> str | None:
    """HEAD of the checkout (with '-dirty' when it has local changes), or None outside git."""
    try:
        head = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("-dirty" if dirty else "") if head else None


def write_histogram(lengths: Iterable[int], path: Path, title: str) -> Path:
    """A PNG histogram of tokens committed per round (bonus included)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    values = list(lengths)
    fig, ax = plt.subplots(figsize=(5, 3.2), dpi=100)
    if values:
        hi = max(values)
        ax.hist(values, bins=[b - 0.5 for b in range(1, hi + 2)], rwidth=0.85, color="#3a7bd5")
        ax.set_xticks(range(1, hi + 1))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("tokens committed per round (bonus included)")
    ax.set_ylabel("rounds")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` across processes (sweep jobs may run in parallel)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: jobs of one process only
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sqlite_path(uri: str) -> Path | None:
    return Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None


@dataclass
class JobRun:
    """One MLflow run of one job; `parent_id` set when it is a sweep child."""

    client: Any
    run_id: str
    parent_id: str | None = None

    def log_artifacts(self, paths: Iterable[Path], subdir: str | None = None) -> None:
        for p in paths:
            p = Path(p)
            if p.is_file():
                self.client.log_artifact(self.run_id, str(p), subdir)

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k[:250], param_value(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[i:i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = [Metric(k, v, ts, step) for k, v in metrics.items()]
        for i in range(0, len(items), 500):
            self.client.log_batch(self.run_id, metrics=items[i:i + 500])

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, param_value(v)) for k, v in tags.items() if v is not None]
        if items:
            self.client.log_batch(self.run_id, tags=items)

    def end(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status)
        if status != "FINISHED" and self.parent_id:
            # the basic launcher aborts a sweep at its first failed job: say so on the parent too
            with contextlib.suppress(Exception):
                self.client.set_terminated(self.parent_id, "FAILED")


class NullRun:
    """A JobRun that records nothing (tracking=none, or a process that does not record)."""

    run_id: str | None = None

    def log_artifacts(self, paths: Iterable[Path], subdir: str | None = None) -> None: ...

    def log_params(self, params: dict[str, Any]) -> None: ...

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None: ...

    def set_tags(self, tags: dict[str, Any]) -> None: ...

    def end(self, status: str = "FINISHED") -> None: ...


def metric_key(key: str) -> str:
    """MLflow allows alphanumerics and _ - . space : / in names ("eval.ddtree@8.tau" -> "eval.ddtree_8.tau")."""
    return re.sub(r"[^\w\-. :/]", "_", key)


class NoTracker:
    """tracking=none: nothing is recorded and nothing is skipped."""

    uri = None

    def finished_run(self, config_hash: str) -> str | None:
        return None

    def unfinished_run(self, config_hash: str) -> dict[str, Any] | None:
        return None

    def supersede(self, old_run_id: str, new_run_id: str | None) -> None:
        return None

    def start(self, **_: Any) -> None:
        return None


def open_store(uri: str) -> Any:
    """An MlflowClient on `uri`, the store created or upgraded first, once: a SQLite store is set up under a
    file lock beside it, so jobs starting together on a fresh store do not race through MLflow's migrations
    (which leave it half-migrated). A store MLflow cannot open is a ConfigError naming tracking.uri."""
    from ddtree.errors import ConfigError

    db = _sqlite_path(uri)
    lock = contextlib.nullcontext()
    if db is not None:
        try:
            db.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError("tracking.uri", f"cannot create the store's folder {db.parent} ({e.strerror})",
                              "point tracking.uri (or runs_dir) at a writable place") from None
        lock = _locked(db.with_name(db.name + ".lock"))
    with lock:
        try:
            from mlflow import MlflowClient

            client = MlflowClient(tracking_uri=uri)
            client.search_experiments(max_results=1)  # the store answers: tables exist and are current
        except Exception as e:
            first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
            where = f"the file {db}" if db is not None else uri
            fix = (f"move {db} aside (MLflow then starts a fresh store there), or set tracking.uri=sqlite:///"
                   "<another path>.db" if db is not None else "check the server, or use tracking.uri=sqlite:///"
                   "<path>/mlflow.db")
            raise ConfigError("tracking.uri", f"MLflow cannot open the store {uri} ({where}): {first[:200]}",
                              fix) from None
    return client


class MlflowTracker:
    def __init__(self, uri: str, experiment: str):
        self.uri, self.experiment = uri, experiment
        self.client = open_store(uri)
        self._experiment_id: str | None = None

    # ---- experiment and lookups

    def experiment_id(self, create: bool = True) -> str | None:
        if self._experiment_id is None:
            exp = self.client.get_experiment_by_name(self.experiment)
            if exp is None and create:
                db = _sqlite_path(self.uri)
                # keep artifacts next to the database, not in ./mlruns of whatever the cwd is
                location = (db.resolve().parent / "mlartifacts").as_uri() if db is not None else None
                try:
                    self._experiment_id = self.client.create_experiment(self.experiment, artifact_location=location)
                except Exception:  # created meanwhile by a parallel job
                    exp = self.client.get_experiment_by_name(self.experiment)
            if exp is not None:
                self._experiment_id = exp.experiment_id
        return self._experiment_id

    def finished_run(self, config_hash: str) -> str | None:
        """The id of a FINISHED run with this config hash, if the store has one."""
        eid = self.experiment_id(create=False)
        if eid is None:
            return None
        runs = self.client.search_runs([eid], filter_string=f"tags.`{TAG_HASH}` = '{config_hash}' and "
                                       "attributes.status = 'FINISHED'", max_results=1)
        return runs[0].info.run_id if runs else None

    def unfinished_run(self, config_hash: str) -> dict[str, Any] | None:
        """The latest run of this config that did not finish (died, failed or was stopped): its id, status and
        tags, so a rerun can continue it; None when there is none."""
        eid = self.experiment_id(create=False)
        if eid is None:
            return None
        runs = self.client.search_runs([eid], filter_string=f"tags.`{TAG_HASH}` = '{config_hash}' and "
                                       "attributes.status != 'FINISHED'", order_by=["attributes.start_time DESC"],
                                       max_results=1)
        if not runs:
            return None
        r = runs[0]
        return {"run_id": r.info.run_id, "status": r.info.status, "tags": dict(r.data.tags)}

    def supersede(self, old_run_id: str, new_run_id: str | None) -> None:
        """End a dead job's run KILLED (if it still says RUNNING), tagged with the run that continues it."""
        from mlflow.entities import RunTag

        tags = [RunTag(TAG_SUPERSEDED_BY, new_run_id)] if new_run_id else []
        if tags:
            self.client.log_batch(old_run_id, tags=tags)
        if self.client.get_run(old_run_id).info.status == "RUNNING":
            self.client.set_terminated(old_run_id, "KILLED")

    def sweep_parent(self, sweep_dir: Path, run_name: str, tags: dict[str, str] | None = None) -> str:
        """Find or create the parent run of the sweep in `sweep_dir` (see the module docstring)."""
        if os.environ.get(PARENT_ENV):
            return os.environ[PARENT_ENV]
        sweep_dir = sweep_dir.resolve()
        sweep_dir.mkdir(parents=True, exist_ok=True)
        record = sweep_dir / PARENT_FILE
        with _locked(sweep_dir / (PARENT_FILE + ".lock")):
            if record.is_file():
                d = json.loads(record.read_text())
                if d.get("tracking_uri") == self.uri:
                    return d["run_id"]
            eid = self.experiment_id()
            run = self.client.create_run(eid, run_name=run_name, tags={
                TAG_ROLE: "sweep", TAG_SWEEP_DIR: str(sweep_dir), **(tags or {})})
            record.write_text(json.dumps({"run_id": run.info.run_id, "tracking_uri": self.uri,
                                          "experiment_id": eid}) + "\n")
            return run.info.run_id

    # ---- a job's run

    def start(self, *, run_name: str, params: dict[str, Any], tags: dict[str, Any], config_hash: str,
              sweep_dir: Path | None = None, sweep_name: str | None = None,
              sweep_tags: dict[str, str] | None = None) -> JobRun:
        eid = self.experiment_id()
        parent = self.sweep_parent(sweep_dir, sweep_name or sweep_dir.name, sweep_tags) if sweep_dir else None
        base = {TAG_HASH: config_hash, TAG_ROLE: "job" if parent else "run"}
        if parent:
            base["mlflow.parentRunId"] = parent
        run = self.client.create_run(eid, run_name=run_name, tags=base)
        job = JobRun(self.client, run.info.run_id, parent)
        job.log_params(params)
        job.set_tags(tags)
        return job

    def reopen(self, run_id: str) -> JobRun | None:
        """The run `run_id` set RUNNING again (a resumed job continues its run); None if the store lost it."""
        try:
            self.client.update_run(run_id, status="RUNNING")
        except Exception:  # the store was wiped or is another one: the caller starts afresh
            return None
        return JobRun(self.client, run_id)


def make_tracker(backend: str, uri: str | None, experiment: str) -> MlflowTracker | NoTracker:
    return MlflowTracker(uri, experiment) if backend == "mlflow" else NoTracker()


def _own_parent(sweep_dir: Path) -> dict[str, Any] | None:
    """The sweep dir's parent record, unless there is none or an outer tool's parent (another id) is in use."""
    record = Path(sweep_dir) / PARENT_FILE
    if not record.is_file():
        return None
    d = json.loads(record.read_text())
    outer = os.environ.get(PARENT_ENV)
    return None if outer and outer != d["run_id"] else d


def finish_sweep(sweep_dir: Path, extra_artifacts: Iterable[Path] = ()) -> str | None:
    """End the sweep's parent run FINISHED (unless a job already marked it FAILED); its id, if any.

    A parent without children (every job was skipped) is deleted, with its record.
    """
    d = _own_parent(sweep_dir)
    if d is None:
        return None  # no job ever tracked, or an outer tool owns the parent
    from mlflow import MlflowClient
    from mlflow.entities import ViewType

    client = MlflowClient(tracking_uri=d["tracking_uri"])
    run = client.get_run(d["run_id"])
    children = client.search_runs([run.info.experiment_id], f"tags.`mlflow.parentRunId` = '{d['run_id']}'",
                                  run_view_type=ViewType.ALL, max_results=1)
    if not children and run.info.status == "RUNNING":
        client.delete_run(d["run_id"])
        (Path(sweep_dir) / PARENT_FILE).unlink(missing_ok=True)
        return None
    for p in extra_artifacts:
        if Path(p).is_file():
            client.log_artifact(d["run_id"], str(p))
    if run.info.status == "RUNNING":
        client.set_terminated(d["run_id"], "FINISHED")
    return d["run_id"]


def fail_sweep(sweep_dir: Path) -> None:
    """Mark the sweep's parent run FAILED (a job stopped the sweep before on_multirun_end could run)."""
    d = _own_parent(sweep_dir)
    if d is None:
        return
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=d["tracking_uri"])
    if client.get_run(d["run_id"]).info.status == "RUNNING":
        client.set_terminated(d["run_id"], "FAILED")


try:  # the Hydra callback that closes a sweep's parent run once every job has returned
    from hydra.experimental.callback import Callback
except ImportError:  # pragma: no cover - hydra is a dependency; keep the module importable alone
    Callback = object  # type: ignore[misc,assignment]


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return not module or importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package is missing
        return False


def _sweep_store(config: Any) -> tuple[str, str] | None:
    """(tracking uri, experiment) every job of this sweep records to; None when there is no single one."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from ddtree.pipeline.schema import to_run_config, tracking_uri

    try:
        rc = to_run_config(config)
        task = [str(o) for o in config.hydra.overrides.task]
        swept = {o.key_or_group.split(".")[0] for o in OverridesParser.create().parse_overrides(task)
                 if o.is_sweep_override()}
    except Exception:  # a bad config: its jobs report it, one line each
        return None
    if rc.tracking.backend != "mlflow" or swept & {"tracking", "runs_dir"}:
        return None  # nothing to record, or jobs in different stores: each job finds its own parent
    return tracking_uri(rc), rc.tracking.experiment


class SweepCallback(Callback):
    """Registered in conf/config.yaml (hydra.callbacks). Runs in the launching process."""

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        """Create the parent run now and hand its id to every job, whichever process or machine runs it."""
        from omegaconf import read_write

        from ddtree.pipeline.distributed import world_from_env

        if os.environ.get(PARENT_ENV) or not world_from_env().is_main:
            return  # an outer tool's parent; or a torchrun rank > 0, which never records
        if not _importable(str(config.hydra.launcher.get("_target_", "")).rpartition(".")[0]):
            return  # Hydra is about to fail on the missing launcher plugin: leave no empty parent behind
        store = _sweep_store(config)
        if store is None:
            return
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        run_id = MlflowTracker(*store).sweep_parent(sweep_dir, f"sweep {sweep_dir.parent.name}/{sweep_dir.name}")
        # every launcher rebuilds a job's config from hydra.overrides.hydra (+ the job's own overrides)
        with read_write(config.hydra.overrides):
            config.hydra.overrides.hydra.append(f"++hydra.job.env_set.{PARENT_ENV}={run_id}")

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
        finish_sweep(sweep_dir, [sweep_dir / "multirun.yaml"])
