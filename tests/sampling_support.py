"""The T > 0 check shared by the sampling tests (tests/test_sampling.py, test_mtp.py, test_dflash2.py): the first two
generated tokens against the target's exact joint distribution, by scipy's chi-square (an independent reference)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from scipy.stats import chisquare


@torch.no_grad()
def exact_joint(target, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """p(t1, t2) = p(t1) p(t2 | t1) from plain forwards of the target, flattened (float64)."""
    p1 = torch.softmax(target(ids).logits[0, -1] / temperature, -1)
    vocab = p1.numel()
    nxt = torch.cat([ids.repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
    p2 = torch.softmax(target(nxt).logits[:, -1] / temperature, -1)
    return (p1[:, None] * p2).flatten().double()


def assert_first_two_tokens_follow(draw: Callable[[], object], probs: torch.Tensor, n: int) -> None:
    """Draw `n` generations (each with `output_ids` and `acceptance_lengths`); the pair of first tokens must pass a
    chi-square test against `probs` (cells expected < 5 times pooled), and the second token must often have come
    from the draft (> n / 20 times), so the drafted path is what was tested."""
    vocab = round(probs.numel() ** 0.5)
    counts = torch.zeros(vocab * vocab, dtype=torch.float64)
    drafted = 0
    for _ in range(n):
        r = draw()
        counts[r.output_ids[0] * vocab + r.output_ids[1]] += 1
        drafted += r.acceptance_lengths[0] > 1
    assert drafted > n // 20
    expected = probs * n
    big = expected >= 5  # pool sparse cells so the chi-square approximation holds
    pooled = [counts[~big].sum().reshape(1)] if (~big).any() else []  # (no sparse cell: no pooled one)
    obs = torch.cat([counts[big], *pooled])
    exp = torch.cat([expected[big], *([expected[~big].sum().reshape(1)] if pooled else [])])
    exp = exp * (obs.sum() / exp.sum())  # float rounding of the exact probabilities
    assert chisquare(obs.numpy(), exp.numpy()).pvalue > 1e-3
