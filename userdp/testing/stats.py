"""Exact-tolerance statistics for the privacy checks (false alarm ≤ 1e-7 per assertion).

Every bound here is an exact or conservative quantile of the statistic's null distribution, not a
trend test: a check computes what the correct implementation must produce (e.g. a noise std of
σ·C·lr/(qN)) from the TEST's constants, never from the code under test, and asserts the
measurement is inside the (1 − 1e-7) acceptance region. The checks that draw their noise from a
fixed test seed (``NoiseRng.for_testing``) are deterministic; those that must use the production
generator (fresh noise from ``os.urandom``) keep the 1e-7 false-alarm rate per assertion.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

ALPHA = 1e-7
"""Two-sided false-alarm probability of one statistical assertion."""

Z = float(stats.norm.isf(ALPHA / 2))  # ≈ 5.33: the normal quantile for ALPHA, two-sided


def std_bounds(n: int, alpha: float = ALPHA) -> tuple[float, float]:
    """Acceptance interval of (measured std / true std) for n iid N(0, s²) values of known mean 0:
    Σx²/s² ~ χ²_n exactly, so the ratio lies in [√(χ²_{α/2}/n), √(χ²_{1−α/2}/n)] w.p. 1 − α."""
    return (
        math.sqrt(stats.chi2.ppf(alpha / 2, n) / n),
        math.sqrt(stats.chi2.isf(alpha / 2, n) / n),
    )


def assert_gaussian_noise(
    values: np.ndarray, expected_std: float, what: str, alpha: float = ALPHA
) -> float:
    """``values`` must be iid N(0, expected_std²): exact χ² test of the scale, a z-test of the mean
    and a Kolmogorov–Smirnov test of the shape, each at false-alarm ``alpha``. Returns the
    measured std. The χ² interval is ~±1% for 10⁵ values, so a wrong factor such as √B, 1/B, σ²
    instead of σ, or a realized instead of an expected normalizer is rejected whenever it moves
    the std by more than a few percent."""
    x = np.asarray(values, dtype=np.float64).ravel()
    n = x.size
    assert n > 0, f"{what}: no values to test"
    assert np.all(np.isfinite(x)), f"{what}: non-finite noise values"
    measured = math.sqrt(float(np.dot(x, x)) / n)
    lo, hi = std_bounds(n, alpha)
    ratio = measured / expected_std
    assert lo <= ratio <= hi, (
        f"{what}: noise std is {measured:.6g} but the mechanism requires {expected_std:.6g} "
        f"(ratio {ratio:.4f}; the exact χ² acceptance interval for n={n} at false-alarm "
        f"{alpha:g} is [{lo:.4f}, {hi:.4f}])"
    )
    z_mean = float(x.mean()) / (expected_std / math.sqrt(n))
    z_limit = float(stats.norm.isf(alpha / 2))
    assert abs(z_mean) <= z_limit, (
        f"{what}: noise mean {x.mean():.3g} is {z_mean:.1f} standard errors from 0 (limit "
        f"{z_limit:.2f}): the released update is biased"
    )
    ks = stats.kstest(x / expected_std, "norm")
    assert ks.pvalue >= alpha, (
        f"{what}: noise is not Gaussian (Kolmogorov–Smirnov p = {ks.pvalue:.3g} < {alpha:g})"
    )
    return measured


def assert_uncorrelated(a: np.ndarray, b: np.ndarray, what: str, alpha: float = ALPHA) -> float:
    """Two noise vectors must be independent: identical draws (r = 1) or shared components are
    rejected. Under independence of zero-mean Gaussians, r·√n is ~N(0, 1) for large n; the
    bound is that quantile at ``alpha``. Returns r."""
    x = np.asarray(a, dtype=np.float64).ravel()
    y = np.asarray(b, dtype=np.float64).ravel()
    assert x.size == y.size and x.size >= 256, f"{what}: need ≥ 256 paired coordinates"
    assert np.any(x != 0) and np.any(y != 0), f"{what}: a noise vector is identically zero"
    r = float(np.dot(x, y) / math.sqrt(float(np.dot(x, x)) * float(np.dot(y, y))))
    limit = float(stats.norm.isf(alpha / 2)) / math.sqrt(x.size)
    assert not np.array_equal(x, y), f"{what}: the two noise draws are IDENTICAL (noise reused)"
    assert abs(r) <= limit, (
        f"{what}: the two noise draws are correlated (r = {r:.4f}, |r| must be ≤ {limit:.4f} "
        f"for independent draws over n={x.size}): noise was reused"
    )
    return r


def binomial_interval(trials: int, p: float, alpha: float = ALPHA) -> tuple[int, int]:
    """Exact acceptance interval [lo, hi] of a Binomial(trials, p) count at false-alarm alpha."""
    dist = stats.binom(trials, p)
    return int(dist.ppf(alpha / 2)), int(dist.isf(alpha / 2)) + 1


def chi2_interval(dof: int, alpha: float = ALPHA, slack: float = 0.0) -> tuple[float, float]:
    """Acceptance interval of a χ²_dof statistic; ``slack`` widens it (relative) for statistics
    that are only approximately χ² (sums of squared standardized binomials)."""
    lo, hi = stats.chi2.ppf(alpha / 2, dof), stats.chi2.isf(alpha / 2, dof)
    return lo * (1 - slack), hi * (1 + slack)
