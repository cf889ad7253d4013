"""DFlash2 selector objectives on the toy pair: drafters trained alike but for the selector's term, measured on
toy_eval (256 unseen prompts, greedy): the selector's chain, DDTree under marginal and pair scores at budgets 16 / 32 /
64, accuracy on and off the drafter's own path (python -m ddtree.diagnose, as bench_toy_run measures it), and the
training's probe metrics (docs/training.md, "DFlash2 drafters").

    python bench/bench_dflash2_loss.py --drafter "ours (shipped)=assets/toy/drafter2" \\
        --drafter "public, stop-gradient=runs/t51/sg"      # a training out_dir (its drafter/, summary.json) or a drafter

tau is deterministic (one run each); no speed is measured (the machine is shared). `--work DIR` keeps each
drafter's sweep in DIR/<its weights' hash> and reuses a finished one (the same weights, under any name); `--jobs N` sweeps N drafters at once.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _common import ROOT, Record, add_json_arg, params

BUDGETS = (16, 32, 64)
PROBE = ("unary_recall", "unary_acc", "selector_acc_tf", "tau_proxy", "path_tau", "oracle_tau")  # tau_proxy: the unary chain's
TABLE = "DFlash2 selector objectives on the toy pair (toy_eval, 256 unseen prompts)"
PROBE_TABLE = "Their training's probe metrics (the last step; teacher-forced blocks of the training data)"


def fingerprint(drafter: Path) -> str:
    """What a kept sweep was run over: the drafter's config and weights."""
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        h.update((drafter / name).read_bytes())
    return h.hexdigest()[:16]


def sweep(out: Path, drafter: Path) -> list[dict]:
    """The chain and both scorings' trees at BUDGETS over `drafter` on toy_eval; each job's summary and accuracy.
    A finished sweep of the same drafter in `out` (its done.json) is read again, not rerun."""
    from ddtree.pipeline.diagnose.analysis import diagnose
    from ddtree.pipeline.diagnose.records import load_jobs

    done, mark = out / "done.json", {"fingerprint": fingerprint(drafter)}
    if not (done.exists() and json.loads(done.read_text()) == mark):
        _run_sweep(out, drafter)
        done.write_text(json.dumps(mark))
    jobs = []
    for p in sorted(out.glob("*/summary.json")):
        s = json.loads(p.read_text())
        acc = diagnose(load_jobs(p.parent)).get("accuracy") or {}
        s["on_path"], s["off_path"] = ((acc.get(k) or {}).get("rate") for k in ("main", "off"))
        s["off_interval"] = acc.get("off") or {}  # its Wilson interval and count
        jobs.append(s)
    return jobs


def _run_sweep(out: Path, drafter: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "ddtree.run", "experiment=toy_dflash2", "dataset=toy_eval", "force=true",
           "tracking=none", "baseline=false", f"drafter.name_or_path={drafter.resolve()}", f"hydra.sweep.dir={out}",
           "method=dflash,ddtree", "scoring=marginal,pair", f"budget={','.join(map(str, BUDGETS))}", "-m"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"the run over {drafter} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")


def row(name: str, jobs: list[dict]) -> list:
    chain = next(s["tau"] for s in jobs if s["method"] == "dflash")
    tree = {(s["scoring"], s["budget"]): s for s in jobs if s["method"] == "ddtree"}
    m32, p32 = tree[("marginal", 32)], tree[("pair", 32)]
    on, off_m, off_p = p32["on_path"], m32["off_path"], p32["off_path"]
    closed = (off_p - off_m) / (on - off_m) if None not in (on, off_m, off_p) and on > off_m else None
    ci = p32["off_interval"]
    interval = f"{ci['lo']:.0%}–{ci['hi']:.0%} (n {ci['n']})" if ci.get("n") else None
    return [name, chain, *(tree[("marginal", b)]["tau"] for b in BUDGETS), *(tree[("pair", b)]["tau"] for b in BUDGETS),
            on, off_m, off_p, interval, closed]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--drafter", action="append", required=True, metavar="NAME=PATH",
                    help="a training out_dir (its drafter/ and summary.json) or a drafter directory")
    ap.add_argument("--note", default="", help="a line on how the drafters were trained")
    ap.add_argument("--work", default="", help="keep each drafter's sweep in WORK/<hash>; a finished one is reused")
    ap.add_argument("--jobs", type=int, default=1, help="drafters swept at once (one process each)")
    add_json_arg(ap, "bench_dflash2_loss")
    a = ap.parse_args()
    specs = [(name, Path(path)) for name, path in (spec.rsplit("=", 1) for spec in a.drafter)]  # a name may hold "="
    with tempfile.TemporaryDirectory(prefix="bench_dflash2_loss_") as tmp:
        work = Path(a.work) if a.work else Path(tmp)

        def one(i: int) -> tuple[list, float]:
            name, path = specs[i]
            drafter = path / "drafter" if (path / "drafter" / "config.json").exists() else path
            t0 = time.perf_counter()
            r = row(name, sweep(work / fingerprint(drafter), drafter))
            print(" | ".join(str(c) for c in r), flush=True)
            return r, round(time.perf_counter() - t0)

        with ThreadPoolExecutor(max(1, a.jobs)) as pool:
            done = list(pool.map(one, range(len(specs))))
    rows, seconds = [r for r, _ in done], [t for _, t in done]
    probes = []
    for name, path in specs:
        summary = path / "summary.json"
        if summary.exists():
            train = (json.loads(summary.read_text()).get("stages") or {}).get("train") or {}
            probes.append([name, *(train.get(f"probe_{k}") for k in PROBE)])
    rec = Record("bench_dflash2_loss", "DFlash2 selector objectives on the toy pair",
                 description="Toy DFlash2 drafters trained on the same answers and features for the same steps "
                             "(experiment=toy_dflash2), differing only in the selector's term (optim.selector); tau "
                             "of the selector's chain and of DDTree under both scorings on toy_eval, and accuracy at "
                             "depths >= 2 of the accepted paths on the drafter's path and off it (the pair tree's at "
                             "budget 32, with its Wilson interval and count; off-path under marginal scores beside it). "
                             "gap closed: (pair off - marginal off) / (on - marginal off).",
                 params=params(a, seconds=seconds))  # a reused sweep's: reading it
    cols = ["objective", "chain tau", *(f"marginal tau {b}" for b in BUDGETS), *(f"pair tau {b}" for b in BUDGETS),
            "on-path accuracy", "off-path, marginal", "off-path, pair", "off-path, pair: 95% interval", "gap closed"]
    fmts = {c: "{:.2f}" for c in cols[1:8]} | {c: "{:.0%}" for c in cols[8:11] + cols[12:]}
    rec.table(TABLE, cols, rows, fmts, note=a.note)
    if probes:
        rec.table(PROBE_TABLE, ["objective", *PROBE], probes, {k: "{:.3f}" for k in PROBE})
    rec.write(a.json)


if __name__ == "__main__":
    main()
