"""MLflow logging for a training run (or nothing, with tracking.backend=none).

One MLflow run per output directory: its id is kept in `<out_dir>/mlflow_run.json`, so a
resumed training continues the same run. mlflow loads on first use.
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path
from typing import Any

from ddtree.train.config import REPO_ROOT, TrackingConfig

RUN_FILE = "mlflow_run.json"


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _metric_key(key: str) -> str:
    """MLflow allows alphanumerics and _ - . space : / in names ("ddtree@32" -> "ddtree_32")."""
    return re.sub(r"[^\w\-. :/]", "_", key)


class NullTracker:
    run_id: str | None = None

    def log_params(self, params: dict) -> None: ...

    def log_metrics(self, metrics: dict, step: int | None = None) -> None: ...

    def log_artifact(self, path: str | Path, subdir: str | None = None) -> None: ...

    def end(self, status: str = "FINISHED") -> None: ...


class MlflowTracker(NullTracker):
    def __init__(self, cfg: TrackingConfig, out_dir: Path):
        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        import mlflow

        self.mlflow = mlflow
        uri = cfg.uri or f"sqlite:///{REPO_ROOT / 'runs' / 'mlflow.db'}"
        location = None
        if uri.startswith("sqlite:///"):
            db = Path(uri.removeprefix("sqlite:///")).resolve()
            db.parent.mkdir(parents=True, exist_ok=True)
            location = (db.parent / "mlartifacts").as_uri()  # beside the database, not in ./mlruns of the cwd
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        exp = self.client.get_experiment_by_name(cfg.experiment)
        eid = exp.experiment_id if exp else self.client.create_experiment(cfg.experiment, artifact_location=location)
        run_file = out_dir / RUN_FILE
        run_id = json.loads(run_file.read_text())["run_id"] if run_file.exists() else None
        if run_id is not None:
            try:
                self.client.update_run(run_id, status="RUNNING")
            except Exception:  # the store was wiped: start afresh
                run_id = None
        if run_id is None:
            name = cfg.run_name or out_dir.name
            run_id = self.client.create_run(eid, run_name=name, tags={"ddtree.role": "train",
                                                                      "ddtree.out_dir": str(out_dir)}).info.run_id
            out_dir.mkdir(parents=True, exist_ok=True)
            run_file.write_text(json.dumps({"run_id": run_id, "tracking_uri": uri}) + "\n")
        self.run_id = run_id
        self.uri = uri

    def log_params(self, params: dict) -> None:
        from mlflow.entities import Param

        existing = self.client.get_run(self.run_id).data.params
        new = [Param(k, json.dumps(v) if not isinstance(v, str) else v)
               for k, v in _flatten(params).items() if k not in existing]
        for i in range(0, len(new), 100):
            self.client.log_batch(self.run_id, params=new[i:i + 100])

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        ms = [Metric(_metric_key(k), float(v), ts, step or 0) for k, v in _flatten(metrics).items()
              if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        if ms:
            self.client.log_batch(self.run_id, metrics=ms)

    def log_artifact(self, path: str | Path, subdir: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), subdir)

    def end(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)


def make_tracker(cfg: TrackingConfig, out_dir: Path) -> NullTracker:
    return NullTracker() if cfg.backend == "none" else MlflowTracker(cfg, out_dir)
