"""Tree-build time per round: the C build (a CPU's default) and the torch build (every other device, and a CPU without
the extension), same run, with the torch build's dispatched op count.

    .venv/bin/python bench/bench_tree.py [--device cpu] [--repeats 7] [--vocab 151936] [--budgets 16,64,256,1024]
    .venv/bin/python bench/bench_tree.py --pair toy [--prompts 24] [--budgets 16,64,256]

Logit block: 15 positions x --vocab (default a Qwen3 vocabulary; 1024 is the toy's), block size 16. Both builds start
from the same log-probabilities (log_softmax excluded) and return the tree with its ancestor index and matrix (what the
walk, the mask and GDN read); times are medians of --repeats runs. `ops`: aten ops the torch build dispatches (each a
kernel launch on a GPU without graphs, views aside); `ref ms` (--reference): the slow reference
(ddtree.testing.reference.best_first_reference), which both builds equal (checked).

--pair NAME (a shipped trained pair: toy, toy_pure): the drafter's own blocks instead, recorded from DDTree generations
on the first --prompts held-out prompts at each budget (a trained drafter is peaked, random logits are not), timed over
all recorded blocks (distinct data each call: a search repeated on one block trains the branch predictor), median of
--repeats sweeps; the two builds' trees are checked equal.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddtree.engine import tree as tree_mod  # noqa: E402
from ddtree.engine.tree import best_first_tree  # noqa: E402
from ddtree.testing.reference import best_first_reference  # noqa: E402


def timed(fn, repeats: int, sync) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def torch_ops(root, logp, budget: int) -> int:
    with CountOps() as ops:
        best_first_tree(root, logp, budget, host=False)
    return ops.n


def same(a, b) -> bool:
    return all(torch.equal(getattr(a, k).cpu(), getattr(b, k).cpu()) for k in ("tokens", "parents", "depths", "scores"))


def header(what: str, repeats: int) -> None:
    print(f"# {what}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} thread(s), median of {repeats}; C build {'compiled' if tree_mod._hosttree else 'absent'}")


def trained_blocks(args) -> None:
    """Both builds on a trained drafter's recorded blocks (see the module docstring)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_engines import trained_pair

    import ddtree
    import ddtree.engine.proposers as proposers

    pair = trained_pair(args.pair, args.prompts, "cpu", torch.float32)
    if pair is None:
        sys.exit(f"assets/{args.pair} is not built (make toy / make toy-pure)")
    header(f"tree build on {args.pair}'s drafter blocks ({args.prompts} prompts)", args.repeats)
    print(f"{'budget':>7} {'blocks':>7} {'C ms':>7} {'torch ms':>9} {'torch/C':>8}")
    build = proposers.best_first_tree
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
        for root, logp in blocks:
            assert same(best_first_tree(root, logp, b, host=False), best_first_tree(root, logp, b, host=True))

        def sweep(host: bool, blocks=blocks, b=b) -> None:
            for root, logp in blocks:
                best_first_tree(root, logp, b, host=host)

        tc = timed(lambda: sweep(True), args.repeats, lambda: None) / len(blocks) * 1e3
        tt = timed(lambda: sweep(False), args.repeats, lambda: None) / len(blocks) * 1e3
        print(f"{b:>7} {len(blocks):>7} {tc:>7.3f} {tt:>9.3f} {tt / tc:>8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--budgets", default="16,64,256,1024")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--reference", action="store_true", help="time the slow reference too")
    ap.add_argument("--pair", default=None, help="a trained pair's recorded drafter blocks (toy, toy_pure)")
    ap.add_argument("--prompts", type=int, default=24)
    args = ap.parse_args()
    if args.pair:
        return trained_blocks(args)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    logp = torch.log_softmax(torch.randn(15, args.vocab, device=dev) * 4, dim=-1)
    root = torch.tensor(0, device=dev)
    header(f"tree build, 15 x {args.vocab} logits, {dev}", args.repeats)
    print(f"{'budget':>7} {'C ms':>7} {'torch ms':>9} {'torch ops':>10} {'ref ms':>8}")
    for b in map(int, args.budgets.split(",")):
        torch_tree = best_first_tree(root, logp, b, host=False)
        tt = timed(lambda b=b: best_first_tree(root, logp, b, host=False), args.repeats, sync)
        tc = float("nan")
        if tree_mod._hosttree is not None:
            assert same(torch_tree, best_first_tree(root, logp, b, host=True))
            tc = timed(lambda b=b: best_first_tree(root, logp, b, host=True), args.repeats, sync)
        tr = float("nan")
        if args.reference:
            assert same(torch_tree, best_first_reference(0, logp, b))
            tr = timed(lambda b=b: best_first_reference(0, logp, b), max(1, args.repeats // 3), sync)
        print(f"{b:>7} {tc * 1e3:>7.3f} {tt * 1e3:>9.3f} {torch_ops(root, logp, b):>10} {tr * 1e3:>8.1f}")


if __name__ == "__main__":
    main()
