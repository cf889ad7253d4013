"""Every method with a real (random) DFlash drafter reproduces HF greedy decoding exactly."""

from __future__ import annotations

import pytest
import torch

import ddtree
from ddtree.engine.drafter import DFlashDrafter
from ddtree.testing.reference import hf_greedy
from ddtree.testing.tiny import tiny_model

CASES = [(t, a) for t in ("qwen3", "llama") for a in ("eager", "sdpa")]


def _prompts(vocab):
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (1, n), generator=g) for n in (1, 6, 19)]


@pytest.mark.parametrize("model_type,attn", CASES)
@pytest.mark.parametrize("vocab", [96, 12])
def test_all_methods_equal_hf_greedy(model_type, attn, vocab):
    target = tiny_model(model_type, seed=2, attn_implementation=attn, vocab_size=vocab)
    drafters = {bs: DFlashDrafter.random_for_target(target.config, block_size=bs, seed=bs, num_layers=1,
                                                    attn_implementation=attn) for bs in (2, 4, 16)}
    new = 20
    deepest = 0
    for ids in _prompts(vocab):
        ref = hf_greedy(target, ids, new)
        for bs, drafter in drafters.items():
            res = ddtree.generate(target, drafter, ids, method="dflash", max_new_tokens=new)
            assert res.output_ids == ref, f"dflash block {bs}"
            for budget in (1, 2, 7, 64):
                res = ddtree.generate(target, drafter, ids, method="ddtree", budget=budget, max_new_tokens=new)
                assert res.output_ids == ref, f"ddtree block {bs} budget {budget}"
                deepest = max(deepest, max(res.acceptance_lengths))
    if vocab == 12:
        assert deepest >= 3  # small vocabulary: random drafts are accepted more than one deep
