"""Result tables printed at the end of a job and of a sweep (no engine or MLflow imports)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback


def verdict_cell(v: dict[str, Any] | None) -> str:
    """'16 ok (12 exact, 4 tie)', '2 SUSPECT', or '-' when the job was not validated."""
    if not v:
        return "-"
    if v.get("suspect"):
        return f"{v['suspect']} SUSPECT"
    parts = [f"{v[k]} {k}" for k in ("exact", "tie") if v.get(k)]
    good = v.get("exact", 0) + v.get("tie", 0) + v.get("ok", 0)
    return f"{good} ok" + (f" ({', '.join(parts)})" if parts else "")


def format_table(summaries: dict[str, Any] | list[dict[str, Any]]) -> str:
    """One row per job summary: tau, tokens/s against the AR baseline, speedup, exact matches, verdicts."""
    def f(v, spec=".2f", suffix=""):
        return "-" if v is None else f"{v:{spec}}{suffix}"

    head = ("model", "method", "budget", "block", "prompts", "tau", "tok/s", "AR tok/s", "speedup", "match",
            "verdicts")
    rows = [head]
    for s in [summaries] if isinstance(summaries, dict) else summaries:
        n = s["num_prompts"]
        match = "-" if s["match_rate"] is None else f"{round(s['match_rate'] * n)}/{n}"
        rows.append((s["model"], s["method"], f(s["budget"], "d"), f(s["block_size"], "d"), str(n), f(s["tau"]),
                     f(s["tokens_per_s"], ".1f"), f(s["baseline_tokens_per_s"], ".1f"), f(s["speedup"], ".2f", "x"),
                     match, verdict_cell(s.get("validation"))))
    w = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(n) for c, n in zip(line, w, strict=True)).rstrip() for line in rows)


class SweepTableCallback(Callback):
    """At the end of a multirun, one table over every job of the sweep that wrote a summary."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        found = sorted(sweep_dir.glob("*/summary.json"), key=lambda p: int(p.parent.name)
                       if p.parent.name.isdigit() else 0)
        summaries = [json.loads(p.read_text()) for p in found]
        if len(summaries) > 1:
            print(f"\nsweep {sweep_dir}:\n{format_table(summaries)}")
