"""upstream-mask-filter: the authors' loops keep generated tokens equal to the drafter's mask token id.

Reference: HF greedy decoding, and the validator (every token the target's argmax, no token missing).
The stand-in checkout filters its output the way the authors' code does (every mask id dropped).
"""

from __future__ import annotations

import pytest
import torch
from conftest import copy_checkout

from ddtree.engine.drafter import DFlashDrafter
from ddtree.engine.output_check import Validator
from ddtree.testing.reference import hf_greedy
from ddtree.tiny import tiny_model
from ddtree.upstream.engine import generate_upstream, load_upstream_engine

pytestmark = pytest.mark.usefixtures("clean_compat")
NEW = 24


@pytest.fixture(scope="module")
def case():
    """A target whose greedy output holds the drafter's mask token id, and a prompt that holds it too."""
    target = tiny_model("qwen3", seed=1, vocab_size=64, attn_implementation="sdpa")
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        prompt = torch.randint(0, 64, (1, 9), generator=g)
        ref = hf_greedy(target, prompt, NEW)
        shared = sorted(set(prompt[0].tolist()) & set(ref[1:]))
        if shared:
            break
    mask = shared[0]
    drafter = DFlashDrafter.random_for_target(target.config, block_size=4, seed=1, num_layers=1, mask_token_id=mask,
                                              attn_implementation="sdpa")
    return target, drafter, prompt, ref


@pytest.mark.parametrize("method,budget", [("dflash", None), ("ddtree", 8)])
def test_upstream_mask_filter_keeps_generated_mask_ids(case, tmp_path, method, budget):
    target, drafter, prompt, ref = case
    up = load_upstream_engine(copy_checkout("upstream_checkout", tmp_path))
    assert {p["id"]: p["status"] for p in up.patches}["upstream-mask-filter"] == "applied"
    res = generate_upstream(up, target, drafter, prompt, method=method, budget=budget, max_new_tokens=NEW)
    assert res.output_ids == ref
    assert Validator(target, max_new_tokens=NEW).verdict(prompt, res.output_ids, ref).verdict == "exact"


def test_without_upstream_mask_filter_tokens_go_missing_where_the_validator_says(case, tmp_path):
    target, drafter, prompt, ref = case
    up = load_upstream_engine(copy_checkout("upstream_checkout", tmp_path), skip=["upstream-mask-filter"])
    res = generate_upstream(up, target, drafter, prompt, method="ddtree", budget=8, max_new_tokens=NEW)
    mask = drafter.mask_token_id
    assert res.output_ids == [t for t in ref if t != mask]  # every generated mask id dropped
    verdict = Validator(target, max_new_tokens=NEW).verdict(prompt, res.output_ids, ref)
    assert verdict.verdict == "suspect" and verdict.side == "method" and verdict.position == ref.index(mask)
