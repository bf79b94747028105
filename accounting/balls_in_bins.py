"""Monte Carlo accountant for balls-in-bins sampling with (correlated) Gaussian noise
(Choquette-Choo et al., "Near Exact Privacy Amplification for Matrix Mechanisms").

The accountant's entry point. Its queries: σ for a target (:func:`calibrate_noise_multiplier`)
and certified ε and epochs (:func:`certified_epsilon`, :func:`certified_max_epochs`), all by
Estimate-Verify-Release, here; and the estimates they are built from — δ̂(ε) with standard errors
and a confidence bound (:func:`delta_estimate`), a point estimate of ε(δ) (:func:`epsilon`), the
check of (ε, δ) on fresh samples (:func:`verify`) — from
:mod:`userdp.accounting.balls_in_bins_estimates`, named here too. The mechanism, its two bin
semantics, the dominating pair and how its privacy-loss samples are drawn are in
:mod:`userdp.accounting.balls_in_bins_losses`; both directions are always estimated and the max
is used.

Per-epoch bins compose E independent one-epoch pairs: every query then estimates δ̂ from
one-epoch draws split into E groups (:mod:`userdp.accounting.composed_losses`), so
``num_samples`` counts one-epoch draws and the Chernoff bounds and EVR count ⌊num_samples/E⌋.

Randomness: a seed gives two independent streams (children 0 and 1 of ``SeedSequence(seed)``):
the estimate stream (ε/δ̂ estimates and calibration) and the verify stream. Calibration bisects σ
on fixed estimate-stream samples (common random numbers); verification draws only the verify
stream, which calibration never touches. Each sample's W is shared by both directions.

Calibration aims below the design δ (``safety``·δ) by a KL-Chernoff margin and the verification
is sized for power at the design δ, so that with the default sample counts a calibrated σ passes
its fresh check with probability ≥ 0.99; the certificate (a σ whose true δ exceeds δ passes with
probability ≤ δ) does not depend on the counts. :func:`certified_epsilon` and
:func:`certified_max_epochs` certify ε and the number of epochs the same way.
"""

from __future__ import annotations

import math
from typing import Any

from userdp.accounting import monte_carlo as mc
from userdp.accounting.balls_in_bins_estimates import (
    _TINY,
    DEFAULT_NUM_SAMPLES,
    DEFAULT_REJECTION_PROB,
    DEFAULT_SAFETY,
    DeltaEstimate,
    VerificationFailedError,
    VerificationResult,
    _draws,
    _estimate,
    calibration_samples,
    calibration_target,
    delta_estimate,
    epsilon,
    gaussian_delta,
    gaussian_sigma,
    verify,
)
from userdp.accounting.balls_in_bins_losses import (
    BIN_SEMANTICS,
    ESTIMATE,
    VERIFY,
    BallsInBinsError,
    DominatingPair,
    LossSampler,
    UnsupportedBinSemanticsError,
    _root_seed,
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
    "DEFAULT_NUM_SAMPLES",
    "DEFAULT_REJECTION_PROB",
    "DEFAULT_SAFETY",
    "ESTIMATE",
    "VERIFY",
    "LossSampler",
    "BallsInBinsError",
    "DeltaEstimate",
    "DominatingPair",
    "UnsupportedBinSemanticsError",
    "VerificationFailedError",
    "VerificationResult",
    "calibrate_noise_multiplier",
    "calibration_samples",
    "calibration_target",
    "certified_draws",
    "certified_epsilon",
    "certified_max_epochs",
    "correlation_matrix",
    "delta_estimate",
    "dominating_pair",
    "epsilon",
    "gaussian_delta",
    "gaussian_sigma",
    "verify",
]


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    bins: int,
    epochs: int,
    *,
    bin_semantics: str = "fixed",
    correlation: Any = None,
    num_samples: int | None = None,
    seed: Any = None,
    safety: float = DEFAULT_SAFETY,
    rejection_prob: float = DEFAULT_REJECTION_PROB,
    verify_samples: int | None = None,
    check: bool = True,
    rtol: float = 1e-3,
) -> float:
    """σ for (target_epsilon, delta), certified by Estimate-Verify-Release.

    Estimate: bisection in log σ on ``num_samples`` estimate-stream samples (common random
    numbers) for max(δ̂_PQ, δ̂_QP)(σ) = :func:`calibration_target` (δ, ``num_samples``), so that
    each direction's true δ at the returned σ is ≤ ``safety``·δ except with probability
    ``rejection_prob``/4 (KL-Chernoff, as δ̂(σ) decreases in σ on fixed draws).
    ``num_samples`` defaults to :func:`calibration_samples` (δ).
    Verify: :func:`verify` at ``delta`` on fresh samples, ``verify_samples`` defaulting to
    ``evr_samples(delta, safety, rejection_prob/4)`` (1.5·10⁸ at δ = 1e-5).

    With ``verify_samples=None`` the check passes with probability ≥ 1 − ``rejection_prob``
    (0.99), at any ``num_samples``; whatever the counts, a σ whose true δ exceeds ``delta``
    passes with probability ≤ δ. Raises :class:`VerificationFailedError` if the check fails (σ
    is never raised and re-checked). ``check=False`` skips it: the result is then only an
    estimate, not a guarantee.
    """
    target = non_negative_float("target_epsilon", target_epsilon, BallsInBinsError)
    delta = probability("delta", delta, BallsInBinsError, upper_open=True)
    safety = probability("safety", safety, BallsInBinsError, upper_open=True)
    rejection_prob = probability(
        "rejection_prob", rejection_prob, BallsInBinsError, upper_open=True
    )
    pair = dominating_pair(bins, epochs, bin_semantics=bin_semantics, correlation=correlation)
    m, root = _estimate_setup(delta, num_samples, seed, safety, rejection_prob, pair.compositions)
    goal = _goal(delta, m, pair.compositions, safety, rejection_prob)
    sampler = LossSampler(pair, m, root, ESTIMATE)

    def excess(log_sigma: float) -> float:  # log δ̂ − log goal: nearly linear in log σ
        est = _estimate(sampler, math.exp(log_sigma), target, 0.5)
        return math.log(max(est.delta, _TINY)) - math.log(goal)

    # Upper bracket: the unamplified Gaussian σ. H(P,Q) ≤ H(worst single mode, Q), since the
    # hockey-stick divergence is convex in P (and, for the reverse direction, in Q).
    hi = math.log(gaussian_sigma(target, goal, pair.sensitivity))
    for _ in range(8):
        if excess(hi) <= 0.0:
            break
        hi += math.log(2.0)
    else:
        raise BallsInBinsError("calibration found no σ with δ̂ ≤ its target; use more num_samples")
    lo = hi - math.log(4.0)
    for _ in range(60):
        if excess(lo) > 0.0:
            break
        lo -= math.log(4.0)
    sigma = math.exp(mc.brentq(excess, lo, hi, xtol=math.log1p(rtol) / 2))
    sigma *= 1.0 + rtol / 2  # the private side of the root's bracket
    if excess(math.log(sigma)) > 0.0:
        sigma = math.exp(hi)
    if check:
        _certify(
            f"at noise_multiplier={sigma:.6g}",
            sigma,
            bins,
            epochs,
            target,
            delta,
            bin_semantics=bin_semantics,
            correlation=correlation,
            verify_samples=verify_samples,
            seed=root,
            safety=safety,
            rejection_prob=rejection_prob,
        )
    return sigma


def _estimate_setup(
    delta: float,
    num_samples: int | None,
    seed: Any,
    safety: float,
    rejection_prob: float,
    compositions: int,
) -> tuple[int, Any]:
    """(estimate draws, root seed) of the certified queries: ``num_samples`` defaults to
    :func:`calibration_samples` (δ) independent samples, i.e. that many times ``compositions``
    one-copy draws for a composed pair."""
    if num_samples is None:
        num_samples = certified_draws(delta, compositions, safety, rejection_prob)[0]
    m = positive_int("num_samples", num_samples, BallsInBinsError)
    return m, _root_seed(seed)


def certified_draws(
    delta: float,
    compositions: int,
    safety: float = DEFAULT_SAFETY,
    rejection_prob: float = DEFAULT_REJECTION_PROB,
) -> tuple[int, int]:
    """(estimate draws, verification draws) of :func:`certified_epsilon` and
    :func:`certified_max_epochs` at their default counts, for a pair composed ``compositions``
    times: :func:`calibration_samples` and, for the fresh check (which gets a quarter of
    ``rejection_prob``: half to the Verify step, half of that to each direction),
    :func:`~userdp.accounting.monte_carlo.evr_samples` independent samples."""
    estimate = calibration_samples(delta, safety=safety, rejection_prob=rejection_prob)
    return compositions * estimate, compositions * mc.evr_samples(delta, safety, rejection_prob / 4)


def _goal(delta: float, m: int, compositions: int, safety: float, rejection_prob: float) -> float:
    """:func:`calibration_target` for ``m`` draws of a pair composed ``compositions`` times: its
    Chernoff bounds count ⌊m/compositions⌋ samples (:mod:`userdp.accounting.composed_losses`)."""
    n = _draws("num_samples", m, compositions) // compositions
    return calibration_target(delta, n, safety=safety, rejection_prob=rejection_prob)


def _certify(
    what: str,
    sigma: float,
    bins: int,
    epochs: int,
    epsilon: float,
    delta: float,
    *,
    bin_semantics: str,
    correlation: Any,
    verify_samples: int | None,
    seed: Any,
    safety: float,
    rejection_prob: float,
) -> None:
    """The Verify of Estimate-Verify-Release for the certified queries: :func:`verify` of
    (``epsilon``, ``delta``) at σ on fresh samples with half of ``rejection_prob``; raises
    :class:`VerificationFailedError` (naming ``what`` was checked) when it fails."""
    if verify_samples is None:
        pair = dominating_pair(bins, epochs, bin_semantics=bin_semantics, correlation=correlation)
        verify_samples = certified_draws(delta, pair.compositions, safety, rejection_prob)[1]
    result = verify(
        sigma,
        bins,
        epochs,
        epsilon,
        delta,
        bin_semantics=bin_semantics,
        correlation=correlation,
        num_samples=verify_samples,
        seed=seed,
        safety=safety,
        rejection_prob=rejection_prob / 2,
    )
    if not result.passed:
        raise VerificationFailedError(
            f"EVR check failed {what}: fresh δ̂ = "
            f"{max(result.delta_pq, result.delta_qp):.3g} with {result.num_samples} samples "
            f"does not certify delta={delta} (at the default verify_samples this has "
            f"probability <= rejection_prob={rejection_prob}); another try is a new EVR test "
            "and spends its own delta"
        )


def certified_epsilon(
    noise_multiplier: float,
    bins: int,
    epochs: int,
    delta: float,
    *,
    bin_semantics: str = "fixed",
    correlation: Any = None,
    num_samples: int | None = None,
    seed: Any = None,
    safety: float = DEFAULT_SAFETY,
    rejection_prob: float = DEFAULT_REJECTION_PROB,
    verify_samples: int | None = None,
) -> float:
    """ε at σ for ``delta``, certified by Estimate-Verify-Release, as :func:`calibrate_noise_multiplier`
    certifies σ: the estimate ε̂ is the smallest ε with max(δ̂_PQ, δ̂_QP)(ε) ≤
    :func:`calibration_target` (δ, ``num_samples``) on estimate-stream samples, so each
    direction's true δ at ε̂ is ≤ ``safety``·δ except with probability ``rejection_prob``/4; then
    :func:`verify` checks (ε̂, δ) on fresh samples. Returns ε̂ when the check passes (probability
    ≥ 1 − ``rejection_prob`` at the default ``verify_samples``; a wrong ε̂ passes with probability
    ≤ δ), raises :class:`VerificationFailedError` otherwise."""
    sigma = positive_float("noise_multiplier", noise_multiplier, BallsInBinsError)
    delta = probability("delta", delta, BallsInBinsError, upper_open=True)
    pair = dominating_pair(bins, epochs, bin_semantics=bin_semantics, correlation=correlation)
    e = pair.compositions
    num_samples, root = _estimate_setup(delta, num_samples, seed, safety, rejection_prob, e)
    goal = _goal(delta, num_samples, e, safety, rejection_prob)
    estimate = epsilon(
        sigma,
        bins,
        epochs,
        goal,
        bin_semantics=bin_semantics,
        correlation=correlation,
        num_samples=num_samples,
        seed=root,
    )
    _certify(
        f"at epsilon={estimate:.6g}",
        sigma,
        bins,
        epochs,
        estimate,
        delta,
        bin_semantics=bin_semantics,
        correlation=correlation,
        verify_samples=verify_samples,
        seed=root,
        safety=safety,
        rejection_prob=rejection_prob,
    )
    return estimate


def certified_max_epochs(
    noise_multiplier: float,
    bins: int,
    target_epsilon: float,
    delta: float,
    *,
    max_epochs: int,
    bin_semantics: str = "fixed",
    correlation: Any = None,
    num_samples: int | None = None,
    seed: Any = None,
    safety: float = DEFAULT_SAFETY,
    rejection_prob: float = DEFAULT_REJECTION_PROB,
    verify_samples: int | None = None,
) -> int:
    """The most whole epochs (≤ ``max_epochs``) whose (``target_epsilon``, δ) is certified by
    Estimate-Verify-Release: the largest E whose estimate at :func:`calibration_target` is within
    the target (ε̂ grows with E), then ONE fresh :func:`verify` of (target, δ) at that E. 0 when
    even one epoch exceeds the target; :class:`VerificationFailedError` when the check fails.
    ``correlation`` (fixed bins) must be given for ``max_epochs`` epochs: each E uses its
    leading block."""
    sigma = positive_float("noise_multiplier", noise_multiplier, BallsInBinsError)
    target = non_negative_float("target_epsilon", target_epsilon, BallsInBinsError)
    delta = probability("delta", delta, BallsInBinsError, upper_open=True)
    max_epochs = positive_int("max_epochs", max_epochs, BallsInBinsError)
    composed = dominating_pair(bins, max_epochs, bin_semantics=bin_semantics).compositions > 1
    num_samples, root = _estimate_setup(
        delta, num_samples, seed, safety, rejection_prob, max_epochs if composed else 1
    )
    matrix = correlation_matrix(correlation, bins * max_epochs)

    def block(e: int) -> Any:
        return None if matrix is None else matrix[: bins * e, : bins * e]

    def within(e: int) -> bool:
        eps = epsilon(
            sigma,
            bins,
            e,
            _goal(delta, num_samples, e if composed else 1, safety, rejection_prob),
            bin_semantics=bin_semantics,
            correlation=block(e),
            num_samples=num_samples,
            seed=root,
        )
        return eps <= target

    if not within(1):
        return 0
    lo, hi = 1, max_epochs  # within(lo) holds
    if within(hi):
        lo = hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if within(mid) else (lo, mid)
    _certify(
        f"for {lo} epochs at epsilon={target:g}",
        sigma,
        bins,
        lo,
        target,
        delta,
        bin_semantics=bin_semantics,
        correlation=block(lo),
        verify_samples=verify_samples,
        seed=root,
        safety=safety,
        rejection_prob=rejection_prob,
    )
    return lo
