"""Monte Carlo estimates for balls-in-bins sampling with (correlated) Gaussian noise
(Choquette-Choo et al., "Near Exact Privacy Amplification for Matrix Mechanisms",
arXiv:2410.06266): δ̂(ε) with standard errors and a confidence bound (:func:`delta_estimate`),
a point estimate of ε(δ) (:func:`epsilon`), the Verify check of Estimate-Verify-Release on fresh
samples (:func:`verify`), the calibration target and sample counts, and the analytic Gaussian
(b = 1 reference and calibration bracket). The dominating pair and its privacy-loss samples are
in :mod:`userdp.accounting.balls_in_bins_losses`; the certified queries built from these
estimates in :mod:`userdp.accounting.balls_in_bins`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from userdp.accounting import monte_carlo as mc
from userdp.accounting.balls_in_bins_losses import (
    ESTIMATE,
    VERIFY,
    BallsInBinsError,
    LossSampler,
    dominating_pair,
)
from userdp.accounting.validation import (
    non_negative_float,
    positive_float,
    positive_int,
    probability,
)

__all__ = [
    "DEFAULT_NUM_SAMPLES",
    "DEFAULT_REJECTION_PROB",
    "DEFAULT_SAFETY",
    "DeltaEstimate",
    "VerificationFailedError",
    "VerificationResult",
    "calibration_samples",
    "calibration_target",
    "delta_estimate",
    "epsilon",
    "gaussian_delta",
    "gaussian_sigma",
    "verify",
]

DEFAULT_NUM_SAMPLES = 2**20
DEFAULT_SAFETY = 0.8  # the paper's δ′ = 0.8·δ (its §5.2): the design δ of a calibrated σ
DEFAULT_REJECTION_PROB = 0.01  # designed probability that the fresh check rejects it
_TARGET_FLOOR = 0.75  # default num_samples keeps calibration_target ≥ this · safety·δ
_TINY = 1e-300


class VerificationFailedError(BallsInBinsError):
    """The fresh-sample EVR check did not certify (ε, δ) at the calibrated σ."""


# --------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class DeltaEstimate:
    """δ̂ = max(H(P,Q), H(Q,P)) at ``epsilon`` and σ, with standard errors and a one-sided
    KL-Chernoff upper confidence bound (each direction at failure (1 − confidence)/2).

    ``num_samples`` counts the draws (one epoch each for per-epoch bins);
    ``independent_samples`` is the count the Chernoff bound uses (⌊num_samples/E⌋ for per-epoch
    bins, see :mod:`userdp.accounting.composed_losses`)."""

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
    independent_samples: int

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
    m = _draws("num_samples", num_samples, pair.compositions)
    sampler = LossSampler(pair, m, seed, ESTIMATE)
    return _estimate(sampler, sigma, epsilon, confidence)


def _estimate(
    sampler: LossSampler, sigma: float, epsilon: float, confidence: float
) -> DeltaEstimate:
    pq, qp = sampler.estimates_at(sigma, epsilon)
    d_pq, se_pq = pq.delta(epsilon)
    d_qp, se_qp = qp.delta(epsilon)
    failure = (1.0 - confidence) / 2.0
    n = pq.num_samples
    ucb = max(
        mc.kl_upper_confidence_bound(d + e.roundoff_bound(epsilon), n, failure)
        for d, e in ((d_pq, pq), (d_qp, qp))
    )
    return DeltaEstimate(
        epsilon,
        sigma,
        max(d_pq, d_qp),
        d_pq,
        d_qp,
        se_pq,
        se_qp,
        ucb,
        confidence,
        sampler.num_samples,
        n,
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
    m = _draws("num_samples", num_samples, pair.compositions)
    sampler = LossSampler(pair, m, seed, ESTIMATE)
    return mc.epsilon_from_estimates(list(sampler.estimates(sigma)), delta)


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
    safety: float = DEFAULT_SAFETY,
    rejection_prob: float = DEFAULT_REJECTION_PROB,
) -> VerificationResult:
    """Estimate-Verify-Release check of (ε, δ) at σ on FRESH samples (the verify streams of
    ``seed``, independent of every calibration/estimate draw with the same seed).

    Certificate: passes iff for both directions δ̂ < δ and exp(−m·KL(δ̂ ‖ δ)) ≤ δ, so a σ whose
    true δ exceeds ``delta`` passes with probability ≤ δ whatever m is, and releasing only on a
    pass is (ε, δ)-DP (Theorem 2.1 of "Near Exact Privacy Amplification for Matrix Mechanisms",
    Theorem 9 of Wang et al. 2023, with τδ = δ).

    Power: ``num_samples`` defaults to :func:`~userdp.accounting.monte_carlo.evr_samples`
    (δ, ``safety``, ``rejection_prob``/2): a σ whose true δ is ≤ safety·δ in both directions
    passes with probability ≥ 1 − ``rejection_prob``.
    """
    sigma = positive_float("noise_multiplier", noise_multiplier, BallsInBinsError)
    epsilon = non_negative_float("epsilon", epsilon, BallsInBinsError)
    delta = probability("delta", delta, BallsInBinsError, upper_open=True)
    safety = probability("safety", safety, BallsInBinsError, upper_open=True)
    rejection_prob = probability(
        "rejection_prob", rejection_prob, BallsInBinsError, upper_open=True
    )
    pair = dominating_pair(bins, epochs, bin_semantics=bin_semantics, correlation=correlation)
    if num_samples is None:
        num_samples = pair.compositions * mc.evr_samples(delta, safety, rejection_prob / 2)
    m = _draws("num_samples", num_samples, pair.compositions)
    sampler = LossSampler(pair, m, seed, VERIFY)
    pq, qp = sampler.estimates_at(sigma, epsilon)
    d_pq, d_qp = (e.point(epsilon) + e.roundoff_bound(epsilon) for e in (pq, qp))
    n = pq.num_samples
    passed = mc.evr_passes(d_pq, n, delta) and mc.evr_passes(d_qp, n, delta)
    return VerificationResult(passed, epsilon, delta, sigma, d_pq, d_qp, m)


def calibration_target(
    delta: float,
    num_samples: int,
    *,
    safety: float = DEFAULT_SAFETY,
    rejection_prob: float = DEFAULT_REJECTION_PROB,
) -> float:
    """The estimate δ̂ that :func:`calibrate_noise_multiplier` solves for: the largest δ̂ on
    ``num_samples`` samples that still shows, by KL-Chernoff at failure ``rejection_prob``/4 per
    direction, that the true δ is ≤ ``safety``·δ
    (:func:`~userdp.accounting.monte_carlo.kl_lower_threshold`)."""
    delta = probability("delta", delta, BallsInBinsError, upper_open=True)
    safety = probability("safety", safety, BallsInBinsError, upper_open=True)
    rejection_prob = probability(
        "rejection_prob", rejection_prob, BallsInBinsError, upper_open=True
    )
    num_samples = positive_int("num_samples", num_samples, BallsInBinsError)
    try:
        goal = mc.kl_lower_threshold(safety * delta, num_samples, rejection_prob / 4)
    except ValueError:
        goal = 0.0
    if not goal > 0.0:
        default = calibration_samples(delta, safety=safety, rejection_prob=rejection_prob)
        raise BallsInBinsError(
            f"num_samples={num_samples} is too few to calibrate at delta={delta}: no estimate "
            f"shows δ ≤ safety·δ; use num_samples >= {default} (the default)"
        )
    return goal


def calibration_samples(
    delta: float, *, safety: float = DEFAULT_SAFETY, rejection_prob: float = DEFAULT_REJECTION_PROB
) -> int:
    """The default estimate-stream sample count of :func:`calibrate_noise_multiplier`: at least
    ``DEFAULT_NUM_SAMPLES``, and enough that :func:`calibration_target` is ≥ 3/4 of safety·δ
    (2.2·10⁷ at δ = 1e-5; the confidence margin then costs 1.3–1.5 % of σ)."""
    delta = probability("delta", delta, BallsInBinsError, upper_open=True)
    safety = probability("safety", safety, BallsInBinsError, upper_open=True)
    rejection_prob = probability(
        "rejection_prob", rejection_prob, BallsInBinsError, upper_open=True
    )
    design = safety * delta
    floor = math.log(4.0 / rejection_prob) / mc.kl_bernoulli(_TARGET_FLOOR * design, design)
    return max(DEFAULT_NUM_SAMPLES, math.ceil(floor))


# --------------------------------------------------------------------------------------------
# analytic Gaussian (b = 1 reference and the calibration bracket)


def gaussian_delta(epsilon: float, sensitivity: float, sigma: float) -> float:
    """Exact δ(ε) of the Gaussian mechanism: Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2), μ = Δ/σ."""
    mu = sensitivity / sigma
    return float(
        _normal_cdf(-epsilon / mu + mu / 2)
        - math.exp(epsilon) * _normal_cdf(-epsilon / mu - mu / 2)
    )


def _normal_cdf(x: float) -> float:
    """Φ(x) = erfc(−x/√2)/2 (accurate in both tails, unlike 1 − Φ(−x))."""
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float) -> float:
    """The σ with gaussian_delta(ε, Δ, σ) = δ."""

    def f(log_sigma: float) -> float:
        return gaussian_delta(epsilon, sensitivity, math.exp(log_sigma)) - delta

    lo, hi = math.log(sensitivity) - 10.0, math.log(sensitivity) + 10.0
    return math.exp(mc.brentq(f, lo, hi, xtol=1e-12))


def _draws(name: str, value: Any, compositions: int) -> int:
    """A positive draw count that fills every group of a pair composed ``compositions`` times."""
    m = positive_int(name, value, BallsInBinsError)
    if m < compositions:
        raise BallsInBinsError(
            f"{name}={m} is fewer than the {compositions} epochs of per-epoch bins; "
            f"use {name} >= {compositions}"
        )
    return m
