"""The toy jobs `make run` runs, N times: per method and budget, tau, the speedup over AR (median and range of the N
runs) and the outputs' verdicts. Its record (docs/bench/bench_toy_run.json) is the README's result table (`make
docs`); each run is one `python -m ddtree.run experiment=toy method=mtp,dflash,ddtree -m` process (the budget sweep
of the experiment; DFlash and MTP ignore the budget and run once), offline, with tracking off.

    OMP_NUM_THREADS=1 python bench/bench_toy_run.py --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, Record, Spread, add_json_arg, params

METHODS = "mtp,dflash,ddtree"
LABELS = {"ar": "AR", "dflash": "DFlash", "ddtree": "DDTree", "mtp": "MTP"}


def run_once(out: Path, extra: list[str]) -> list[dict]:
    """One `make run`-like sweep into `out`; every job's summary.json."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "ddtree.run", "experiment=toy", f"method={METHODS}", "force=true", "tracking=none",
           f"hydra.sweep.dir={out}", "-m", *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("*/summary.json"))]


def label(s: dict) -> str:
    if s["method"] == "mtp":
        return f"MTP, {s['mtp']['steps']} steps" + (f", top-{s['mtp']['topk']}" if s["mtp"]["topk"] > 1 else "")
    return LABELS.get(s["method"], s["method"])


def outputs(s: dict) -> str:
    v = s.get("validation") or {}
    if not v.get("checked"):
        return f"{round((s.get('match_rate') or 0) * s['num_prompts'])}/{s['num_prompts']} equal to AR"
    ok = v["checked"] - v.get("suspect", 0)
    return f"{v['exact']}/{v['checked']} exact" if v["exact"] == v["checked"] else f"{ok}/{v['checked']} ok"


def table_rows(runs: list[list[dict]]) -> list[list]:
    """One row per (method, budget), in the order of the first run's jobs: MTP, DFlash, then DDTree by budget."""
    by_key: dict[tuple, list[dict]] = {}
    for summaries in runs:
        for s in summaries:
            by_key.setdefault((s["method"], s.get("budget")), []).append(s)
    order = {"mtp": 0, "dflash": 1, "ddtree": 2}
    rows = []
    for (_, budget), ss in sorted(by_key.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1] or 0)):
        taus = [s["tau"] for s in ss]
        speed = [s["speedup"] for s in ss if s.get("speedup")]
        verdicts = sorted({outputs(s) for s in ss})
        rows.append([label(ss[0]), budget, Spread.of(taus).cell(), Spread.of(speed).cell() if speed else None,
                     "; ".join(verdicts)])
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="how many times to run the jobs (the spread is over them)")
    ap.add_argument("--note", default="", help="a line on the machine's state (e.g. 'shared with other jobs')")
    add_json_arg(ap, "bench_toy_run")
    a = ap.parse_args()
    runs, seconds = [], []
    with tempfile.TemporaryDirectory(prefix="bench_toy_run_") as tmp:
        for i in range(a.runs):
            t0 = time.perf_counter()
            runs.append(run_once(Path(tmp) / f"run{i}", []))
            seconds.append(time.perf_counter() - t0)
            print(f"# run {i + 1}/{a.runs}: {len(runs[-1])} jobs in {seconds[-1]:.0f} s", flush=True)
    rows = table_rows(runs)
    rec = Record("bench_toy_run", "make run on the toy pair: tau and speedup over AR",
                 description="The jobs `make run` runs (the toy pair's 16 held-out prompts, 128 new tokens, each job "
                             "against its AR baseline on the same prompts), run N times; tau is deterministic, the "
                             "speedup is the median with the range over the runs. This is the README's result table.",
                 params=params(a, seconds_per_run=[round(s) for s in seconds]))
    rec.table("Speedup over AR on the toy pair (`make run`)", ["method", "budget", "tau", "speedup over AR", "outputs"],
              rows, {"tau": "{:.2f}", "speedup over AR": "{:.2f}x"}, note=a.note)
    for row in rows:
        print(" | ".join(str(c) for c in row))
    rec.write(a.json)


if __name__ == "__main__":
    main()
