"""The diagnosis's inputs: one job's method records and summary (a job dir, a sweep dir, an MLflow run)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddtree.engine.methods import METHODS
from ddtree.errors import ConfigError


@dataclass
class JobData:
    """One job's method records and summary, wherever they came from (a job dir, an MLflow run)."""

    name: str
    method: str
    budget: int | None  # None: a chain (DFlash) or AR
    summary: dict[str, Any]
    records: list[dict[str, Any]]  # role == "method"
    baseline: list[dict[str, Any]] = field(default_factory=list)  # role == "baseline"

    @property
    def tau(self) -> float | None:
        return self.summary.get("tau")

    @property
    def tree_budget(self) -> int | None:
        """The budget on the predicted curve: 1 for a chain, the node budget for a tree, None for AR."""
        m = METHODS.get(self.method)
        if m is None or m.drafter_kind is None or not m.drafter_kind.curve:  # the curve: a block drafter's chain and trees
            return None
        return 1 if m.tree == "chain" else self.budget

    @property
    def diagnosed(self) -> list[dict[str, Any]]:
        """The records of generations that ran at least one round (an output that stopped on its first token, or
        max_new_tokens=1, records none: nothing to diagnose, and no tau to predict)."""
        return [r["diagnosis"] for r in self.records if r.get("diagnosis") and r["diagnosis"].get("depth")]


def job_from_dir(d: Path) -> JobData | None:
    """A job dir's summary.json and samples.jsonl; None when it has neither (a skipped or unfinished job)."""
    samples, summary = d / "samples.jsonl", d / "summary.json"
    if not samples.is_file() or not summary.is_file():
        return None
    summ = json.loads(summary.read_text())
    recs = [json.loads(ln) for ln in samples.read_text().splitlines() if ln.strip()]
    return JobData(d.name, summ.get("method"), summ.get("budget"), summ,
                   [r for r in recs if r.get("role") == "method"], [r for r in recs if r.get("role") == "baseline"])


def load_jobs(path: Path) -> list[JobData]:
    """The job at `path`, or every job below it (a sweep dir, a runs dir)."""
    if not path.is_dir():
        raise ConfigError("path", f"{path} is not a directory", "pass a job dir (holding samples.jsonl and "
                          "summary.json) or a sweep dir")
    job = job_from_dir(path)
    if job is not None:
        return [job]
    jobs = [j for p in sorted(path.rglob("summary.json"), key=lambda p: str(p)) if (j := job_from_dir(p.parent))]
    if not jobs:
        raise ConfigError("path", f"no finished job (samples.jsonl + summary.json) under {path}",
                          "pass the directory `python -m ddtree.run` printed after 'results:'")
    return jobs
