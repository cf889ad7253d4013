"""ddtree.engine.stats against independent references: scipy (permutation test, chi-square, gamma), a published
Wilson interval."""

from __future__ import annotations

import pytest
import torch

from ddtree.engine.stats import (
    chi_square_pvalue,
    gamma_upper_regularized,
    pooled_chi_square,
    sign_flip_pvalue,
    wilson,
)


def test_sign_flip_pvalue_equals_scipy_permutation_test():
    from scipy.stats import permutation_test

    g = torch.Generator().manual_seed(0)
    for n, shift in ((6, 0.0), (10, 0.8), (12, -0.3)):
        d = (torch.randn(n, generator=g, dtype=torch.float64) + shift).tolist()
        ref = permutation_test((d,), lambda x: sum(x), permutation_type="samples", n_resamples=float("inf"))
        assert sign_flip_pvalue(d) == pytest.approx(ref.pvalue, rel=1e-9)
    assert sign_flip_pvalue([]) is None
    assert sign_flip_pvalue([1.0] * 40) < 1e-3  # Monte Carlo branch


def test_chi_square_pvalue_matches_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")

    for a, x in ((0.5, 0.1), (1, 3.0), (4.5, 2.0), (10, 25.0), (50, 40.0), (3, 0.0)):
        assert gamma_upper_regularized(a, x) == pytest.approx(scipy_stats.gamma.sf(x, a), rel=1e-9, abs=1e-300)
    obs, exp = [18, 25, 30, 27], [25, 25, 25, 25]
    stat, dof, p = chi_square_pvalue(obs, exp)
    ref = scipy_stats.chisquare(obs, exp)
    assert (stat, dof) == (pytest.approx(ref.statistic), 3) and p == pytest.approx(ref.pvalue, rel=1e-9)


def test_pooled_chi_square_pools_small_bins_and_matches_scipy():
    scipy_stats = pytest.importorskip("scipy.stats")
    probs = torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01], dtype=torch.float64)
    drawn = [0] * 22 + [1] * 11 + [2] * 5 + [3] * 2  # n = 40: tokens 0, 1, 2 expected >= 5 times, 3 and 4 pooled
    got = pooled_chi_square(probs, drawn)
    # the pooled bin (expected 2.0) is merged into the smallest (token 2, expected 6.0)
    ref = scipy_stats.chisquare([22, 11, 7], [20.0, 12.0, 8.0])
    assert got["dof"] == 2 and got["chi2"] == pytest.approx(ref.statistic) and got["pvalue"] == pytest.approx(ref.pvalue)
    assert pooled_chi_square(probs, [0, 1])["pvalue"] is None  # too few draws for two bins


def test_wilson_interval():
    p, lo, hi = wilson(22, 100)
    assert p == 0.22 and lo == pytest.approx(0.1500, abs=2e-4) and hi == pytest.approx(0.3107, abs=2e-4)
    assert wilson(0, 0) == (None, None, None)
