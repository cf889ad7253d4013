"""Where a round's time outside the forwards goes: each engine function timed in place, inside real generations.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_overhead.py [--budget 64] [--prompts 48] [--new 128] [--record-ab 5]

On the shipped toy pair (assets/toy; a tiny random Qwen3 and drafter without it), greedy DDTree, one warm-up pass,
then one timed pass. Each function below is wrapped with a perf_counter pair (~1 us each) and reported in ms per
round with its calls per round. Nested ones overlap: verify holds the lazy head's and tail's asks only where the
loop books them there, best_first_tree holds the C build (or, without it, the heap and the host arrays), commit holds
the GDN commit, the walk
holds its asks (argmax). Calls outside the rounds (the chain prefill's commit, one per generation) are included,
hence commit calls per round above 1. setup = each generate call's wall time outside its prefill and rounds (one
`ddtree.Engine` for all the prompts, as `ddtree.run` keeps one per job: a generation sets up only its caches).
These are the costs right after the forwards that evict the host code's caches, which is what a round pays: warm,
in a loop of its own, the same tree build and host arrays take about half (bench/bench_tree.py).
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_stages import load_pair  # noqa: E402

import ddtree.engine.diagnostics as diagnostics  # noqa: E402
import ddtree.engine.gdn as gdn  # noqa: E402
import ddtree.engine.loop as loop  # noqa: E402
import ddtree.engine.proposers as proposers  # noqa: E402
import ddtree.engine.target as target_mod  # noqa: E402
import ddtree.engine.tree as tree_mod  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--record-ab", type=int, default=0, metavar="N",
                    help="instead: N interleaved passes with the per-round diagnosis records on and off (medians)")
    args = ap.parse_args()
    if args.record_ab:
        return record_ab(args)
    name, target, drafter, prompts, stops = load_pair(args.prompts)
    spent: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()

    def wrap(owner, attr: str) -> None:
        inner = getattr(owner, attr)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                spent[attr] += time.perf_counter() - t
                calls[attr] += 1

        setattr(owner, attr, timed)

    for owner, attr in ((proposers.DrafterBlock, "draft_logits"), (proposers, "best_first_tree"),
                        (tree_mod, "_best_first_rows"), (tree_mod, "_best_first_native"),
                        (tree_mod, "_best_first_heap"), (tree_mod, "_host_tree"),
                        (target_mod.TargetSession, "verify"), (target_mod.WalkRows, "argmax"),
                        (target_mod.WalkRows, "features"), (loop, "greedy_walk_rows"),
                        (target_mod.TargetSession, "commit"), (gdn, "commit_linear_states"),
                        (diagnostics.RoundRecorder, "round"), (diagnostics.RoundRecorder, "finish")):
        wrap(owner, attr)

    engine = loop.Engine(target, drafter, method="ddtree", budget=args.budget)  # as ddtree.run: one per job

    def run() -> tuple[int, float, list[float]]:
        rounds, decode, setup = 0, 0.0, []
        for ids in prompts:
            t = time.perf_counter()
            r = engine.generate(ids, max_new_tokens=args.new, stop_token_ids=stops)
            setup.append(time.perf_counter() - t - r.ttft_s - r.decode_s)
            rounds += len(r.acceptance_lengths)
            decode += r.decode_s
        return rounds, decode, setup

    run()
    spent.clear()
    calls.clear()
    rounds, decode, setup = run()
    cpu = next((x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines()
                if x.startswith("model name")), platform.machine()) if Path("/proc/cpuinfo").exists() else platform.machine()
    print(f"# {cpu}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"# {name}, budget {args.budget}, {len(prompts)} prompts, {torch.get_num_threads()} thread(s): {rounds} rounds, "
          f"{1e3 * decode / rounds:.2f} ms a round, setup {1e3 * statistics.median(setup):.2f} ms a generation "
          f"({rounds / len(prompts):.2f} rounds a generation)")
    # the forwards: the drafter's, and the target's (its verification, then the walked rows' head and features)
    forwards = sum(spent[a] for a in ("verify", "draft_logits", "argmax", "features"))
    whole = decode + sum(setup)
    print(f"# overhead (outside the forwards): {1e3 * (decode - forwards) / rounds:.2f} ms a round, "
          f"{100 * (whole - forwards) / whole:.1f}% of the decode time with each generation's setup "
          f"({100 * (decode - forwards) / decode:.1f}% of the rounds alone)")
    print("| function | ms / round | calls / round |\n| --- | --- | --- |")
    for attr, s in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"| `{attr}` | {1e3 * s / rounds:.3f} | {calls[attr] / rounds:.2f} |")


def record_ab(args) -> None:
    """The diagnosis records' cost: passes over the prompts alternating record=True / record=False (one Engine each, as a
    job keeps), median decode ms a round of each; the machine's noise shows as the spread of the passes."""
    name, target, drafter, prompts, stops = load_pair(args.prompts)
    engines = {rec: loop.Engine(target, drafter, method="ddtree", budget=args.budget, record=rec) for rec in (True, False)}
    per: dict[bool, list[float]] = {True: [], False: []}
    for i in range(args.record_ab + 1):
        for rec in ((True, False) if i % 2 else (False, True)):
            rounds = decode = 0.0
            for ids in prompts:
                r = engines[rec].generate(ids, max_new_tokens=args.new, stop_token_ids=stops)
                rounds += r.rounds
                decode += r.decode_s
            if i:  # pass 0 warms up
                per[rec].append(1e3 * decode / rounds)
    on, off = statistics.median(per[True]), statistics.median(per[False])
    print(f"# {name}, ddtree budget {args.budget}, {len(prompts)} prompts, {args.record_ab} passes each, "
          f"{torch.get_num_threads()} thread(s)")
    print(f"record on : median {on:.3f} ms a round (passes {', '.join(f'{x:.2f}' for x in per[True])})")
    print(f"record off: median {off:.3f} ms a round (passes {', '.join(f'{x:.2f}' for x in per[False])})")
    print(f"overhead: {100 * (on - off) / off:+.2f} % of a round")


if __name__ == "__main__":
    main()
