"""Tree-build time per round: best_first_tree (host NumPy build and torch device build) vs the plain
best-first heap, same run.

    python bench/bench_tree.py [--device cpu] [--repeats 7] [--vocab 151936]
    python bench/bench_tree.py --pair toy [--prompts 24] [--budgets 16,64,256]

Logit block: 15 positions x --vocab (default a Qwen3 vocabulary; 1024 is the toy's), block size 16. All
builders start from the same log-probabilities; times are the median of --repeats runs (log_softmax
excluded), each with the tree's ancestor index and matrix (what the walk, the mask and GDN read).

--pair NAME (a shipped trained pair: toy, toy_pure): the drafter's own blocks instead, recorded from DDTree
generations on the first --prompts held-out prompts at each budget (a trained drafter is peaked, random
logits are not): torch.topk alone, the C build from the log-probabilities (`_best_first_rows`, its own ranks: no
topk), and from topk's lists the C build (`_best_first_native`), the best-first heap (`_best_first_heap`) and the
per-depth passes with and without pruning (`_best_first_host(prune=)`), timed over all recorded blocks (distinct
data each call: a selection repeated on one block trains the branch predictor and reads 3x fast), median of
--repeats sweeps; the trees are checked equal. Writes docs/bench/bench_tree.json (bench_tree_<pair>.json with --pair).
"""

from __future__ import annotations

import argparse
import sys

import torch
from _common import BENCH_DIR, Record, add_json_arg, device_sync, load_pair, params, timed

from ddtree.engine.tree import best_first_tree
from ddtree.testing.reference import heap_best_first


def trained_blocks(args) -> None:
    """Host build with and without pruning on a trained drafter's recorded blocks (see the module docstring)."""
    import ddtree
    import ddtree.engine.proposers as proposers
    from ddtree.engine.tree import (
        _best_first_heap,
        _best_first_host,
        _best_first_native,
        _best_first_rows,
        _hosttree,
    )

    pair = load_pair(args.pair, args.prompts)
    if pair is None:
        sys.exit(f"assets/{args.pair} is not built (make toy / make toy-pure)")
    print(f"# host tree build on {args.pair}'s drafter blocks ({args.prompts} prompts), median of {args.repeats}")
    print("# columns after topk: from its lists; C rows: from the log-probabilities, its own ranks (topk not needed)")
    print(f"{'budget':>7} {'blocks':>7} {'topk ms':>8} {'C rows ms':>10} {'C ms':>7} {'heap ms':>8} {'pruned ms':>10} "
          f"{'unpruned ms':>12}")
    build = proposers.best_first_tree
    rows = []
    for b in map(int, args.budgets.split(",")):
        blocks, logps = [], []

        def spy(root, logprobs, budget, blocks=blocks, logps=logps, **kw):
            blocks.append((root.clone(), *logprobs.float().topk(min(budget, logprobs.shape[1]), dim=-1)))
            logps.append(logprobs.float().clone())
            return build(root, logprobs, budget, **kw)

        proposers.best_first_tree = spy
        try:
            for ids in pair.prompts:
                ddtree.generate(pair.target, pair.drafter, ids, method="ddtree", budget=b, max_new_tokens=128,
                                stop_token_ids=pair.stops)
        finally:
            proposers.best_first_tree = build
        builds = {"C": _best_first_native, "heap": _best_first_heap, "pruned": _best_first_host,
                  "unpruned": lambda *a: _best_first_host(*a, prune=False)}
        if _hosttree is None:
            del builds["C"]
        for (root, vals, toks), logp in zip(blocks, logps, strict=True):
            trees = [fn(root, vals, toks, b) for fn in builds.values()]
            if _hosttree is not None:
                trees.append(_best_first_rows(root, logp, b) or trees[0])  # (None: a tie read; topk's order then)
            assert all(torch.equal(t.parents, trees[0].parents) and torch.equal(t.tokens, trees[0].tokens)
                       for t in trees)

        def sweep(fn, blocks=blocks, b=b) -> None:
            for root, vals, toks in blocks:
                fn(root, vals, toks, b)

        per_block = 1e3 / len(blocks)
        ms = {name: timed(lambda fn=fn: sweep(fn), args.repeats).scaled(per_block) for name, fn in builds.items()}
        ms["topk"] = timed(lambda logps=logps, b=b: [lp.topk(min(b, lp.shape[1]), dim=-1) for lp in logps],
                           args.repeats).scaled(per_block)
        if _hosttree is not None:
            ms["C rows"] = timed(lambda logps=logps, blocks=blocks, b=b: [
                _best_first_rows(x[0], lp, b) for x, lp in zip(blocks, logps, strict=True)],
                args.repeats).scaled(per_block)
        nan = float("nan")
        med = {k: v.median for k, v in ms.items()}
        print(f"{b:>7} {len(blocks):>7} {med['topk']:>8.3f} {med.get('C rows', nan):>10.3f} {med.get('C', nan):>7.3f} "
              f"{med['heap']:>8.3f} {med['pruned']:>10.3f} {med['unpruned']:>12.3f}")
        rows.append([b, len(blocks)] + [ms[k].cell() if k in ms else None
                                        for k in ("topk", "C rows", "C", "heap", "pruned", "unpruned")])
    rec = Record(f"bench_tree_{args.pair}", f"Host tree build on the {args.pair} drafter's own blocks",
                 "ms per block, distinct blocks each call (recorded from DDTree generations), median of the sweeps. "
                 "torch.topk is what every column but `C rows` needs on top; `C rows` is the C build reading its "
                 "own ranks from the log-probabilities.", params=params(args))
    rec.table(f"{args.pair}, ms per block", ["budget", "blocks", "torch.topk alone", "C rows", "C from topk",
                                             "heap (Python)", "per-depth, pruned", "per-depth, unpruned"], rows,
              formats={c: "{:.3f}" for c in ("torch.topk alone", "C rows", "C from topk", "heap (Python)",
                                             "per-depth, pruned", "per-depth, unpruned")})
    rec.write(BENCH_DIR / f"bench_tree_{args.pair}.json" if args.json == _DEFAULT_JSON else args.json)


_DEFAULT_JSON = str(BENCH_DIR / "bench_tree.json")  # replaced by a name per block kind (vocabulary or pair)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--budgets", default="16,32,64,128,256,512,1024")
    ap.add_argument("--vocab", type=int, default=151936)
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
    print(f"# tree build, 15 x {args.vocab} logits, {dev}, median of {args.repeats}")

    def build(b: int, host: bool):
        tree = best_first_tree(root, logp, b, host=host)
        tree.ancestor_index(), tree.ancestor_matrix()

    print(f"{'budget':>7} {'host ms':>8} {'device ms':>10} {'heap ms':>9} {'heap/host':>10}")
    rows = []
    for b in map(int, args.budgets.split(",")):
        th = timed(lambda b=b: build(b, True), args.repeats, sync=sync).scaled(1e3)
        td = timed(lambda b=b: build(b, False), args.repeats, sync=sync).scaled(1e3)
        tp = timed(lambda b=b: heap_best_first(logp, b), args.repeats, sync=sync).scaled(1e3)
        print(f"{b:>7} {th.median:>8.2f} {td.median:>10.2f} {tp.median:>9.2f} {tp.median / th.median:>10.1f}")
        rows.append([b, th.cell(), td.cell(), tp.cell()])
    rec = Record(f"bench_tree_v{args.vocab}", f"Tree build per round, 15 x {args.vocab} logit block",
                 "ms per build (with the tree's ancestor index and matrix), one block timed again and again: host = "
                 "the CPU default (the C build reading its own ranks), device = torch ops, reference heap = the "
                 "tests' plain heap (it and the device build pay a top-k over the rows).", params=params(args))
    rec.table(f"15 x {args.vocab}, {dev}, ms", ["budget", "host", "device", "reference heap"], rows,
              formats={c: "{:.2f}" for c in ("host", "device", "reference heap")})
    rec.write(BENCH_DIR / f"bench_tree_v{args.vocab}.json" if args.json == _DEFAULT_JSON else args.json)


if __name__ == "__main__":
    main()
