"""Per-stage breakdown of generations (draft, tree, verify, commit) on a tiny model.

    .venv/bin/python bench/bench_stages.py [--budgets 16,64,256,1024] [--repeats 3] [--new 64]

Uses the shipped toy pair (assets/toy) when present, else a tiny random Qwen3 and a random
drafter (whose acceptance is meaningless; the stage costs are not). Median over --repeats.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

import ddtree
from ddtree.drafter import DFlashDrafter
from ddtree.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]


def load_pair():
    toy = ROOT / "assets" / "toy"
    if (toy / "target" / "config.json").exists() and (toy / "drafter" / "config.json").exists():
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(toy / "target", dtype=torch.float32).eval()
        return "toy pair", target, DFlashDrafter.from_pretrained(toy / "drafter")
    target = tiny_model("qwen3", seed=0, attn_implementation="sdpa", vocab_size=2048, hidden_size=256,
                        intermediate_size=768, num_hidden_layers=6)
    return "tiny random qwen3", target, DFlashDrafter.random_for_target(target.config, block_size=16)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="16,64,256,1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    name, target, drafter = load_pair()
    ids = torch.randint(0, 100, (1, 32), generator=torch.Generator().manual_seed(0))
    runs = [("ar", None), ("dflash", None)] + [("ddtree", int(b)) for b in args.budgets.split(",")]
    print(f"# {name}, {torch.get_num_threads()} threads, {args.new} new tokens, median of {args.repeats}")
    print(f"{'method':>8} {'budget':>6} {'tau':>5} {'tok/s':>7} {'ms/round':>9}   share: draft  tree  verify commit other")
    for method, budget in runs:
        res = [ddtree.generate(target, drafter, ids, method=method, budget=budget, max_new_tokens=args.new)
               for _ in range(args.repeats)]
        r = sorted(res, key=lambda x: x.decode_s)[len(res) // 2]
        rounds = max(1, r.rounds)
        st = r.stage_seconds
        other = max(0.0, r.decode_s - sum(st.values()))
        share = " ".join(f"{100 * v / r.decode_s:5.1f}%" for v in (*st.values(), other))
        print(f"{method:>8} {budget or '-':>6} {r.tau:5.2f} {statistics.median(x.tokens_per_s for x in res):7.1f} "
              f"{1e3 * r.decode_s / rounds:9.2f}   {share}")


if __name__ == "__main__":
    main()
