"""Where a round's time outside the forwards goes: each engine function timed in place, inside real generations.

    OMP_NUM_THREADS=1 python bench/bench_overhead.py [--budget 64] [--prompts 48] [--new 128] [--record-ab 5]

On the shipped toy pair (assets/toy; a tiny random Qwen3 and drafter without it), greedy DDTree, one warm-up pass,
then one timed pass. Each function below is wrapped with a perf_counter pair (~1 us each) and reported in ms per
round with its calls per round. Nested ones overlap: verify holds the lazy head's and tail's asks only where the
loop books them there, best_first_tree holds the C build (or, without it, the torch build), commit holds
the GDN commit, the walk
holds its asks (argmax). Calls outside the rounds (the chain prefill's commit, one per generation) are included,
hence commit calls per round above 1. setup = each generate call's wall time outside its prefill and rounds (one
`ddtree.Engine` for all the prompts, as `ddtree.run` keeps one per job: a generation sets up only its caches).
These are the costs right after the forwards that evict the host code's caches, which is what a round pays: warm,
in a loop of its own, the same tree build and host arrays take about half (bench/bench_tree.py).
Writes docs/bench/bench_overhead.json.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
from _common import Record, add_json_arg, load_pair, params, random_pair

import ddtree.engine.diagnostics as diagnostics
import ddtree.engine.gdn as gdn
import ddtree.engine.loop as loop
import ddtree.engine.proposers as proposers
import ddtree.engine.target as target_mod
import ddtree.engine.tree as tree_mod


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--record-ab", type=int, default=0, metavar="N",
                    help="instead: N interleaved passes with the per-round diagnosis records on and off (medians)")
    add_json_arg(ap, "bench_overhead")
    args = ap.parse_args()
    if args.record_ab:
        return record_ab(args)
    pair = load_pair("toy", args.prompts) or random_pair(args.prompts)
    name, target, drafter, prompts, stops = pair.name, pair.target, pair.drafter, pair.prompts, pair.stops
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
                        (tree_mod, "_best_first_host"), (tree_mod, "best_first_tensors"),
                        (target_mod.TargetSession, "verify"), (target_mod.WalkRows, "argmax"),
                        (target_mod.WalkRows, "features"), (loop, "host_walk"),
                        (target_mod.TargetSession, "commit"), (gdn, "commit_linear_states"),
                        (diagnostics.RoundRecorder, "round"), (diagnostics.RoundRecorder, "finish")):
        if hasattr(owner, attr):  # a build this checkout lacks is simply not timed
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
    ms_round, setup_ms = 1e3 * decode / rounds, 1e3 * statistics.median(setup)
    print(f"# {name}, budget {args.budget}, {len(prompts)} prompts: {rounds} rounds, {ms_round:.2f} ms a round, "
          f"setup {setup_ms:.2f} ms a generation ({rounds / len(prompts):.2f} rounds a generation)")
    # the forwards: the drafter's, and the target's (its verification, then the walked rows' head and features)
    forwards = sum(spent[a] for a in ("verify", "draft_logits", "argmax", "features"))
    whole = decode + sum(setup)
    over_ms, with_setup, rounds_only = (1e3 * (decode - forwards) / rounds, 100 * (whole - forwards) / whole,
                                        100 * (decode - forwards) / decode)
    print(f"# overhead (outside the forwards): {over_ms:.2f} ms a round, {with_setup:.1f}% of the decode time with "
          f"each generation's setup ({rounds_only:.1f}% of the rounds alone)")
    rows = [[f"`{attr}`", round(1e3 * s / rounds, 3), round(calls[attr] / rounds, 2)]
            for attr, s in sorted(spent.items(), key=lambda kv: -kv[1])]
    print("| function | ms / round | calls / round |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]:.3f} | {r[2]:.2f} |")
    rec = Record("bench_overhead", "Where a DDTree round's time goes outside the forwards",
                 "Each engine function timed in place inside real generations (one `ddtree.Engine`), greedy DDTree. "
                 "Nested rows overlap: `_best_first_host` is inside `best_first_tree`, `commit_linear_states` inside "
                 "`commit`, `argmax` (the walk's asks) inside the walk; the commits include each generation's "
                 "chain-prefill commit, hence more than one call a round.", params=params(args, pair=name))
    rec.table("Summary", ["rounds", "ms / round", "setup ms / generation", "overhead ms / round",
                          "overhead % (with setup)", "overhead % (rounds alone)"],
              [[rounds, round(ms_round, 2), round(setup_ms, 2), round(over_ms, 2), round(with_setup, 1),
                round(rounds_only, 1)]], formats={"ms / round": "{:.2f}", "setup ms / generation": "{:.2f}",
                                                   "overhead ms / round": "{:.2f}", "overhead % (with setup)": "{:.1f}",
                                                   "overhead % (rounds alone)": "{:.1f}"})
    rec.table("Per function", ["function", "ms / round", "calls / round"], rows,
              formats={"ms / round": "{:.3f}", "calls / round": "{:.2f}"})
    rec.write(args.json)


def record_ab(args) -> None:
    """The diagnosis records' cost: passes over the prompts alternating record=True / record=False (one Engine each, as a
    job keeps), median decode ms a round of each; the machine's noise shows as the spread of the passes."""
    pair = load_pair("toy", args.prompts) or random_pair(args.prompts)
    name, target, drafter, prompts, stops = pair.name, pair.target, pair.drafter, pair.prompts, pair.stops
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
