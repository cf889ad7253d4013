"""Per-round overhead of DDTree (everything but the target and drafter forwards), and verification memory.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_round.py [--budgets 16,64,256,1024] [--modes split,dense]
        [--new 48] [--repeats 3] [--mem-prefix 8192,16384] [--mem-budget 1024] [--code DIR]

Part 1, per round, median over --repeats generations of --new tokens on a tiny random Qwen3 (hidden 256,
6 layers, vocab 2048) with a random DFlash drafter (block 16; acceptance is meaningless, costs are not):
  target   wall time inside the target's forward calls (TargetSession._forward; forward hooks for --code),
  drafter  the engine's "draft" stage (drafter forward + lm_head),
  overhead the rest of the round: tree building, masks, walk, cache commit, Python bookkeeping.
Modes: split (ddtree.engine.attention, no dense mask) and dense (a 4-D additive mask over past + tree).
--code DIR imports ddtree from DIR instead (e.g. an export of the commit before this work:
`git archive 39ced50 ddtree | tar -x -C /tmp/before`), which knows only the dense mask ("before").

Part 2, one verification of a --mem-budget tree after a --mem-prefix prefill: the peak bytes the CPU
allocator held during that forward above what it held before it (torch.profiler memory events), and
the bytes of the tree mask the verification builds (dense: [n, past + n]; split: [g*n, n + band]).
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--budgets", default="16,32,64,128,256,512,1024")
ap.add_argument("--modes", default="split,dense")
ap.add_argument("--new", type=int, default=48)
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--prompt", type=int, default=64)
ap.add_argument("--mem-prefix", default="8192,16384")
ap.add_argument("--mem-budget", type=int, default=1024)
ap.add_argument("--code", default=None, help="import ddtree from this directory (a 'before' export)")
args = ap.parse_args()
sys.path.insert(0, str(Path(args.code).resolve() if args.code else Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import ddtree  # noqa: E402
from ddtree.engine.drafter import DFlashDrafter  # noqa: E402
from ddtree.engine.target import TargetSession  # noqa: E402
from ddtree.engine.tree import best_first_tree  # noqa: E402
from ddtree.testing.tiny import tiny_model  # noqa: E402

HAS_MODES = "tree_attention" in inspect.signature(ddtree.generate).parameters


class ForwardClock:
    """Wall seconds spent inside the target's forward calls.

    The engine's lean forward drives the model's modules without calling the model, so a forward hook on
    it sees nothing: where TargetSession has `_forward` (every target forward of a session goes through it),
    that is what is timed; older code (--code) is timed by hooks on the model."""

    def __init__(self, module):
        self.calls, self._t = [], None
        session = getattr(TargetSession, "_forward", None)
        if session is None:
            module.register_forward_pre_hook(self._pre)
            module.register_forward_hook(self._post)
            return

        def timed(sess, *a, **kw):
            self._pre()
            try:
                return session(sess, *a, **kw)
            finally:
                self._post()

        TargetSession._forward = timed

    def _pre(self, *_):
        self._t = time.perf_counter()

    def _post(self, *_):
        self.calls.append(time.perf_counter() - self._t)


def models():
    target = tiny_model("qwen3", seed=0, attn_implementation="sdpa", vocab_size=2048, hidden_size=256,
                        intermediate_size=768, num_hidden_layers=6, max_position_embeddings=20000)
    drafter = DFlashDrafter.random_for_target(target.config, block_size=16)
    return target, drafter


def one(target, drafter, clock, ids, budget, mode):
    kw = {"tree_attention": mode} if HAS_MODES else {}
    clock.calls = []
    r = ddtree.generate(target, drafter, ids, method="ddtree", budget=budget, max_new_tokens=args.new,
                        sync_timing=False, **kw)
    rounds = max(1, r.rounds)
    assert len(clock.calls) == rounds + 1, "one prefill, then one target forward per round"
    return {"round": r.decode_s / rounds, "target": sum(clock.calls[1:]) / rounds,
            "drafter": r.stage_seconds["draft"] / rounds}


def part1(target, drafter):
    clock = ForwardClock(target)
    ids = torch.randint(0, 2048, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    modes = args.modes.split(",") if HAS_MODES else ["dense(before)"]
    print(f"# per round: tiny qwen3 (6x256, vocab 2048) + random drafter (block 16), prompt {args.prompt}, "
          f"{args.new} new tokens, median of {args.repeats}, {torch.get_num_threads()} thread(s), code: "
          f"{args.code or 'this tree'}")
    print(f"{'mode':>14} {'budget':>6} {'ms/round':>9} {'target':>8} {'drafter':>8} {'overhead':>9} {'share':>6}")
    for budget in (int(b) for b in args.budgets.split(",")):
        for mode in modes:
            one(target, drafter, clock, ids, budget, mode.split("(")[0])  # warm-up
            runs = [one(target, drafter, clock, ids, budget, mode.split("(")[0]) for _ in range(args.repeats)]
            med = {k: statistics.median(r[k] for r in runs) for k in ("round", "target", "drafter")}
            over = med["round"] - med["target"] - med["drafter"]
            print(f"{mode:>14} {budget:>6} {1e3 * med['round']:9.2f} {1e3 * med['target']:8.2f} "
                  f"{1e3 * med['drafter']:8.2f} {1e3 * over:9.2f} {100 * over / med['round']:5.1f}%")


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


def part2(target):
    n = args.mem_budget + 1
    logp = torch.log_softmax(torch.randn(16, 2048, generator=torch.Generator().manual_seed(1)) * 3, dim=-1)
    tree = best_first_tree(torch.tensor(5), logp, args.mem_budget)
    cfg = target.config
    g = cfg.num_attention_heads // cfg.num_key_value_heads
    print(f"\n# one verification of a {n}-token tree (budget {args.mem_budget}) after a long prefill; "
          f"peak CPU-allocator bytes during the verify forward (torch.profiler), fp32")
    print(f"{'prefix':>7} {'mode':>14} {'peak MiB':>9} {'mask MiB':>9}")
    modes = args.modes.split(",") if HAS_MODES else ["dense"]
    for past in (int(p) for p in args.mem_prefix.split(",")):
        ids = torch.randint(0, 2048, (1, past), generator=torch.Generator().manual_seed(2))
        for mode in modes:
            sess = TargetSession(target, tree_attention=mode) if HAS_MODES else TargetSession(target)
            sess.prefill(ids)
            peak = peak_bytes_during(lambda s=sess: s.verify(tree))
            mask = n * (past + n) * 4 if mode == "dense" else g * n * n * 4  # sliding band: 0 here
            label = mode if HAS_MODES else "dense(before)"
            print(f"{past:>7} {label:>14} {peak / 2**20:9.1f} {mask / 2**20:9.1f}")
            del sess


def main() -> None:
    torch.manual_seed(0)
    target, drafter = models()
    if args.budgets:
        part1(target, drafter)
    if args.mem_prefix:
        part2(target)


if __name__ == "__main__":
    main()
