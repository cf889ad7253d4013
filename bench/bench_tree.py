"""Tree-build time per round: best_first_tree (host NumPy build and torch device build) vs the plain
best-first heap, same run.

    .venv/bin/python bench/bench_tree.py [--device cpu] [--repeats 7] [--vocab 151936]

Logit block: 15 positions x --vocab (default a Qwen3 vocabulary; 1024 is the toy's), block size 16. All
builders start from the same log-probabilities; times are the median of --repeats runs (log_softmax
excluded), each with the tree's ancestor index and matrix (what the walk, the mask and GDN read).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ddtree.engine.tree import best_first_tree  # noqa: E402
from ddtree.testing.reference import heap_best_first  # noqa: E402


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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--budgets", default="16,32,64,128,256,512,1024")
    ap.add_argument("--vocab", type=int, default=151936)
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    logp = torch.log_softmax(torch.randn(15, args.vocab, device=dev) * 4, dim=-1)
    root = torch.tensor(0, device=dev)
    print(f"# tree build, 15 x {args.vocab} logits, {dev}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    def build(b: int, host: bool):
        tree = best_first_tree(root, logp, b, host=host)
        tree.ancestor_index(), tree.ancestor_matrix()

    print(f"{'budget':>7} {'host ms':>8} {'device ms':>10} {'heap ms':>9} {'heap/host':>10}")
    for b in map(int, args.budgets.split(",")):
        th = timed(lambda b=b: build(b, True), args.repeats, sync)
        td = timed(lambda b=b: build(b, False), args.repeats, sync)
        tp = timed(lambda b=b: heap_best_first(logp, b), args.repeats, sync)
        print(f"{b:>7} {th * 1e3:>8.2f} {td * 1e3:>10.2f} {tp * 1e3:>9.2f} {tp / th:>10.1f}")


if __name__ == "__main__":
    main()
