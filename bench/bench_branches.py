"""What each CPU-only branch of the engine gains on the CPU toy pairs (the audit table of docs/gpu.md).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_branches.py [--pairs toy,toy_pure] [--prompts 4] [--new 64]
        [--passes 5] [--branches host_tree,...]

For each branch of `ddtree.engine.host.HOST_BRANCHES` and each method it touches, the same prompts are decoded
with the branch on (the CPU default) and off (`device_path(name)`: the code a CUDA run takes), one Engine each,
interleaved pass after pass so the machine's load hits both alike. Reported: the median over passes of the
wall time of all prompts, and the gain = off / on (> 1: the branch pays on this CPU). Outputs must be equal.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch
from _common import load_pair

import ddtree
from ddtree.engine.host import HOST_BRANCHES, device_path

# the methods each branch can change
TOUCHES = {"control": ["ddtree:64"],  # nothing switched: the noise floor of the machine
           "host_tree": ["ddtree:16", "ddtree:64", "ddtree:256"],
           "dense_attention": ["dflash", "ddtree:16", "ddtree:64"], "lazy_head": ["ddtree:64", "ddtree:256"],
           "gdn_step": ["ar"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", default="toy,toy_pure")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--branches", default=",".join(["control", *HOST_BRANCHES]))
    a = ap.parse_args()
    torch.set_num_threads(1)
    print("| pair | branch | method | on ms | off ms | gain (off / on) |\n| --- | --- | --- | --- | --- | --- |")
    for pair in a.pairs.split(","):
        pr = load_pair(pair, a.prompts)
        if pr is None:
            continue
        target, drafter, prompts, stops = pr.target, pr.drafter, pr.prompts, pr.stops
        for branch in a.branches.split(","):
            for spec in TOUCHES[branch]:
                method, _, b = spec.partition(":")
                kw = dict(method=method, budget=int(b) if b else None)
                engines = {"on": ddtree.Engine(target, drafter if method != "ar" else None, **kw)}
                off = device_path(branch) if branch != "control" else contextlib.nullcontext()
                with off:
                    engines["off"] = ddtree.Engine(target, drafter if method != "ar" else None, **kw)
                times = {k: [] for k in engines}
                outs = {}
                for p in range(a.passes + 1):  # the first pass warms up
                    for k, engine in (engines.items() if p % 2 else reversed(engines.items())):
                        ctx = device_path(branch) if k == "off" and branch != "control" else contextlib.nullcontext()
                        t = time.perf_counter()
                        with ctx:
                            outs[k] = [engine.generate(ids, max_new_tokens=a.new, stop_token_ids=stops).output_ids
                                       for ids in prompts]
                        if p:
                            times[k].append(time.perf_counter() - t)
                assert outs["on"] == outs["off"], (pair, branch, spec)
                on, off = (1e3 * statistics.median(times[k]) for k in ("on", "off"))
                print(f"| {pair} | {branch} | {spec} | {on:.0f} | {off:.0f} | {off / on:.3f} |", flush=True)


if __name__ == "__main__":
    main()
