"""T > 0: the first two generated tokens follow the target's joint distribution (chi-square)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from scipy.stats import chisquare

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
def exact_joint(target, ids: torch.Tensor) -> torch.Tensor:
    """p(t1, t2) = p(t1) p(t2 | t1), from plain forwards."""
    p1 = torch.softmax(target(ids).logits[0, -1] / T, -1)
    nxt = torch.cat([ids.repeat(V, 1), torch.arange(V)[:, None]], dim=1)
    p2 = torch.softmax(target(nxt).logits[:, -1] / T, -1)
    return p1[:, None] * p2


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
    probs = exact_joint(target, ids).flatten().double()
    g = torch.Generator().manual_seed(11)
    counts = torch.zeros(V * V, dtype=torch.float64)
    drafted = 0
    for _ in range(N):
        r = ddtree.generate(target, drafter, ids, method=method, budget=budget, temperature=T,
                            max_new_tokens=3, generator=g)  # 3: round one is not cut short
        counts[r.output_ids[0] * V + r.output_ids[1]] += 1
        drafted += r.acceptance_lengths[0] > 1
    assert drafted > N // 20  # the second token often came from the draft, so the tree path is tested
    expected = probs * N
    big = expected >= 5  # pool sparse cells so the chi-square approximation holds
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    exp = exp * (obs.sum() / exp.sum())  # float rounding of the exact probabilities
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3
