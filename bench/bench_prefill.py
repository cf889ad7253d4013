"""Prefill of a hybrid target on the CPU: one committed chain through the tree-exact GDN vs the plain model call.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_prefill.py [--lengths 16,32,64,96,128,192] [--repeats 7]

The shipped toy target (assets/toy: hybrid Qwen3.5, 6 x 192) when present, else a tiny random hybrid. Both
paths run in one process, alternating per repeat; ms is the median per prefill. `TargetSession.prefill` takes
the chain path up to `CHAIN_PREFILL_MAX` tokens: this table is where that bound comes from.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from ddtree.engine import target as target_mod  # noqa: E402
from ddtree.engine.target import TargetSession  # noqa: E402


def load_target():
    toy = ROOT / "assets" / "toy" / "target"
    if (toy / "config.json").exists():
        from transformers import AutoModelForCausalLM

        return "assets/toy", AutoModelForCausalLM.from_pretrained(toy, dtype=torch.float32).eval()
    from ddtree.testing.tiny import tiny_model

    return "tiny random qwen3_5_text", tiny_model("qwen3_5_text", vocab_size=1024, attn_implementation="sdpa")


def prefill_ms(model, ids: torch.Tensor, chain: bool) -> float:
    target_mod.CHAIN_PREFILL_MAX, saved = (10 ** 9 if chain else 0), target_mod.CHAIN_PREFILL_MAX
    try:
        session = TargetSession(model, [1, 3], capacity=ids.shape[1] + 8)
        t0 = time.perf_counter()
        session.prefill(ids)
        return (time.perf_counter() - t0) * 1e3
    finally:
        target_mod.CHAIN_PREFILL_MAX = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="16,32,64,96,128,192")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    name, model = load_target()
    vocab = model.config.get_text_config().vocab_size
    print(f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); target: {name}; median of {args.repeats}, alternating\n")
    print("| prompt tokens | chain ms | plain ms | plain / chain |\n| --- | --- | --- | --- |")
    for n in (int(x) for x in args.lengths.split(",")):
        ids = torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(n))
        prefill_ms(model, ids, True), prefill_ms(model, ids, False)  # warm-up
        times = {True: [], False: []}
        for r in range(args.repeats):
            for chain in ((True, False) if r % 2 else (False, True)):
                times[chain].append(prefill_ms(model, ids, chain))
        c, p = statistics.median(times[True]), statistics.median(times[False])
        print(f"| {n} | {c:.1f} | {p:.1f} | {p / c:.2f}x |")


if __name__ == "__main__":
    main()
