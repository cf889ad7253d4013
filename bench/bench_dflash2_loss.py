"""DFlash2 selector objectives on the toy pair: drafters trained alike but for the selector's term, measured on
toy_eval (256 unseen prompts, greedy): the selector's chain, DDTree under marginal and pair scores at budgets 16 / 32 /
64, accuracy on and off the drafter's own path (python -m ddtree.diagnose, as bench_toy_run measures it), and the
training's probe metrics (docs/training.md, "DFlash2 drafters").

    python bench/bench_dflash2_loss.py --drafter "ours (shipped)=assets/toy/drafter2" \\
        --drafter "public, stop-gradient=runs/t51/sg"      # a training out_dir (its drafter/, summary.json) or a drafter

tau is deterministic (one run each); no speed is measured (the machine is shared).
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

from _common import ROOT, Record, add_json_arg, params

BUDGETS = (16, 32, 64)
PROBE = ("unary_recall", "unary_acc", "selector_acc_tf", "path_tau", "oracle_tau")
TABLE = "DFlash2 selector objectives on the toy pair (toy_eval, 256 unseen prompts)"
PROBE_TABLE = "Their training's probe metrics (the last step; teacher-forced blocks of the training data)"


def sweep(out: Path, drafter: Path) -> list[dict]:
    """The chain and both scorings' trees at BUDGETS over `drafter` on toy_eval; each job's summary and accuracy."""
    from ddtree.pipeline.diagnose.analysis import diagnose
    from ddtree.pipeline.diagnose.records import load_jobs

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "ddtree.run", "experiment=toy_dflash2", "dataset=toy_eval", "force=true",
           "tracking=none", "baseline=false", f"drafter.name_or_path={drafter.resolve()}", f"hydra.sweep.dir={out}",
           "method=dflash,ddtree", "scoring=marginal,pair", f"budget={','.join(map(str, BUDGETS))}", "-m"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    jobs = []
    for p in sorted(out.glob("*/summary.json")):
        s = json.loads(p.read_text())
        acc = diagnose(load_jobs(p.parent)).get("accuracy") or {}
        s["on_path"], s["off_path"] = ((acc.get(k) or {}).get("rate") for k in ("main", "off"))
        jobs.append(s)
    return jobs


def row(name: str, jobs: list[dict]) -> list:
    chain = next(s["tau"] for s in jobs if s["method"] == "dflash")
    tree = {(s["scoring"], s["budget"]): s for s in jobs if s["method"] == "ddtree"}
    m32, p32 = tree[("marginal", 32)], tree[("pair", 32)]
    on, off_m, off_p = p32["on_path"], m32["off_path"], p32["off_path"]
    closed = (off_p - off_m) / (on - off_m) if None not in (on, off_m, off_p) and on > off_m else None
    return [name, chain, *(tree[("marginal", b)]["tau"] for b in BUDGETS), *(tree[("pair", b)]["tau"] for b in BUDGETS),
            on, off_m, off_p, closed]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", action="append", required=True, metavar="NAME=PATH",
                    help="a training out_dir (its drafter/ and summary.json) or a drafter directory")
    ap.add_argument("--note", default="", help="a line on how the drafters were trained")
    add_json_arg(ap, "bench_dflash2_loss")
    a = ap.parse_args()
    rows, probes, seconds = [], [], []
    with tempfile.TemporaryDirectory(prefix="bench_dflash2_loss_") as tmp:
        for i, spec in enumerate(a.drafter):
            name, path = spec.split("=", 1)
            path = Path(path)
            drafter = path / "drafter" if (path / "drafter" / "config.json").exists() else path
            t0 = time.perf_counter()
            rows.append(row(name, sweep(Path(tmp) / str(i), drafter)))
            seconds.append(round(time.perf_counter() - t0))
            summary = path / "summary.json"
            if summary.exists():
                train = (json.loads(summary.read_text()).get("stages") or {}).get("train") or {}
                probes.append([name, *(train.get(f"probe_{k}") for k in PROBE)])
            print(" | ".join(str(c) for c in rows[-1]), flush=True)
    rec = Record("bench_dflash2_loss", "DFlash2 selector objectives on the toy pair",
                 description="Toy DFlash2 drafters trained on the same answers and features for the same steps "
                             "(experiment=toy_dflash2), differing only in the selector's term (optim.selector); tau "
                             "of the selector's chain and of DDTree under both scorings on toy_eval, and accuracy at "
                             "depths >= 2 of the accepted paths on the drafter's path and off it (the pair tree's at "
                             "budget 32; off-path under marginal scores beside it). gap closed: (pair off - marginal "
                             "off) / (on - marginal off).",
                 params=params(a, seconds=seconds))
    cols = ["objective", "chain tau", *(f"marginal tau {b}" for b in BUDGETS), *(f"pair tau {b}" for b in BUDGETS),
            "on-path accuracy", "off-path, marginal", "off-path, pair", "gap closed"]
    fmts = {c: "{:.2f}" for c in cols[1:8]} | {c: "{:.0%}" for c in cols[8:]}
    rec.table(TABLE, cols, rows, fmts, note=a.note)
    if probes:
        rec.table(PROBE_TABLE, ["objective", *PROBE], probes, {k: "{:.3f}" for k in PROBE})
    rec.write(a.json)


if __name__ == "__main__":
    main()
