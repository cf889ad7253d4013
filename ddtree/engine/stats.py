"""The statistics the verdicts and reports use, in one place: no Hydra, no MLflow, no scipy.

* paired: `sign_flip_pvalue` (exact up to 16 pairs, else Monte Carlo) and `logprob_test` over per-output mean
  log-probabilities (ddtree.engine.output_check's T > 0 sanity signal);
* goodness of fit: `chi_square_pvalue` (Pearson's, its p-value by `gamma_upper_regularized`) and `pooled_chi_square`
  (draws against a distribution, small bins pooled: python -m ddtree.check's first-token test);
* a sampled output under the target: `token_logprobs` and the randomized PIT `sampled_pit` (uniform when sampling is
  right);
* a rate: `wilson` (its 95 % interval: python -m ddtree.diagnose).

Tested against scipy (tests/test_stats.py).
"""

from __future__ import annotations

import itertools
import math
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

Z95 = 1.959964  # the two-sided 95 % normal quantile


def sign_flip_pvalue(differences: Sequence[float], rounds: int = 20000, seed: int = 0) -> float | None:
    """Two-sided paired test of mean difference 0: exact over all sign flips up to 16 pairs, else Monte Carlo."""
    d = [float(x) for x in differences]
    n = len(d)
    if n == 0:
        return None
    observed = abs(sum(d)) - 1e-12 * (1 + sum(abs(x) for x in d))  # ties with the observed sum count
    if n <= 16:
        signs = itertools.product((1, -1), repeat=n)
        hits = sum(abs(sum(s * x for s, x in zip(flip, d, strict=True))) >= observed for flip in signs)
        return hits / 2 ** n
    rng = random.Random(seed)
    hits = sum(abs(sum(x if rng.random() < 0.5 else -x for x in d)) >= observed for _ in range(rounds))
    return (hits + 1) / (rounds + 1)


def chi_square_pvalue(observed: Sequence[float], expected: Sequence[float]) -> tuple[float, int, float | None]:
    """(statistic, degrees of freedom, upper-tail p-value) of Pearson's goodness-of-fit test, no scipy.

    The caller pools bins so every expected count is large enough (>= 5 is the usual rule)."""
    stat = float(sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True) if e > 0))
    dof = sum(1 for e in expected if e > 0) - 1
    return stat, dof, (gamma_upper_regularized(dof / 2, stat / 2) if dof > 0 else None)


def gamma_upper_regularized(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a): a series below a + 1, a continued fraction above (Numerical Recipes 6.2)."""
    if x <= 0:
        return 1.0
    log_front = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:  # P(a, x) by its series
        term = total = 1.0 / a
        n = a
        while abs(term) > abs(total) * 1e-15:
            n += 1
            term *= x / n
            total += term
        return max(0.0, 1.0 - total * math.exp(log_front))
    tiny = 1e-300  # Q(a, x) by Lentz's continued fraction
    b = x + 1 - a
    c, d = 1 / tiny, 1 / b
    h = d
    for i in range(1, 10000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return min(1.0, math.exp(log_front) * h)


def token_logprobs(logits: torch.Tensor, output_ids: Sequence[int], temperature: float = 0.0) -> torch.Tensor:
    """[N]: the target log-probability of each emitted token at its position (at the temperature; 1 for greedy)."""
    out = [int(t) for t in output_ids]
    rows = logits[: len(out)]
    t = temperature if temperature > 0 else 1.0
    emitted = torch.tensor(out, dtype=torch.long, device=rows.device)
    return torch.log_softmax(rows.float() / t, dim=-1).gather(-1, emitted[:, None])[:, 0]


def sampled_pit(logits: torch.Tensor, output_ids: Sequence[int], temperature: float,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """[N] randomized probability-integral transforms of sampled tokens: F(x-) + U p(x) under the target's
    distribution at each position. Tokens drawn from that distribution give i.i.d. Uniform(0, 1) values
    (each position conditionally on its prefix), whatever the prefixes were."""
    out = [int(t) for t in output_ids]
    probs = torch.softmax(logits[: len(out)].double() / temperature, dim=-1)
    emitted = torch.tensor(out, dtype=torch.long, device=probs.device)
    below = torch.cumsum(probs, dim=-1).gather(-1, emitted[:, None])[:, 0] - probs.gather(-1, emitted[:, None])[:, 0]
    u = torch.rand(len(out), generator=generator, dtype=torch.float64)
    return (below.cpu() + u * probs.gather(-1, emitted[:, None])[:, 0].cpu()).clamp(0.0, 1.0)


def logprob_test(pairs: Sequence[tuple[float, float]]) -> tuple[float | None, float | None]:
    """(p-value, mean difference) of per-sequence mean log-prob, method minus baseline. A sanity signal only."""
    diffs = [m - b for m, b in pairs]
    if not diffs:
        return None, None
    return sign_flip_pvalue(diffs), float(f"{sum(diffs) / len(diffs):.6g}")


def pooled_chi_square(probs: torch.Tensor, drawn: Sequence[int]) -> dict[str, Any]:
    """Chi-square of tokens drawn against a distribution over the vocabulary (`probs` [V]): tokens expected >= 5
    times get a bin each, the rest one pooled bin (merged into the smallest when it is expected < 5 times)."""
    n = len(drawn)
    counts = Counter(drawn)
    big = [t for t in probs.argsort(descending=True).tolist() if probs[t] * n >= 5]
    obs = [counts.get(t, 0) for t in big]
    exp = [float(probs[t]) * n for t in big]
    rest_o, rest_e = n - sum(obs), n - sum(exp)
    if rest_e >= 5 or not exp:
        obs.append(rest_o)
        exp.append(rest_e)
    elif exp:
        obs[-1] += rest_o
        exp[-1] += rest_e
    if len(exp) < 2:
        return {"chi2": None, "dof": 0, "pvalue": None, "note": "too few samples for a test (need >= 5 expected "
                "in two bins)"}
    stat, dof, pv = chi_square_pvalue(obs, exp)
    return {"chi2": stat, "dof": dof, "pvalue": pv}


def wilson(k: int, n: int) -> tuple[float | None, float | None, float | None]:
    """k of n: the rate and its 95 % Wilson interval (None where n = 0)."""
    if n <= 0:
        return None, None, None
    p = k / n
    den = 1 + Z95 ** 2 / n
    mid = (p + Z95 ** 2 / (2 * n)) / den
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / den
    return p, max(0.0, mid - half), min(1.0, mid + half)
