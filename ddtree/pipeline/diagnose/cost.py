"""Verification cost: ms per round by budget from the jobs' own stage timings or a cost table (CSV or JSON)."""

from __future__ import annotations

import csv
import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from ddtree.errors import ConfigError
from ddtree.pipeline.diagnose.records import JobData


def round_ms(job: JobData) -> float | None:
    """A round's wall milliseconds (draft + tree + verify + commit), from the job's stage timings."""
    per = job.summary.get("stage_ms_per_round") or {}
    vals = [v for v in per.values() if v is not None]
    return sum(vals) if vals else None


def ar_ms_per_token(jobs: list[JobData]) -> float | None:
    """The AR baseline's decode milliseconds per token over every job's baseline records."""
    s = sum(r["decode_s"] for j in jobs for r in j.baseline)
    n = sum(len(r["acceptance_lengths"]) for j in jobs for r in j.baseline)
    return 1000 * s / n if n else None


def read_cost_table(path: Path) -> dict[str, Any]:
    """A user's verification-cost table: JSON {"ar": ms, "1": ms, "64": ms, ...} or {"round_ms": {...}, "ar_ms": x},
    or CSV rows `budget,ms` (budget "ar" for the baseline's ms per token; 1 = a chain). Milliseconds per round."""
    if not path.is_file():
        raise ConfigError("--cost", f"{path} does not exist", "pass a JSON or CSV table of budget -> ms per round")
    try:
        if path.suffix.lower() == ".csv":
            rows = [r for r in csv.reader(path.read_text().splitlines()) if r and not r[0].startswith("#")]
            raw = {r[0].strip(): float(r[1]) for r in rows if r[0].strip().lower() != "budget"}
        else:
            data = json.loads(path.read_text())
            raw = dict(data.get("round_ms", data))
            if "ar_ms" in data:
                raw["ar"] = data["ar_ms"]
        ar = raw.pop("ar", None)
        return {"ar_ms": None if ar is None else float(ar), "round_ms": {int(k): float(v) for k, v in raw.items()}}
    except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
        raise ConfigError("--cost", f"cannot read {path}: {e}", "write budget,ms rows (CSV) or {\"64\": 12.5, "
                          "\"ar\": 9.8} (JSON)") from None


def cost_curve(jobs: list[JobData], table: dict[str, Any] | None) -> dict[str, Any]:
    """Round ms by budget (1 = the chain) and AR ms per token: the table's where given, else the jobs' own."""
    if table is not None:
        return {"source": "table", "round_ms": dict(sorted(table["round_ms"].items())), "ar_ms": table["ar_ms"]}
    by_budget: dict[int, list[float]] = defaultdict(list)
    for j in jobs:
        b, ms = j.tree_budget, round_ms(j)
        if b is not None and ms is not None:
            by_budget[b].append(ms)
    return {"source": "measured", "round_ms": {b: sum(v) / len(v) for b, v in sorted(by_budget.items())},
            "ar_ms": ar_ms_per_token(jobs)}


def interpolate_cost(curve: dict[int, float], b: int) -> float | None:
    """Round ms at budget b: measured, or linear in log2(budget) between two measured budgets (never outside)."""
    if b in curve:
        return curve[b]
    lo = max((k for k in curve if k < b), default=None)
    hi = min((k for k in curve if k > b), default=None)
    if lo is None or hi is None:
        return None
    t = (math.log2(b) - math.log2(lo)) / (math.log2(hi) - math.log2(lo))
    return curve[lo] + t * (curve[hi] - curve[lo])
