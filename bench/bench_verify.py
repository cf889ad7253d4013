"""One tree verification of a trained toy target, timed alone (ms, median), under this process's allocator.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_verify.py [--pair toy] [--budgets 64,256] [--repeats 40]
    DDTREE_HOST_MALLOC=0 OMP_NUM_THREADS=1 .venv/bin/python bench/bench_verify.py ...   # glibc's defaults

A 120-token random prompt is prefilled, then each repeat verifies the same best-first tree (a fixed random
drafter block) with the head on the walked rows only and commits its root, so the context grows by one per
repeat. The allocator setting (ddtree.engine.host) is process-wide, so compare two processes, one with
DDTREE_HOST_MALLOC=0; run them alternately, more than once, on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from ddtree.engine import host  # noqa: E402
from ddtree.engine.target import TargetSession  # noqa: E402
from ddtree.engine.tree import best_first_tree  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pair", default="toy")
    ap.add_argument("--budgets", default="64,256")
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    path = ROOT / "assets" / args.pair / "target"
    if not (path / "config.json").exists():
        sys.exit(f"assets/{args.pair} is missing (make toy / make toy-pure)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = model.config.get_text_config().vocab_size
    block = torch.log_softmax(torch.randn(15, vocab, generator=torch.Generator().manual_seed(1)) * 10, dim=-1)
    ids = torch.randint(0, vocab, (1, 120), generator=torch.Generator().manual_seed(2))
    for budget in (int(b) for b in args.budgets.split(",")):
        tree = best_first_tree(torch.tensor(5), block, budget)
        session = TargetSession(model, capacity=120 + args.repeats + 8 + len(tree))
        session.prefill(ids)
        times = []
        for _ in range(args.repeats + 3):
            t = time.perf_counter()
            rows, _ = session.verify(tree, head=False)
            rows.argmax([0])
            times.append(time.perf_counter() - t)
            session.commit(tree, torch.tensor([0]))
        print(f"{args.pair} budget {budget} ({len(tree)} nodes): verify {1e3 * statistics.median(times[3:]):.2f} ms "
              f"(median of {args.repeats}); host allocator: {host.tune_host_allocator()}", flush=True)


if __name__ == "__main__":
    main()
