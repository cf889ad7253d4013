"""Per-stage breakdown of generations (draft, tree, verify, commit) on a tiny model.

    .venv/bin/python bench/bench_stages.py [--budgets 16,64,256,1024] [--repeats 3] [--new 64]

Uses the shipped toy pair (assets/toy) when present, else a tiny random Qwen3 and a random
drafter (whose acceptance is meaningless; the stage costs are not). Median over --repeats.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import ddtree
from ddtree.engine.drafter import DFlashDrafter
from ddtree.testing.tiny import tiny_model

ROOT = Path(__file__).resolve().parents[1]


def load_pair(n_prompts: int = 4, pair: str = "toy"):
    """(name, target, drafter, prompts [1, P] each, stop ids) of assets/<pair> (else a tiny random pair)."""
    toy = ROOT / "assets" / pair
    if (toy / "target" / "config.json").exists() and (toy / "drafter" / "config.json").exists():
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = AutoModelForCausalLM.from_pretrained(toy / "target", dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(toy / "target")
        lines = (toy / "prompts.jsonl").read_text().splitlines()[:n_prompts]
        prompts = [tok.apply_chat_template([{"role": "user", "content": json.loads(x)["turns"][0]}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)["input_ids"] for x in lines]
        return "toy pair", target, DFlashDrafter.from_pretrained(toy / "drafter"), prompts, [tok.eos_token_id]
    target = tiny_model("qwen3", seed=0, attn_implementation="sdpa", vocab_size=2048, hidden_size=256,
                        intermediate_size=768, num_hidden_layers=6)
    prompts = [torch.randint(0, 100, (1, 32), generator=torch.Generator().manual_seed(i)) for i in range(n_prompts)]
    return "tiny random qwen3", target, DFlashDrafter.random_for_target(target.config, block_size=16), prompts, []


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="16,64,256,1024")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=64)
    args = ap.parse_args()
    name, target, drafter, prompts, stops = load_pair()
    runs = [("ar", None), ("dflash", None)] + [("ddtree", int(b)) for b in args.budgets.split(",")]
    print(f"# {name}, {len(prompts)} prompts, {torch.get_num_threads()} threads, up to {args.new} new tokens, "
          f"median of {args.repeats} passes over the prompts")
    print(f"{'method':>8} {'budget':>6} {'tau':>5} {'tok/s':>7} {'ms/round':>9}   share: draft  tree  verify commit other")
    for method, budget in runs:
        passes = []
        for _ in range(args.repeats):
            res = [ddtree.generate(target, drafter, ids, method=method, budget=budget, max_new_tokens=args.new,
                                   stop_token_ids=stops) for ids in prompts]
            stages = {k: sum(r.stage_seconds[k] for r in res) for k in res[0].stage_seconds}
            passes.append((sum(r.decode_s for r in res), sum(r.rounds for r in res),
                           sum(r.num_new_tokens for r in res), sum(r.total_s for r in res), stages))
        decode, rounds, new, total, st = sorted(passes, key=lambda x: x[0])[len(passes) // 2]
        other = max(0.0, decode - sum(st.values()))
        share = " ".join(f"{100 * v / decode:5.1f}%" for v in (*st.values(), other))
        tau = (new - len(prompts)) / max(1, rounds)  # the prefill's first token is not a round
        print(f"{method:>8} {budget or '-':>6} {tau:5.2f} {new / total:7.1f} "
              f"{1e3 * decode / max(1, rounds):9.2f}   {share}")


if __name__ == "__main__":
    main()
