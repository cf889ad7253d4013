"""Tree-build time per round: vectorized best_first_tree vs the plain best-first heap, same run.

    .venv/bin/python bench/bench_tree.py [--device cpu] [--repeats 7]

Logit block: 15 positions x 151,936 (a Qwen3 vocabulary, block size 16). Both builders start
from the same log-probabilities; times are the median of --repeats runs (log_softmax excluded).
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
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    logp = torch.log_softmax(torch.randn(15, 151936, device=dev) * 4, dim=-1)
    root = torch.tensor(0, device=dev)
    print(f"# tree build, 15 x 151936 logits, {dev}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats}")
    print(f"{'budget':>7} {'vectorized ms':>14} {'heap ms':>9} {'ratio':>6}")
    for b in map(int, args.budgets.split(",")):
        tv = timed(lambda b=b: best_first_tree(root, logp, b), args.repeats, sync)
        th = timed(lambda b=b: heap_best_first(logp, b), args.repeats, sync)
        print(f"{b:>7} {tv * 1e3:>14.2f} {th * 1e3:>9.2f} {th / tv:>6.1f}")


if __name__ == "__main__":
    main()
