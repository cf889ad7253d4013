"""T > 0: the first two generated tokens follow the target's joint distribution (chi-square)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from sampling_support import assert_first_two_tokens_follow, exact_joint

import ddtree
from ddtree.engine.drafter import DFlashDrafter
from ddtree.testing.tiny import tiny_model

V, T, N = 12, 1.0, 1000


_PAIRS = {}


def pair(model_type: str = "qwen3"):
    if model_type not in _PAIRS:
        target = tiny_model(model_type, seed=3, vocab_size=V, num_hidden_layers=2 if model_type == "qwen3" else 4)
        drafter = DFlashDrafter.random_for_target(target.config, block_size=4, seed=5, mask_token_id=V - 1)
        _PAIRS[model_type] = target, drafter
    return _PAIRS[model_type]


@torch.no_grad()
@pytest.mark.parametrize("model_type,method,budget,path", [
    ("qwen3", "dflash", None, "cpu"), ("qwen3", "ddtree", 7, "cpu"),
    pytest.param("qwen3", "ddtree", 40, "cpu", marks=pytest.mark.slow),  # a 41-node tree (make test-slow)
    pytest.param("qwen3_5_text", "dflash", None, "cpu", marks=pytest.mark.slow),  # hybrid GDN + attention
    ("qwen3_5_text", "ddtree", 7, "cpu"),
    # the code a CUDA run takes (ddtree.engine.host.device_path: every CPU-only branch off; minutes on 2 cores)
    pytest.param("qwen3", "ddtree", 40, "device", marks=pytest.mark.slow),
    pytest.param("qwen3_5_text", "ddtree", 7, "device", marks=pytest.mark.slow),
])
def test_first_two_tokens_follow_target(model_type, method, budget, path):
    from ddtree.engine.host import device_path

    with device_path() if path == "device" else contextlib.nullcontext():
        _first_two_tokens_follow_target(model_type, method, budget)


def _first_two_tokens_follow_target(model_type, method, budget):
    target, drafter = pair(model_type)
    ids = torch.tensor([[1, 5, 2, 7]])
    probs = exact_joint(target, ids, T)
    g = torch.Generator().manual_seed(11)
    assert_first_two_tokens_follow(  # max_new_tokens=3: round one is not cut short
        lambda: ddtree.generate(target, drafter, ids, method=method, budget=budget, temperature=T, max_new_tokens=3,
                                generator=g), probs, N)
