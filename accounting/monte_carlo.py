"""Monte Carlo estimates of a hockey-stick divergence from privacy-loss samples, and their error.

For a dominating pair (P, Q) and the privacy loss Y = log P(X)/Q(X), X ~ P (Choquette-Choo
et al., "Near Exact Privacy Amplification for Matrix Mechanisms", §2):

    δ(ε) = H_{e^ε}(P, Q) = E[(1 − e^{ε − Y})₊],

so δ̂(ε) = mean of the m terms (1 − e^{ε − Yⱼ})₊, each in [0, 1). This module turns samples of Y
into δ̂, its standard error, a one-sided KL-Chernoff upper confidence bound, and the
Estimate-Verify-Release (EVR) test of Wang et al. 2023 (Algorithm 1 and Theorem 2.1 of the same
paper). It knows nothing about the mechanism; :mod:`userdp.accounting.balls_in_bins` supplies
the samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

__all__ = [
    "brentq",
    "delta_terms",
    "tail_epsilon",
    "tail_sums",
    "SampledLosses",
    "StreamedDelta",
    "delta_from_losses",
    "epsilon_from_estimates",
    "kl_bernoulli",
    "kl_upper_confidence_bound",
    "kl_lower_threshold",
    "evr_passes",
    "evr_min_samples",
    "evr_samples",
]


def brentq(f: Callable[[float], float], a: float, b: float, **options: float) -> float:
    """scipy's Brent root finder on [a, b], imported on first use: ``scipy.optimize`` costs about
    0.7 CPU-s of imports on a 2-core machine, and an ε query (:func:`epsilon_from_estimates`,
    solved in closed form) needs none of it."""
    from scipy.optimize import brentq as scipy_brentq

    return float(scipy_brentq(f, a, b, **options))


def tail_sums(points: np.ndarray, mass: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """(tail, weighted) for :func:`tail_epsilon`: the sums of ``mass`` and of mass·e^{−s} over
    points[i:] for each i, with a trailing 0 (``mass`` per point, or one value for all)."""
    mass = np.broadcast_to(np.asarray(mass, dtype=np.float64), points.shape)
    tail = np.append(np.cumsum(mass[::-1])[::-1], 0.0)
    weighted = np.append(np.cumsum((mass * np.exp(-points))[::-1])[::-1], 0.0)
    return tail, weighted


def tail_epsilon(points: np.ndarray, tail: np.ndarray, weighted: np.ndarray, delta: float) -> float:
    """The smallest ε ≥ 0 with δ̂(ε) ≤ ``delta``, exactly, for the δ̂ of a discrete law of losses:

        δ̂(ε) = Σ_{s>ε} p(s)(1 − e^{ε−s}) = tail[i] − e^ε·weighted[i],   i = #{points ≤ ε},

    where ``points`` are the positive support points in ascending order and ``tail[i]``,
    ``weighted[i]`` the sums of p(s) and p(s)e^{−s} over points[i:] (a trailing 0 each). δ̂ is
    continuous and non-increasing, and 0 at the last point; a bisection over the points finds the
    first k with δ̂(points[k]) ≤ δ, and on (points[k−1], points[k]] the index is k, so
    ε = log((tail[k] − δ)/weighted[k]) there."""

    def value(eps: float) -> float:
        i = int(np.searchsorted(points, eps, side="right"))
        return float(tail[i] - math.exp(eps) * weighted[i])

    if points.size == 0 or value(0.0) <= delta:
        return 0.0
    lo, hi = 0, points.size - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if value(float(points[mid])) <= delta:
            hi = mid
        else:
            lo = mid + 1
    low = float(points[lo - 1]) if lo else 0.0
    eps = math.log((float(tail[lo]) - delta) / float(weighted[lo]))
    return min(max(eps, low), float(points[lo]))


def delta_terms(losses: np.ndarray, epsilon: float) -> np.ndarray:
    """(1 − e^{ε − Y})₊ for each loss sample Y (an unbiased sample of H_{e^ε}(P, Q))."""
    return -np.expm1(np.minimum(epsilon - np.asarray(losses, dtype=np.float64), 0.0))


def delta_from_losses(losses: np.ndarray, epsilon: float, num_samples: int) -> tuple[float, float]:
    """(δ̂, standard error) at ``epsilon``; ``losses`` may hold only the samples with Y > 0 (the
    others contribute 0 for every ε ≥ 0), ``num_samples`` is the full sample count m."""
    terms = delta_terms(losses, epsilon)
    return _mean_and_stderr(float(terms.sum()), float(np.square(terms).sum()), num_samples)


def _mean_and_stderr(total: float, total_sq: float, num_samples: int) -> tuple[float, float]:
    """(mean, standard error) of ``num_samples`` terms from their sum and sum of squares."""
    mean = total / num_samples
    var = max(total_sq / num_samples - mean * mean, 0.0)
    return mean, math.sqrt(var / max(num_samples - 1, 1))


class SampledLosses:
    """δ̂ from ``num_samples`` i.i.d. loss samples, of which only the positive ones need be kept
    (the others contribute 0 for every ε ≥ 0). Same interface as
    :class:`userdp.accounting.composed_losses.ComposedLosses`: ``num_samples`` is the count the
    KL-Chernoff bounds use."""

    def __init__(self, losses: np.ndarray, num_samples: int) -> None:
        self.losses = np.asarray(losses, dtype=np.float64)
        self.num_samples = int(num_samples)

    def delta(self, epsilon: float) -> tuple[float, float]:
        """(δ̂(ε), standard error)."""
        return delta_from_losses(self.losses, epsilon, self.num_samples)

    def point(self, epsilon: float) -> float:
        """δ̂(ε), the mean alone (no standard error)."""
        return float(delta_terms(self.losses, epsilon).sum()) / self.num_samples

    def epsilon(self, delta: float) -> float:
        """The smallest ε ≥ 0 with δ̂(ε) ≤ ``delta`` (exact: :func:`tail_epsilon`)."""
        points = np.sort(self.losses[self.losses > 0.0])
        return tail_epsilon(points, *tail_sums(points, 1.0 / self.num_samples), delta)

    def roundoff_bound(self, epsilon: float) -> float:
        """0: a sample mean has no transform round-off to bound (the composed estimator's
        counterpart is not 0)."""
        return 0.0


class StreamedDelta:
    """δ̂ at ONE ε from running sums of the terms (1 − e^{ε − Y})₊, so that no sample is kept:
    what calibration and verification need, at any sample count. Same interface as
    :class:`SampledLosses` at that ε; any other ε is an error."""

    def __init__(self, epsilon: float, total: float, total_sq: float, num_samples: int) -> None:
        self.epsilon = float(epsilon)
        self.total, self.total_sq = float(total), float(total_sq)
        self.num_samples = int(num_samples)

    def _check(self, epsilon: float) -> None:
        if epsilon != self.epsilon:
            raise ValueError(f"epsilon={epsilon!r}: these sums hold δ̂ at ε = {self.epsilon!r} only")

    def point(self, epsilon: float) -> float:
        self._check(epsilon)
        return self.total / self.num_samples

    def delta(self, epsilon: float) -> tuple[float, float]:
        """(δ̂(ε), standard error), as :func:`delta_from_losses` computes them."""
        self._check(epsilon)
        return _mean_and_stderr(self.total, self.total_sq, self.num_samples)

    def roundoff_bound(self, epsilon: float) -> float:
        """0, as for :class:`SampledLosses`."""
        self._check(epsilon)
        return 0.0


def epsilon_from_estimates(estimates: list, delta: float) -> float:
    """The smallest ε ≥ 0 with max over ``estimates`` of δ̂(ε) ≤ ``delta``: each δ̂ is
    non-increasing in ε, so it is the largest of the estimates' own smallest ε, each found
    exactly on the same samples; ``estimates`` are :class:`SampledLosses` or
    :class:`~userdp.accounting.composed_losses.ComposedLosses`."""
    return max(e.epsilon(delta) for e in estimates)


def kl_bernoulli(q: float, p: float) -> float:
    """KL(Bern(q) ‖ Bern(p)), with 0·log 0 = 0; +∞ when p ∈ {0, 1} and q differs."""
    if p <= 0.0:
        return 0.0 if q <= 0.0 else math.inf
    if p >= 1.0:
        return 0.0 if q >= 1.0 else math.inf
    out = 0.0
    if q > 0.0:
        out += q * math.log(q / p)
    if q < 1.0:
        out += (1.0 - q) * (math.log1p(-q) - math.log1p(-p))  # log1p: exact for tiny p, q
    return out


def kl_upper_confidence_bound(mean: float, num_samples: int, failure_prob: float) -> float:
    """The smallest p ≥ mean with m·KL(mean ‖ p) ≥ log(1/failure_prob).

    For i.i.d. terms in [0, 1] with true mean H, Pr[δ̂ ≤ q] ≤ exp(−m·KL(q ‖ H)) for q < H
    (Chernoff–Hoeffding, KL form), so H ≤ this bound with probability ≥ 1 − failure_prob.
    """
    target = math.log(1.0 / failure_prob) / num_samples
    mean = min(max(mean, 0.0), 1.0)
    if mean >= 1.0 or kl_bernoulli(mean, 1.0 - 1e-16) < target:
        return 1.0
    return brentq(
        lambda p: kl_bernoulli(mean, p) - target, mean, 1.0 - 1e-16, xtol=1e-300, rtol=1e-12
    )


def kl_lower_threshold(mean: float, num_samples: int, failure_prob: float) -> float:
    """The largest q ≤ ``mean`` with m·KL(q ‖ mean) ≥ log(1/failure_prob).

    For i.i.d. terms in [0, 1] whose true mean H is ≥ ``mean``, Pr[δ̂ ≤ q] ≤ exp(−m·KL(q ‖ H))
    ≤ failure_prob (Chernoff–Hoeffding, KL form; KL(q ‖ H) grows in H for H > q): an estimate at
    or below q shows H < ``mean`` with confidence 1 − failure_prob. Raises ``ValueError`` when
    even δ̂ = 0 does not (m·KL(0 ‖ mean) < log(1/failure_prob): too few samples).
    """
    target = math.log(1.0 / failure_prob) / num_samples
    if kl_bernoulli(0.0, mean) < target:
        need = math.ceil(math.log(1.0 / failure_prob) / kl_bernoulli(0.0, mean))
        raise ValueError(
            f"num_samples={num_samples} is too few to bound a mean of {mean:.3g} at failure "
            f"probability {failure_prob:.3g}; expected at least {need}"
        )
    return brentq(lambda q: kl_bernoulli(q, mean) - target, 0.0, mean, xtol=1e-300, rtol=1e-12)


def evr_passes(delta_hat: float, num_samples: int, delta: float) -> bool:
    """The EVR verifier: accept a FIXED target ``delta`` iff δ̂ < δ and exp(−m·KL(δ̂ ‖ δ)) ≤ δ.

    If the true H > δ then Pr[accept] ≤ exp(−m·KL(δ̂_thr ‖ H)) ≤ exp(−m·KL(δ̂_thr ‖ δ)) ≤ δ, which is
    the premise of Theorem 2.1 of "Near Exact Privacy Amplification for Matrix Mechanisms" (Thm 9
    of Wang et al. 2023) with τδ = δ: releasing only
    when this passes is (ε, δ)-DP. ``delta`` must be chosen before the samples are drawn, and the
    samples must be fresh (independent of how σ was chosen).
    """
    if not delta_hat < delta:
        return False
    return num_samples * kl_bernoulli(delta_hat, delta) >= math.log(1.0 / delta)


def evr_min_samples(delta: float, safety: float) -> int:
    """Fresh samples needed so that δ̂ = ``safety``·δ passes :func:`evr_passes` at ``delta``:
    m ≥ log(1/δ) / KL(safety·δ ‖ δ) (≈ 5.4·10⁷ for δ = 1e-5 and safety = 0.8, the δ′ = 8·10⁻⁶ of
    the CIFAR runs of "Near Exact Privacy Amplification for Matrix Mechanisms", §5.2)."""
    if not 0.0 < safety < 1.0:
        raise ValueError(f"safety={safety!r} is out of range; expected a float in (0, 1)")
    return math.ceil(math.log(1.0 / delta) / kl_bernoulli(safety * delta, delta))


def evr_samples(delta: float, safety: float, failure_prob: float) -> int:
    """Fresh samples at which :func:`evr_passes` at ``delta`` rejects a direction whose true mean
    is ≤ ``safety``·δ with probability ≤ ``failure_prob`` (its power).

    With m samples the test accepts exactly δ̂ ≤ q_m = :func:`kl_lower_threshold` (δ, m, δ), and
    for a true mean H ≤ safety·δ < q_m, Pr[δ̂ > q_m] ≤ exp(−m·KL(q_m ‖ H)) ≤ exp(−m·KL(q_m ‖
    safety·δ)) (Chernoff–Hoeffding upper tail). q_m grows with m, so the smallest m is
    max(log(1/δ)/KL(q ‖ δ), log(1/failure_prob)/KL(q ‖ safety·δ)) at the q in (safety·δ, δ) where
    the two are equal: 1.54·10⁸ (q = 0.88·δ) for δ = 1e-5, safety = 0.8 and failure 0.0025,
    2.9 times :func:`evr_min_samples`.
    """
    if not 0.0 < safety < 1.0:
        raise ValueError(f"safety={safety!r} is out of range; expected a float in (0, 1)")
    if not 0.0 < failure_prob < 1.0:
        raise ValueError(f"failure_prob={failure_prob!r} is out of range; expected (0, 1)")
    design = safety * delta
    certify, power = math.log(1.0 / delta), math.log(1.0 / failure_prob)
    q = brentq(
        lambda x: certify * kl_bernoulli(x, design) - power * kl_bernoulli(x, delta),
        design,
        delta,
        xtol=1e-300,
        rtol=1e-12,
    )
    return math.ceil(max(certify / kl_bernoulli(q, delta), power / kl_bernoulli(q, design)))
