"""Result tables printed at the end of a job and of a sweep (no engine or MLflow imports)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

SKIPPED = "skipped.json"  # in a job dir: this job repeated an earlier job of its sweep and did not run
CLAIMS = ".configs"  # in a sweep dir: one file per config hash, naming the job that runs it
SHOWN = {"model", "method", "budget"}  # settings the table always has a column for


def verdict_cell(v: dict[str, Any] | None) -> str:
    """'16 ok (12 exact, 4 tie)', '2 SUSPECT', or '-' when the job was not validated."""
    if not v:
        return "-"
    if v.get("suspect"):
        return f"{v['suspect']} SUSPECT"
    parts = [f"{v[k]} {k}" for k in ("exact", "tie") if v.get(k)]
    good = v.get("exact", 0) + v.get("tie", 0) + v.get("ok", 0)
    return f"{good} ok" + (f" ({', '.join(parts)})" if parts else "")


def method_cell(s: dict[str, Any]) -> str:
    """The method, with the draft shape its own settings give (Method.settings: mtp.*, eagle3.*): 'mtp 3' (a chain of
    3), 'eagle3 3x4' (a tree: 3 steps, top-4)."""
    from ddtree.engine.methods import METHODS

    group = getattr(METHODS.get(s["method"]), "settings", None)
    m = s.get(group) if group else None
    if not m:
        return s["method"]
    return f"{s['method']} {m['steps']}" + (f"x{m['topk']}" if m.get("topk", 1) > 1 else "")


def round_cell(s: dict[str, Any]) -> str:
    """The round that ran: 'compiled', 'eager' (or both), starred where it fell back from the compiled one."""
    r = s.get("round")
    return "-" if not r else r["ran"] + ("*" if r.get("fallback") else "")


def row_note(s: dict[str, Any]) -> str:
    """Why a job did not run, or why its round fell back (never silent)."""
    r = s.get("round") or {}
    return s.get("note") or (f"*{r['why']}" if r.get("fallback") else "")


RECORDED = ("scoring",)  # settings a summary records as the job ran them (auto resolved; absent where ignored)


def setting_cell(s: dict[str, Any], key: str) -> str:
    """A row's value of a varying setting: as the job ran it where its summary records it (scoring=auto as pair or
    marginal; "-" for a method that ignores it), else the job's override."""
    if key in RECORDED:
        return str(s.get(key, "-"))
    return str(s.get("settings", {}).get(key, "-"))


def _f(v, spec=".2f", suffix=""):
    if isinstance(v, str):  # a setting given in words (budget=auto with concurrency > 1: chosen every round)
        return v
    return "-" if v is None else f"{v:{spec}}{suffix}"


def load_cells(s: dict[str, Any]) -> tuple[str, str, str]:
    """Total tok/s of the method and of the AR baseline (every stream's tokens over the wall seconds) and the
    method's per-stream latency, 'median/p90' in seconds."""
    lat = s.get("latency_s") or {}
    base = s.get("baseline") or {}
    ar = base.get("throughput_tok_s") if base else (s.get("throughput_tok_s") if s.get("method") == "ar" else None)
    cell = "-" if lat.get("median") is None else f"{lat['median']:.2f}/{lat['p90']:.2f}"
    return _f(s.get("throughput_tok_s"), ".1f"), _f(ar, ".1f"), cell


def format_table(summaries: dict[str, Any] | list[dict[str, Any]], settings: list[str] | None = None) -> str:
    """One row per job summary: tau, tokens/s against the AR baseline, speedup, exact matches; under load (summaries
    with `latency_s`) the total tok/s of the method and of AR and the per-stream latency; a column for each of
    `settings` (read from a row's "settings"; concurrency too where a row ran above 1), and a note for rows that did
    not run."""
    f = _f
    rows_in = [summaries] if isinstance(summaries, dict) else summaries
    extra = list(settings or [])
    if "concurrency" not in extra and any((s.get("concurrency") or 1) > 1 for s in rows_in):
        extra.append("concurrency")
    load = any("latency_s" in s for s in rows_in)
    notes = any(row_note(s) for s in rows_in)
    head = ("model", "method", "budget", *extra, "block", "prompts", "tau", "tok/s", "AR tok/s", "speedup",
            *(["total tok/s", "AR total", "latency p50/p90 s"] if load else []), "match", "verdicts", "round",
            *(["note"] if notes else []))
    rows = [head]
    for s in rows_in:
        vals = [str(s["concurrency"]) if k == "concurrency" and "concurrency" in s else setting_cell(s, k)
                for k in extra]
        if s.get("num_prompts") is None:  # a job that did not run
            rows.append((s["model"], s["method"], f(s.get("budget"), "d"), *vals, *["-"] * (12 if load else 9),
                         row_note(s)))
            continue
        n = s["num_prompts"]
        match = "-" if s["match_rate"] is None else f"{round(s['match_rate'] * n)}/{n}"
        rows.append((s["model"], method_cell(s), f(s["budget"], "d"), *vals, f(s["block_size"], "d"), str(n),
                     f(s["tau"]), f(s["tokens_per_s"], ".1f"), f(s["baseline_tokens_per_s"], ".1f"),
                     f(s["speedup"], ".2f", "x"), *(load_cells(s) if load else ()), match,
                     verdict_cell(s.get("validation")), round_cell(s), *([row_note(s)] if notes else [])))
    w = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(n) for c, n in zip(line, w, strict=True)).rstrip() for line in rows)


def claim_config(sweep_dir: Path, config_hash: str, job_dir: Path) -> str | None:
    """Claim this config for `job_dir` within its sweep; the job dir that claimed it first, if another did.

    An exclusive create, so jobs of one sweep in other processes (submitit, Ray) agree on it too."""
    claims = Path(sweep_dir) / CLAIMS
    claims.mkdir(parents=True, exist_ok=True)
    path = claims / config_hash
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        first = path.read_text().strip()
        return first if first and first != str(job_dir) else None
    with os.fdopen(fd, "w") as f:
        f.write(str(job_dir))
    return None


def _overrides(job_dir: Path) -> dict[str, str]:
    """key -> value of the job's own overrides (.hydra/overrides.yaml: a YAML list of `key=value`)."""
    import yaml

    f = job_dir / ".hydra" / "overrides.yaml"
    items = yaml.safe_load(f.read_text()) if f.is_file() else []
    return dict(str(o).lstrip("+~").split("=", 1) for o in items or [] if "=" in str(o))


def sweep_rows(sweep_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """A row per job of the sweep (its summary, or what it repeated), and the settings that vary across jobs."""
    dirs = sorted((p for p in Path(sweep_dir).iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    rows, settings = [], []
    for d in dirs:
        ov = _overrides(d)
        if (d / "summary.json").is_file():
            row = json.loads((d / "summary.json").read_text())
        elif (d / SKIPPED).is_file():
            row = json.loads((d / SKIPPED).read_text())
        else:
            continue
        rows.append({**row, "settings": ov})
        settings.append(ov)
    keys = sorted({k for ov in settings for k in ov})
    varying = [k for k in keys if k not in SHOWN and len({ov.get(k) for ov in settings}) > 1]
    return rows, varying


class SweepTableCallback(Callback):
    """At the end of a multirun, one table over every job of the sweep: a column for each setting that
    varies across its jobs, and a row (with a note) for each job that repeated an earlier one."""

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not sweep_dir.is_dir():
            return
        rows, varying = sweep_rows(sweep_dir)
        if len(rows) > 1:
            print(f"\nsweep {sweep_dir}:\n{format_table(rows, varying)}")
