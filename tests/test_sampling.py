"""T > 0: the first two generated tokens follow the target's joint distribution (chi-square)."""

from __future__ import annotations

import contextlib
import random
from types import SimpleNamespace

import pytest
import torch
from sampling_support import assert_first_two_tokens_follow, exact_joint

import ddtree
from ddtree.engine.drafter import DFlashDrafter
from ddtree.tiny import tiny_model

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
    # (fast: the DFlash chain by rejection below, the tree on the hybrid's attention and GDN layers)
    pytest.param("qwen3", "dflash", None, "cpu", marks=pytest.mark.slow),
    pytest.param("qwen3", "ddtree", 7, "cpu", marks=pytest.mark.slow),
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


def _two_tokens(rule, P: torch.Tensor, Q: torch.Tensor, L: int):
    """The first two tokens of a generation whose target draws token j from P[j] whatever came before, drafted by a
    chain of L tokens sampled from Q[j], verified by `rule(drafted, Q rows, P rows) -> new tokens`."""
    out, first = [], None
    while len(out) < 2:
        s = len(out)
        drafted = torch.multinomial(Q[s: s + L], 1)[:, 0]
        new = rule(drafted, Q[s: s + L], P[s: s + L + 1])
        first = len(new) if first is None else first
        out += new
    return SimpleNamespace(output_ids=out, acceptance_lengths=[first])


@pytest.mark.parametrize("rule", ["engine", "reference"])
def test_rejection_rule_samples_the_target_and_accepts_sum_of_min(rule):
    """Speculative sampling of a sampled chain (ddtree.engine.tree.rejection_walk, and the slow reference): the first
    two tokens follow the target's joint (chi-square), and a draft is accepted with probability sum min(p, q), more
    than a match with an independent target sample (sum p q). The target and the drafter disagree a lot, so the
    residual at a rejection decides much of the output: drawing from p there instead fails this test."""
    from ddtree.engine.tree import chain_tree, rejection_walk
    from ddtree.testing.reference import rejection_reference

    torch.manual_seed(1)
    vocab, L, n, temperature = 6, 3, 4000, 0.7
    logits = 2 * torch.randn(L + 2, vocab, dtype=torch.float64)  # the drafter's: the target's, disturbed
    P, Q = torch.softmax(logits, -1).float(), torch.softmax(logits + 1.5 * torch.randn_like(logits), -1).float()
    g, rng = torch.Generator().manual_seed(3), random.Random(3)
    if rule == "engine":
        def verify(drafted, q, p):  # logits whose tempered softmax is p
            return rejection_walk(chain_tree(torch.tensor(0), drafted, q), p.log() * temperature, temperature, g).tokens
    else:
        def verify(drafted, q, p):
            return rejection_reference(drafted.tolist(), p.tolist(), q.tolist(), rng)
    draws = [_two_tokens(verify, P, Q, L) for _ in range(n)]
    it = iter(draws)
    assert_first_two_tokens_follow(lambda: next(it), torch.outer(P[0], P[1]).flatten().double(), n)
    accepted = sum(d.acceptance_lengths[0] > 1 for d in draws) / n
    expected, matched = torch.minimum(P[0], Q[0]).sum().item(), (P[0] * Q[0]).sum().item()
    assert abs(accepted - expected) < 4 * (expected * (1 - expected) / n) ** 0.5, (accepted, expected)
    assert expected > matched + 0.3, (expected, matched)  # 0.60 against 0.20 here


@torch.no_grad()
@pytest.mark.parametrize("kind", ["dflash", "dflash2"])
def test_sampled_chains_follow_target_by_rejection(kind):
    """T = 1, the DFlash chain and the DFlash2 selector's chain, verified by rejection against their draft rows: the
    first two tokens follow the target's joint (chi-square). A 6-token vocabulary and the target's head scaled x4
    (its rows peaked where the drafter's are not; shared with the DFlash drafter) give every joint cell enough draws
    that a residual drawn from p instead of max(0, p - q), or a draft row of the wrong position, fails this test."""
    from ddtree.engine.drafter.dflash2 import DFlash2Drafter

    vocab, n = 6, 1000
    target = tiny_model("qwen3", seed=3, vocab_size=vocab, num_hidden_layers=2)
    target.lm_head.weight.mul_(4.0)
    if kind == "dflash":
        drafter = DFlashDrafter.random_for_target(target.config, block_size=4, seed=5, mask_token_id=vocab - 1)
    else:
        drafter = DFlash2Drafter.random_for_target(target.config, block_size=4, seed=5, selector_top_k=3,
                                                   selector_rank=8, mask_token_id=vocab - 1)
    ids = torch.tensor([[1, 3, 2, 4]])
    engine = ddtree.Engine(target, drafter, method="dflash")
    g = torch.Generator().manual_seed(11)
    assert_first_two_tokens_follow(lambda: engine.generate(ids, temperature=1.0, max_new_tokens=3, generator=g),
                                   exact_joint(target, ids), n)
