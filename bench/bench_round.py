"""Per-round overhead of DDTree (everything but the target and drafter forwards), and verification memory.

    OMP_NUM_THREADS=1 python bench/bench_round.py [--budgets 16,64,256,1024] [--modes split,dense]
        [--prompt 64] [--new 48] [--repeats 3] [--mem-prefix 8192,16384] [--mem-budget 1024]

Part 1, per round, median over --repeats generations of --new tokens on a tiny random Qwen3 (hidden 256,
6 layers, vocab 2048) with a random DFlash drafter (block 16; acceptance is meaningless, costs are not):
  target   wall time inside the target's forward calls (TargetSession._forward),
  drafter  the engine's "draft" stage (drafter forward + lm_head),
  overhead the rest of the round: tree building, masks, walk, cache commit, Python bookkeeping.
Modes: split (ddtree.engine.attention, no dense mask) and dense (a 4-D additive mask over past + tree).

Part 2 (--mem-prefix; empty to skip), one verification of a --mem-budget tree after a --mem-prefix prefill: the
peak bytes the CPU allocator held during that forward above what it held before it (torch.profiler memory events),
and the bytes of the tree mask the verification builds (dense: [n, past + n]; split: [g*n, n + band]).
Writes docs/bench/bench_round.json.
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import Record, Spread, add_json_arg, params

import ddtree
from ddtree.engine.drafter import DFlashDrafter
from ddtree.engine.target import TargetSession
from ddtree.engine.tree import best_first_tree
from ddtree.tiny import tiny_model


class ForwardClock:
    """Wall seconds spent inside the target's forward calls (every forward of a session goes through
    TargetSession._forward; the lean forward calls no model, so a forward hook would see nothing)."""

    def __init__(self):
        self.calls: list[float] = []
        inner = TargetSession._forward

        def timed(sess, *a, **kw):
            t = time.perf_counter()
            try:
                return inner(sess, *a, **kw)
            finally:
                self.calls.append(time.perf_counter() - t)

        TargetSession._forward = timed


def models():
    target = tiny_model("qwen3", seed=0, attn_implementation="sdpa", vocab_size=2048, hidden_size=256,
                        intermediate_size=768, num_hidden_layers=6, max_position_embeddings=20000)
    drafter = DFlashDrafter.random_for_target(target.config, block_size=16)
    return target, drafter


def one(args, target, drafter, clock, ids, budget, mode):
    clock.calls = []
    r = ddtree.generate(target, drafter, ids, method="ddtree", budget=budget, max_new_tokens=args.new,
                        sync_timing=False, tree_attention=mode)
    rounds = max(1, r.rounds)
    assert len(clock.calls) == rounds + 1, "one prefill, then one target forward per round"
    return {"round": r.decode_s / rounds, "target": sum(clock.calls[1:]) / rounds,
            "drafter": r.stage_seconds["draft"] / rounds}


def part1(args, rec, target, drafter):
    clock = ForwardClock()
    ids = torch.randint(0, 2048, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    print(f"# per round: tiny qwen3 (6x256, vocab 2048) + random drafter (block 16), prompt {args.prompt}, "
          f"{args.new} new tokens, median of {args.repeats}")
    print(f"{'mode':>14} {'budget':>6} {'ms/round':>9} {'target':>8} {'drafter':>8} {'overhead':>9} {'share':>6}")
    rows = []
    for budget in (int(b) for b in args.budgets.split(",")):
        for mode in args.modes.split(","):
            one(args, target, drafter, clock, ids, budget, mode)  # warm-up
            runs = [one(args, target, drafter, clock, ids, budget, mode) for _ in range(args.repeats)]
            over = Spread.of([1e3 * (r["round"] - r["target"] - r["drafter"]) for r in runs])
            med = {k: Spread.of([1e3 * r[k] for r in runs]) for k in ("round", "target", "drafter")}
            share = 100 * over.median / med["round"].median
            print(f"{mode:>14} {budget:>6} {med['round'].median:9.2f} {med['target'].median:8.2f} "
                  f"{med['drafter'].median:8.2f} {over.median:9.2f} {share:5.1f}%")
            rows.append([mode, budget, med["round"].cell(2), med["target"].cell(2), med["drafter"].cell(2),
                         over.cell(2), round(share, 1)])
    rec.table(f"Per round, prompt {args.prompt}, ms", ["mode", "budget", "round", "target", "drafter", "overhead",
                                                       "overhead %"], rows,
              formats={c: "{:.2f}" for c in ("round", "target", "drafter", "overhead")} | {"overhead %": "{:.1f}"})


def peak_bytes_during(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


def part2(args, rec, target):
    n = args.mem_budget + 1
    logp = torch.log_softmax(torch.randn(16, 2048, generator=torch.Generator().manual_seed(1)) * 3, dim=-1)
    tree = best_first_tree(torch.tensor(5), logp, args.mem_budget)
    cfg = target.config
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    print(f"\n# one verification of a {n}-token tree (budget {args.mem_budget}) after a long prefill; "
          f"peak CPU-allocator bytes during the verify forward (torch.profiler), fp32")
    print(f"{'prefix':>7} {'mode':>14} {'peak MiB':>9} {'mask MiB':>9}")
    rows = []
    for past in (int(p) for p in args.mem_prefix.split(",")):
        ids = torch.randint(0, 2048, (1, past), generator=torch.Generator().manual_seed(2))
        for mode in args.modes.split(","):
            sess = TargetSession(target, tree_attention=mode)
            sess.prefill(ids)
            peak = peak_bytes_during(lambda s=sess: s.verify(tree)) / 2**20
            mask = (n * (past + n) * 4 if mode == "dense" else g * n * n * 4) / 2**20  # sliding band: 0 here
            print(f"{past:>7} {mode:>14} {peak:9.1f} {mask:9.1f}")
            rows.append([past, mode, round(peak, 1), round(mask, 1)])
            del sess
    rec.table(f"Verification memory, a {n}-token tree, fp32", ["prefix", "mode", "peak MiB", "mask MiB"], rows,
              formats={"peak MiB": "{:.1f}", "mask MiB": "{:.1f}"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--budgets", default="16,32,64,128,256,512,1024")
    ap.add_argument("--modes", default="split,dense")
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--mem-prefix", default="8192,16384")
    ap.add_argument("--mem-budget", type=int, default=1024)
    add_json_arg(ap, "bench_round")
    args = ap.parse_args()
    torch.manual_seed(0)
    target, drafter = models()
    rec = Record("bench_round", "DDTree round overhead and verification memory, split vs dense tree attention",
                 "A tiny random Qwen3 (6 x 256, vocab 2048) and a random drafter (block 16): overhead = a round minus "
                 "the target forward and the drafter stage.", params=params(args))
    if args.budgets:
        part1(args, rec, target, drafter)
    if args.mem_prefix:
        part2(args, rec, target)
    rec.write(args.json)


if __name__ == "__main__":
    main()
