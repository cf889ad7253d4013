"""The toy jobs `make run` runs, N times: per method and budget, tau, the speedup over AR (median and range of the N
runs) and the outputs' verdicts. Its record (docs/bench/bench_toy_run.json): the first table is the README's result
table (`make docs`); each run is one `python -m ddtree.run experiment=toy method=mtp,dflash,ddtree -m` process (the
budget sweep of the experiment; DFlash and MTP ignore the budget and run once), offline, with tracking off.

The DFlash2 tables (docs/dflash2.md's, `make docs`): the toy DFlash drafter's chain beside the toy DFlash2 drafter's
chain and its DDTree trees under both scorings at DFLASH2_BUDGET (`experiment=toy_dflash2`, as `make run` runs them),
with the diagnosis's top-1 accuracy on and off the drafter's own path (pair trees and the DFlash2 chain: under pair
scores; python -m ddtree.diagnose), on two prompt sets: `make run`'s 16 held-out prompts, and `dataset=toy_eval`'s 256
prompts that no toy drafter trained on (enough rounds to tell the scorings apart: a toy answer is one to three
rounds). Then, once (tau is deterministic), both scorings' tau by budget on toy_eval.

    OMP_NUM_THREADS=1 python bench/bench_toy_run.py --runs 3
    OMP_NUM_THREADS=1 python bench/bench_toy_run.py --runs 3 --dflash2-only   # the DFlash2 table alone, written into
                                                                             # the record beside the others
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

from ddtree.docs import DFLASH2_SWEEP_TABLE, DFLASH2_TABLE

METHODS = "mtp,dflash,ddtree"
LABELS = {"ar": "AR", "dflash": "DFlash", "ddtree": "DDTree", "mtp": "MTP"}
DFLASH2_TITLE = DFLASH2_TABLE  # (ddtree.docs renders it into docs/dflash2.md)
DFLASH2_BUDGET = 32  # conf/experiment/toy_dflash2.yaml's
DFLASH2_SETS = {"toy": "16 held-out", "toy_eval": "256 unseen"}  # dataset -> the table's prompts cell
SWEEP_BUDGETS = (8, 16, 32, 64)


def run_once(out: Path, extra: list[str], experiment: str = "toy") -> list[dict]:
    """One `make run`-like job or sweep into `out`; every job's summary.json, with its job dir as "dir"."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "ddtree.run", f"experiment={experiment}", "force=true", "tracking=none",
           f"hydra.sweep.dir={out}", *extra, "-m"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return [json.loads(p.read_text()) | {"dir": str(p.parent)} for p in sorted(out.glob("*/summary.json"))]


def dflash2_runs(out: Path) -> list[dict]:
    """The DFlash2 table's jobs on each of DFLASH2_SETS: the toy DFlash drafter's chain (experiment=toy), the DFlash2
    chain and its trees under both scorings (experiment=toy_dflash2), each job's accuracy on and off the drafter's path
    from its diagnosis."""
    from ddtree.pipeline.diagnose.analysis import diagnose
    from ddtree.pipeline.diagnose.records import load_jobs

    jobs = []
    for ds, prompts in DFLASH2_SETS.items():  # make run's lines (its DFlash job, its DFlash2 sweep) on each set
        part = (run_once(out / ds / "dflash", ["method=dflash", f"dataset={ds}"])
                + [s | {"drafter2": True} for s in run_once(out / ds / "dflash2", ["method=dflash,ddtree",
                                                                                    f"dataset={ds}"], "toy_dflash2")])
        jobs += [s | {"prompts": prompts} for s in part]
    for s in jobs:
        acc = diagnose(load_jobs(Path(s["dir"]))).get("accuracy") or {}
        s["on_path"], s["off_path"] = ((acc.get(k) or {}).get("rate") for k in ("main", "off"))
    return jobs


def dflash2_sweep(out: Path) -> list[list]:
    """Both scorings' tau at SWEEP_BUDGETS on toy_eval (no AR baseline: tau only): a row per scoring."""
    jobs = run_once(out, ["method=ddtree", "dataset=toy_eval", "scoring=marginal,pair",
                          f"budget={','.join(map(str, SWEEP_BUDGETS))}", "baseline=false"], "toy_dflash2")
    tau = {(s["scoring"], s["budget"]): s["tau"] for s in jobs}
    return [[scoring, *(tau.get((scoring, b)) for b in SWEEP_BUDGETS)] for scoring in ("marginal", "pair")]


def dflash2_rows(runs: list[list[dict]]) -> list[list]:
    """One row per (prompts, drafter, method, scoring): tau, accuracy on and off the path (deterministic: the first
    run's), the speedup's spread, the outputs' verdicts."""
    by_key: dict[tuple, list[dict]] = {}
    for summaries in runs:
        for s in summaries:
            key = (list(DFLASH2_SETS.values()).index(s["prompts"]), bool(s.get("drafter2")), s["method"],
                   s.get("scoring") if s["method"] == "ddtree" else None)
            by_key.setdefault(key, []).append(s)
    rows = []
    for (_, two, method, scoring), ss in sorted(by_key.items(), key=lambda kv: (kv[0][0], kv[0][1],
                                                                                 kv[0][2] != "dflash", kv[0][3] or "")):
        speed = [s["speedup"] for s in ss if s.get("speedup")]
        rows.append([ss[0]["prompts"], "toy DFlash2" if two else "toy DFlash",
                     f"{LABELS[method]}" + (f", {scoring}" if scoring else ""),
                     ss[0].get("budget") if method == "ddtree" else None, Spread.of([s["tau"] for s in ss]).cell(),
                     ss[0]["on_path"], ss[0]["off_path"], Spread.of(speed).cell() if speed else None,
                     "; ".join(sorted({outputs(s) for s in ss}))])
    return rows


DFLASH2_COLUMNS = ["prompts", "drafter", "method", "budget", "tau", "on-path accuracy", "off-path accuracy", "speedup over AR",
                   "outputs"]
DFLASH2_FORMATS = {"tau": "{:.2f}", "on-path accuracy": "{:.0%}", "off-path accuracy": "{:.0%}",
                   "speedup over AR": "{:.2f}x"}


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
    ap.add_argument("--dflash2-only", action="store_true",
                    help="run the DFlash2 table's jobs alone and write that table into the existing record (its "
                         "other tables and their provenance kept; this table's in its note)")
    add_json_arg(ap, "bench_toy_run")
    a = ap.parse_args()
    runs, runs2, seconds = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_toy_run_") as tmp:
        for i in range(a.runs):
            t0 = time.perf_counter()
            if not a.dflash2_only:
                runs.append(run_once(Path(tmp) / f"run{i}", [f"method={METHODS}"]))
            runs2.append(dflash2_runs(Path(tmp) / f"dflash2_{i}"))
            if i == 0:
                sweep = dflash2_sweep(Path(tmp) / "dflash2_sweep")
            seconds.append(time.perf_counter() - t0)
            print(f"# run {i + 1}/{a.runs}: {len(runs[-1]) if runs else 0} + {len(runs2[-1])} jobs in "
                  f"{seconds[-1]:.0f} s", flush=True)
    rows2 = dflash2_rows(runs2)
    rec = Record("bench_toy_run", "make run on the toy pair: tau and speedup over AR",
                 description="The jobs `make run` runs (the toy pair's 16 held-out prompts, 128 new tokens, each job "
                             "against its AR baseline on the same prompts), run N times; tau is deterministic, the "
                             "speedup is the median with the range over the runs. The first table is the README's "
                             "result table, the second docs/dflash2.md's, its DFlash2 jobs also on toy_eval's 256 "
                             "prompts (accuracy: the drafter's top-1 right at depths >= 2 of the accepted paths, on its "
                             "own path and off it, from the job's diagnosis), the third both scorings' tau by budget "
                             "on toy_eval (one run).",
                 params=params(a, seconds_per_run=[round(s) for s in seconds]))
    note2 = a.note
    if a.dflash2_only:
        prov = rec.as_dict()
        note2 = (f"{a.note}; " if a.note else "") + (
            f"recorded alone (--dflash2-only, {a.runs} runs, {[round(s) for s in seconds]} s each): commit "
            f"{prov['commit']}, {prov['date']}, {prov['machine']}")
    rec.table(DFLASH2_TITLE, DFLASH2_COLUMNS, rows2, DFLASH2_FORMATS, note=note2)
    rec.table(DFLASH2_SWEEP_TABLE, ["scoring", *(f"tau, budget {b}" for b in SWEEP_BUDGETS)], sweep,
              {f"tau, budget {b}": "{:.2f}" for b in SWEEP_BUDGETS}, note=note2)
    for row in rows2 + sweep:
        print(" | ".join(str(c) for c in row))
    if a.dflash2_only:
        if a.json and a.json != "-":
            path = Path(a.json)
            old = json.loads(path.read_text())
            old["tables"] = [t for t in old["tables"] if t["title"] not in (DFLASH2_TITLE, DFLASH2_SWEEP_TABLE)
                             ] + rec.tables
            path.write_text(json.dumps(old, indent=1, ensure_ascii=False) + "\n")
            print(f"# record: {path} (the DFlash2 tables replaced; make docs renders them)")
        return
    rows = table_rows(runs)
    rec.tables.insert(0, {"title": "Speedup over AR on the toy pair (`make run`)",
                          "columns": ["method", "budget", "tau", "speedup over AR", "outputs"],
                          "rows": [list(r) for r in rows],
                          "formats": {"tau": "{:.2f}", "speedup over AR": "{:.2f}x"}} | ({"note": a.note} if a.note else {}))
    for row in rows:
        print(" | ".join(str(c) for c in row))
    rec.write(a.json)


if __name__ == "__main__":
    main()
