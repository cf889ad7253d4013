"""Tree-build time per round: the C build (a CPU's default) and the torch build (every other device, and a CPU without
the extension), same run, with the torch build's dispatched op count.

    python bench/bench_tree.py [--device cpu] [--repeats 7] [--vocab 151936] [--budgets 16,64,256,1024] [--reference]
    python bench/bench_tree.py --pair toy [--prompts 24] [--budgets 16,64,256]

Logit block: 15 positions x --vocab (default a Qwen3 vocabulary; 1024 is the toy's), block size 16. Both builds start
from the same log-probabilities (log_softmax excluded) and return the tree with its ancestor index and matrix (what the
walk, the mask and GDN read). `torch ops`: aten ops the torch build dispatches (each a kernel launch on a GPU without
graphs, views aside); `reference` (--reference): the slow reference (ddtree.testing.reference.best_first_reference).
Every build's tree is checked equal to the others'.

--pair NAME (a shipped trained pair: toy, toy_pure): the drafter's own blocks instead, recorded from DDTree generations
on the first --prompts held-out prompts at each budget (a trained drafter is peaked, random logits are not), timed over
all recorded blocks (distinct data each call: a search repeated on one block trains the branch predictor), median of
--repeats sweeps. Writes docs/bench/bench_tree_v<vocab>.json (bench_tree_<pair>.json with --pair).
"""

from __future__ import annotations

import argparse
import sys

import torch
from _common import BENCH_DIR, Record, add_json_arg, device_sync, load_pair, params, timed

from ddtree.engine import tree as tree_mod
from ddtree.engine.tree import best_first_tree
from ddtree.testing.dispatch import DispatchCount
from ddtree.testing.reference import best_first_reference


def torch_ops(root, logp, budget: int) -> int:
    best_first_tree(root, logp, budget, host=False)  # the constants are built once per device
    with DispatchCount(stages=False) as ops:
        best_first_tree(root, logp, budget, host=False)
    return ops.total(ops.ops, exclude=())


def same(a, b) -> bool:
    return all(torch.equal(getattr(a, k).cpu(), getattr(b, k).cpu()) for k in ("tokens", "parents", "depths", "scores"))


def trained_blocks(args) -> None:
    """Both builds on a trained drafter's recorded blocks (see the module docstring)."""
    import ddtree
    import ddtree.engine.proposers as proposers

    pair = load_pair(args.pair, args.prompts)
    if pair is None:
        sys.exit(f"assets/{args.pair} is not built (make toy / make toy-pure)")
    has_c = tree_mod._hosttree is not None
    print(f"# tree build on {args.pair}'s drafter blocks ({args.prompts} prompts), median of {args.repeats}")
    print(f"{'budget':>7} {'blocks':>7} {'C ms':>7} {'torch ms':>9}")
    build = proposers.best_first_tree
    rows = []
    for b in map(int, args.budgets.split(",")):
        blocks = []

        def spy(root, logprobs, budget, blocks=blocks, **kw):
            blocks.append((root.clone(), logprobs.float().clone()))
            return build(root, logprobs, budget, **kw)

        proposers.best_first_tree = spy
        try:
            for ids in pair.prompts:
                ddtree.generate(pair.target, pair.drafter, ids, method="ddtree", budget=b, max_new_tokens=128,
                                stop_token_ids=pair.stops)
        finally:
            proposers.best_first_tree = build
        if has_c:
            assert all(same(best_first_tree(r, lp, b, host=False), best_first_tree(r, lp, b, host=True))
                       for r, lp in blocks)

        def sweep(host: bool, blocks=blocks, b=b) -> None:
            for root, logp in blocks:
                best_first_tree(root, logp, b, host=host)

        per_block = 1e3 / len(blocks)
        tc = timed(lambda: sweep(True), args.repeats).scaled(per_block) if has_c else None
        tt = timed(lambda: sweep(False), args.repeats).scaled(per_block)
        print(f"{b:>7} {len(blocks):>7} {tc.median if tc else float('nan'):>7.3f} {tt.median:>9.3f}")
        rows.append([b, len(blocks), tc.cell() if tc else None, tt.cell()])
    rec = Record("bench_tree", f"Tree build on the {args.pair} drafter's own blocks",
                 "ms per block (with the tree's ancestor index and matrix), distinct blocks each call (recorded from "
                 "DDTree generations), median of the sweeps: C = the CPU default (one C call), torch = the build of "
                 "every other device (and of a CPU without the extension). Both give the same trees (checked).",
                 params=params(args))
    rec.table(f"{args.pair}, ms per block", ["budget", "blocks", "C", "torch"], rows,
              formats={c: "{:.3f}" for c in ("C", "torch")})
    rec.write(BENCH_DIR / f"bench_tree_{args.pair}.json" if args.json == _DEFAULT_JSON else args.json)


_DEFAULT_JSON = str(BENCH_DIR / "bench_tree.json")  # replaced by a name per block kind (vocabulary or pair)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--budgets", default="16,64,256,1024")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reference", action="store_true", help="time the slow reference too")
    ap.add_argument("--pair", default=None, help="a trained pair's recorded drafter blocks (toy, toy_pure)")
    ap.add_argument("--prompts", type=int, default=24)
    add_json_arg(ap, "bench_tree")
    args = ap.parse_args()
    if args.pair:
        return trained_blocks(args)
    dev = torch.device(args.device)
    sync = device_sync(dev)
    torch.manual_seed(0)
    logp = torch.log_softmax(torch.randn(15, args.vocab, device=dev) * 4, dim=-1)
    root = torch.tensor(0, device=dev)
    has_c = tree_mod._hosttree is not None
    print(f"# tree build, 15 x {args.vocab} logits, {dev}, median of {args.repeats}")
    print(f"{'budget':>7} {'C ms':>7} {'torch ms':>9} {'torch ops':>10} {'ref ms':>8}")
    rows = []
    for b in map(int, args.budgets.split(",")):
        want = best_first_tree(root, logp, b, host=False)
        tt = timed(lambda b=b: best_first_tree(root, logp, b, host=False), args.repeats, sync=sync).scaled(1e3)
        tc = tr = None
        if has_c:
            assert same(want, best_first_tree(root, logp, b, host=True))
            tc = timed(lambda b=b: best_first_tree(root, logp, b, host=True), args.repeats, sync=sync).scaled(1e3)
        if args.reference:
            assert same(want, best_first_reference(0, logp, b))
            tr = timed(lambda b=b: best_first_reference(0, logp, b), max(1, args.repeats // 3), sync=sync).scaled(1e3)
        ops = torch_ops(root, logp, b)
        nan = float("nan")
        print(f"{b:>7} {tc.median if tc else nan:>7.3f} {tt.median:>9.3f} {ops:>10} {tr.median if tr else nan:>8.1f}")
        rows.append([b, tc.cell() if tc else None, tt.cell(), ops, tr.cell() if tr else None])
    rec = Record("bench_tree", f"Tree build per round, 15 x {args.vocab} logit block",
                 "ms per build (with the tree's ancestor index and matrix), one block timed again and again: C = the "
                 "CPU default (one C call reading each row's ranks as the search reaches them), torch = the build of "
                 "every other device (a fixed op sequence: a top-k over each row's keys, three ops a depth), with the "
                 "aten ops it dispatches; reference = the tests' slow Python heap. All give the same trees (checked).",
                 params=params(args))
    rec.table(f"15 x {args.vocab}, {dev}, ms", ["budget", "C", "torch", "torch ops", "reference"], rows,
              formats={"C": "{:.3f}", "torch": "{:.2f}", "reference": "{:.1f}"})
    rec.write(BENCH_DIR / f"bench_tree_v{args.vocab}.json" if args.json == _DEFAULT_JSON else args.json)


if __name__ == "__main__":
    main()
