"""What the batched-round tests share: a shipped toy pair with its prompts, and the batched round's device work
counted per round at N streams."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ddtree.engine import batch
from ddtree.engine.drafter.model import DFlashDrafter
from ddtree.testing.dispatch import DispatchCount


def per_round_at(engine, prompt, streams: int, new: int, budget) -> tuple[float, float]:
    """(kernel ops, host reads) a round of the batched round itself at `streams` copies of `prompt` (batch.generate_many:
    Engine.generate_many runs the one-stream round at one slot and T = 0), after a first call that builds the
    constants cached per shape; every copy must run every round."""
    def run():
        return batch.generate_many(engine, [prompt] * streams, streams, 0.0, new, None, 0, budget)

    run()
    with DispatchCount() as c:
        results = run()
    rounds = results[0].rounds
    assert all(r.rounds == rounds for r in results)
    return (c.total(c.kernel_ops, exclude=("prefill", "other")) / rounds,
            c.total(c.syncs, exclude=("prefill", "other")) / rounds)


ASSETS = Path(__file__).resolve().parent.parent / "assets"


def toy_pair(name: str, drafter: str = "drafter", prompts: int = 7):
    """assets/<name>'s target (fp32, sdpa), its drafter folder `drafter` and its first `prompts` held-out prompts
    through the chat template: (target, drafter, [ids [1, P]])."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    home = ASSETS / name
    target = AutoModelForCausalLM.from_pretrained(home / "target", dtype=torch.float32,
                                                  attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(home / "target")
    rows = [json.loads(line) for line in (home / "prompts.jsonl").read_text().splitlines()][:prompts]
    ids = [tok.apply_chat_template([{"role": "user", "content": r["turns"][0]}], add_generation_prompt=True,
                                   return_tensors="pt", return_dict=True)["input_ids"] for r in rows]
    return target, DFlashDrafter.from_pretrained(home / drafter, dtype=torch.float32), ids
