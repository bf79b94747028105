"""Monte Carlo accountant for balls-in-bins sampling with (correlated) Gaussian noise
(Choquette-Choo et al., "Near Exact Privacy Amplification for Matrix Mechanisms").

The queries: δ̂(ε) with standard errors and a confidence bound (:func:`delta_estimate`), a point
estimate of ε(δ) (:func:`epsilon`), the Estimate-Verify-Release check of (ε, δ) on fresh samples
(:func:`verify`), and σ for a target (:func:`calibrate_noise_multiplier`). The mechanism, its two
bin semantics, the dominating pair and how its privacy-loss samples are drawn are in
:mod:`userdp.accounting.balls_in_bins_losses`; both directions are always estimated and the max
is used.

Randomness: a seed gives two independent streams (children 0 and 1 of ``SeedSequence(seed)``):
the estimate stream (ε/δ̂ estimates and calibration) and the verify stream. Calibration bisects σ
on fixed estimate-stream samples (common random numbers); verification draws only the verify
stream, which calibration never touches. Each sample's W is shared by both directions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from scipy import optimize, stats
from userdp.accounting import monte_carlo as mc
from userdp.accounting.balls_in_bins_losses import (
    _ESTIMATE,
    _VERIFY,
    BIN_SEMANTICS,
    BallsInBinsError,
    DominatingPair,
    UnsupportedBinSemanticsError,
    _root_seed,
    _Sampler,
    correlation_matrix,
    dominating_pair,
)
from userdp.accounting.validation import (
    non_negative_float,
    positive_float,
    positive_int,
    probability,
)

__all__ = [
    "BIN_SEMANTICS",
    "BallsInBinsError",
    "DeltaEstimate",
    "DominatingPair",
    "UnsupportedBinSemanticsError",
    "VerificationFailedError",
    "VerificationResult",
    "calibrate_noise_multiplier",
    "correlation_matrix",
    "delta_estimate",
    "dominating_pair",
    "epsilon",
    "gaussian_delta",
    "verify",
]

DEFAULT_NUM_SAMPLES = 2**20


class VerificationFailedError(BallsInBinsError):
    """The fresh-sample EVR check did not certify (ε, δ) at the calibrated σ."""


# --------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class DeltaEstimate:
    """δ̂ = max(H(P,Q), H(Q,P)) at ``epsilon`` and σ, with standard errors and a one-sided
    KL-Chernoff upper confidence bound (each direction at failure (1 − confidence)/2)."""

    epsilon: float
    noise_multiplier: float
    delta: float
    delta_pq: float
    delta_qp: float
    stderr_pq: float
    stderr_qp: float
    upper_bound: float
    confidence: float
    num_samples: int

    @property
    def stderr(self) -> float:
        return self.stderr_pq if self.delta_pq >= self.delta_qp else self.stderr_qp


@dataclass(frozen=True)
class VerificationResult:
    """The EVR check on FRESH samples: ``passed`` iff both directions pass
    :func:`userdp.accounting.monte_carlo.evr_passes` at the fixed target ``delta``."""

    passed: bool
    epsilon: float
    delta: float
    noise_multiplier: float
    delta_pq: float
    delta_qp: float
    num_samples: int


# --------------------------------------------------------------------------------------------
# public API


def delta_estimate(
    noise_multiplier: float,
    bins: int,
    epochs: int,
    epsilon: float,
    *,
    bin_semantics: str = "fixed",
    correlation: Any = None,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    seed: Any = None,
    confidence: float = 0.95,
) -> DeltaEstimate:
    """Estimate δ(ε) for σ = ``noise_multiplier`` (both directions) from ``num_samples`` each."""
    sigma = positive_float("noise_multiplier", noise_multiplier, BallsInBinsError)
    epsilon = non_negative_float("epsilon", epsilon, BallsInBinsError)
    if not 0.0 < confidence < 1.0:
        raise BallsInBinsError(f"confidence={confidence!r} is out of range; expected (0, 1)")
    pair = dominating_pair(bins, epochs, bin_semantics=bin_semantics, correlation=correlation)
    m = positive_int("num_samples", num_samples, BallsInBinsError)
    sampler = _Sampler(pair, m, seed, _ESTIMATE)
    return _estimate(sampler, sigma, epsilon, confidence)


def _estimate(sampler: _Sampler, sigma: float, epsilon: float, confidence: float) -> DeltaEstimate:
    m = sampler.num_samples
    y_pq, y_qp = sampler.losses(sigma)
    d_pq, se_pq = mc.delta_from_losses(y_pq, epsilon, m)
    d_qp, se_qp = mc.delta_from_losses(y_qp, epsilon, m)
    failure = (1.0 - confidence) / 2.0
    ucb = max(mc.kl_upper_confidence_bound(d, m, failure) for d in (d_pq, d_qp))
    return DeltaEstimate(
        epsilon, sigma, max(d_pq, d_qp), d_pq, d_qp, se_pq, se_qp, ucb, confidence, m
    )


def epsilon(
    noise_multiplier: float,
    bins: int,
    epochs: int,
    delta: float,
    *,
    bin_semantics: str = "fixed",
    correlation: Any = None,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    seed: Any = None,
) -> float:
    """Monte Carlo point estimate of ε(δ): the smallest ε with max(δ̂_PQ, δ̂_QP)(ε) ≤ δ.

    An ESTIMATE (its error is that of δ̂, see :func:`delta_estimate`); to certify a guarantee
    use :func:`verify` with fresh samples.
    """
    sigma = positive_float("noise_multiplier", noise_multiplier, BallsInBinsError)
    delta = probability("delta", delta, BallsInBinsError, upper_open=True)
    pair = dominating_pair(bins, epochs, bin_semantics=bin_semantics, correlation=correlation)
    m = positive_int("num_samples", num_samples, BallsInBinsError)
    sampler = _Sampler(pair, m, seed, _ESTIMATE)
    losses = list(sampler.losses(sigma))
    return mc.epsilon_from_losses(losses, delta, m)


def verify(
    noise_multiplier: float,
    bins: int,
    epochs: int,
    epsilon: float,
    delta: float,
    *,
    bin_semantics: str = "fixed",
    correlation: Any = None,
    num_samples: int | None = None,
    seed: Any = None,
    safety: float = 0.8,
) -> VerificationResult:
    """Estimate-Verify-Release check of (ε, δ) at σ on FRESH samples (the verify streams of
    ``seed``, independent of every calibration/estimate draw with the same seed).

    Passes iff for both directions δ̂ < δ and exp(−m·KL(δ̂ ‖ δ)) ≤ δ; then releasing only on a pass
    is (ε, δ)-DP (Theorem 2.1 of "Near Exact Privacy Amplification for Matrix Mechanisms",
    Theorem 9 of Wang et al. 2023, with τδ = δ). ``num_samples`` defaults to
    :func:`~userdp.accounting.monte_carlo.evr_min_samples` (δ, ``safety``): enough for δ̂ =
    safety·δ to pass.
    """
    sigma = positive_float("noise_multiplier", noise_multiplier, BallsInBinsError)
    epsilon = non_negative_float("epsilon", epsilon, BallsInBinsError)
    delta = probability("delta", delta, BallsInBinsError, upper_open=True)
    pair = dominating_pair(bins, epochs, bin_semantics=bin_semantics, correlation=correlation)
    m = mc.evr_min_samples(delta, safety) if num_samples is None else num_samples
    m = positive_int("num_samples", m, BallsInBinsError)
    sampler = _Sampler(pair, m, seed, _VERIFY)
    y_pq, y_qp = sampler.losses(sigma)
    d_pq = mc.delta_from_losses(y_pq, epsilon, m)[0]
    d_qp = mc.delta_from_losses(y_qp, epsilon, m)[0]
    passed = mc.evr_passes(d_pq, m, delta) and mc.evr_passes(d_qp, m, delta)
    return VerificationResult(passed, epsilon, delta, sigma, d_pq, d_qp, m)


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    bins: int,
    epochs: int,
    *,
    bin_semantics: str = "fixed",
    correlation: Any = None,
    num_samples: int = DEFAULT_NUM_SAMPLES,
    seed: Any = None,
    safety: float = 0.8,
    verify_samples: int | None = None,
    check: bool = True,
    rtol: float = 1e-3,
) -> float:
    """σ for (target_epsilon, delta): bisection (in log σ) on δ̂(σ) = ``safety``·δ with common
    random numbers, then the EVR check of :func:`verify` at δ on fresh samples.

    ``verify_samples`` defaults to ``evr_min_samples(delta, safety)`` (5.4·10⁷ at δ = 1e-5).
    Raises :class:`VerificationFailedError` if the fresh check fails. ``check=False`` skips the
    verification: the result is then only an estimate, not a guarantee.
    """
    target = non_negative_float("target_epsilon", target_epsilon, BallsInBinsError)
    delta = probability("delta", delta, BallsInBinsError, upper_open=True)
    if not 0.0 < safety <= 1.0:
        raise BallsInBinsError(f"safety={safety!r} is out of range; expected a float in (0, 1]")
    pair = dominating_pair(bins, epochs, bin_semantics=bin_semantics, correlation=correlation)
    m = positive_int("num_samples", num_samples, BallsInBinsError)
    root = _root_seed(seed)
    sampler = _Sampler(pair, m, root, _ESTIMATE)
    goal = safety * delta

    def excess(log_sigma: float) -> float:
        est = _estimate(sampler, math.exp(log_sigma), target, 0.5)
        return est.delta - goal

    # Upper bracket: the unamplified Gaussian σ. H(P,Q) ≤ H(worst single mode, Q), since the
    # hockey-stick divergence is convex in P (and, for the reverse direction, in Q).
    hi = math.log(gaussian_sigma(target, goal, pair.sensitivity))
    for _ in range(8):
        if excess(hi) <= 0.0:
            break
        hi += math.log(2.0)
    else:
        raise BallsInBinsError("calibration found no σ with δ̂ ≤ safety·δ; use more num_samples")
    lo = hi - math.log(4.0)
    for _ in range(60):
        if excess(lo) > 0.0:
            break
        lo -= math.log(4.0)
    sigma = math.exp(optimize.brentq(excess, lo, hi, xtol=math.log1p(rtol) / 2))
    sigma *= 1.0 + rtol / 2  # the private side of the root's bracket
    if excess(math.log(sigma)) > 0.0:
        sigma = math.exp(hi)
    if check:
        result = verify(
            sigma,
            bins,
            epochs,
            target,
            delta,
            bin_semantics=bin_semantics,
            correlation=correlation,
            num_samples=verify_samples,
            seed=root,
            safety=safety,
        )
        if not result.passed:
            raise VerificationFailedError(
                f"EVR check failed at noise_multiplier={sigma:.6g}: fresh δ̂ = "
                f"{max(result.delta_pq, result.delta_qp):.3g} with {result.num_samples} samples "
                f"does not certify delta={delta}; raise verify_samples or lower safety"
            )
    return sigma


# --------------------------------------------------------------------------------------------
# analytic Gaussian (b = 1 reference and the calibration bracket)


def gaussian_delta(epsilon: float, sensitivity: float, sigma: float) -> float:
    """Exact δ(ε) of the Gaussian mechanism: Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2), μ = Δ/σ."""
    mu = sensitivity / sigma
    return float(
        stats.norm.cdf(-epsilon / mu + mu / 2)
        - math.exp(epsilon) * stats.norm.cdf(-epsilon / mu - mu / 2)
    )


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """The σ with gaussian_delta(ε, Δ, σ) = δ."""

    def f(log_sigma: float) -> float:
        return gaussian_delta(epsilon, sensitivity, math.exp(log_sigma)) - delta

    lo, hi = math.log(sensitivity) - 10.0, math.log(sensitivity) + 10.0
    return math.exp(optimize.brentq(f, lo, hi, xtol=1e-12))
