"""The ε that userdp states for balls-in-bins sampling: the smallest certified upper bound.

Every ε of a balls-in-bins run — the ledger's budget check, the summary line, the progress bar,
the metrics, ``userdp_release.json``, the report and σ's calibration — is :func:`certified_epsilon`
of the same query (mechanism, epochs, δ): a deterministic function of it, cached on disk, so the
same question gets the same answer everywhere and every time. It is the smallest value among the
methods that apply, each an upper bound on ε(δ):

- ``random-allocation PLD`` (C = I): the dominating PLD of Feldman & Shenfeld, "Efficient
  Privacy Loss Accounting for Subsampling and Random Allocation" (arXiv 2602.17284), through
  :mod:`userdp.accounting.random_allocation`: deterministic, tight to a few percent, any δ;
- ``no amplification`` (any C): the Gaussian mechanism of sensitivity √compositions·maxᵢ‖mᵢ‖ of
  the dominating pair (Choquette-Choo et al., "Near Exact Privacy Amplification for Matrix
  Mechanisms", arXiv 2410.06266, Lemma 3.2) — the hockey-stick divergence is jointly convex, so
  the b-mode mixture is no worse than its worst mode, in both directions. Deterministic, exact
  (closed form), loose: it ignores the sampling;
- ``sampling-free Rényi DP`` (correlated C): Rényi divergences of the dominating pair, exact in
  the remove direction and bounded (geometric or harmonic mean) in the add direction, summed
  over count vectors by a dynamic program that keeps two off-diagonals of its Gram matrix
  exactly and bounds the rest (:mod:`userdp.accounting.balls_in_bins_renyi`). Deterministic,
  any δ, 4–5 CPU s at b = 128; amplified (at σ = 4, b = 128, E = 16 about 0.33× the Gaussian
  bound for a 3-band C and 0.8× for a 2-buffer BLT), looser than Monte Carlo where that runs;
- ``Monte Carlo EVR`` (correlated C): Estimate-Verify-Release on the dominating pair
  (:func:`userdp.accounting.balls_in_bins.certified_epsilon`): an upper bound except with
  probability at most δ over its verification samples. Its draws grow as 1/δ, so it is attempted
  only while they fit :data:`MONTE_CARLO_DRAW_LIMIT`; its samples are seeded from the query
  (sha256 of the mechanism without σ, epochs and δ), so the report, the ledger and σ's
  calibration see the same value, and every σ of a calibration the same draws. A failed check (about 1 % likely for a correct estimate) leaves the other methods.

The Monte Carlo point estimate is never one of them: it is below the true ε about half of the
time (:func:`userdp.accounting.balls_in_bins.epsilon` computes it, for comparison only).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Any

import numpy as np
from scipy import special
from userdp.accounting import balls_in_bins, balls_in_bins_renyi, random_allocation
from userdp.accounting.calibration import _cached
from userdp.accounting.mechanisms import BallsInBinsMechanism

__all__ = [
    "METHODS",
    "MONTE_CARLO_DRAW_LIMIT",
    "CertifiedEpsilon",
    "certified_epsilon",
    "gaussian_epsilon",
    "monte_carlo_draws",
    "query_seed",
    "random_allocation_bounds",
]

RANDOM_ALLOCATION = "random-allocation PLD"
NO_AMPLIFICATION = "no amplification"
RENYI = "sampling-free Rényi DP"
MONTE_CARLO = "Monte Carlo EVR"
METHODS = (RANDOM_ALLOCATION, RENYI, NO_AMPLIFICATION, MONTE_CARLO)

MONTE_CARLO_DRAW_LIMIT = 6 * 10**7
"""Estimate plus verification draws (each a b-dimensional sample) above which the Monte Carlo
method is not attempted: about a CPU minute here. At δ = 10⁻⁵ one epoch needs 1.7·10⁸."""


@dataclasses.dataclass(frozen=True)
class CertifiedEpsilon:
    """``epsilon``: the smallest certified upper bound on ε(δ); ``method``: which method gave it;
    ``candidates``: each method's value (None: it does not apply or did not certify), with the
    reason in ``skipped``."""

    epsilon: float
    method: str
    candidates: dict[str, float | None]
    skipped: dict[str, str]
    seed: str | None = None
    """The Monte Carlo method's seed (decimal), when it was attempted."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self, delta: float) -> str:
        """What was computed, in the report's words."""
        values = ", ".join(
            f"{name}: {value:.4g}" if value is not None else f"{name}: n/a ({self.skipped[name]})"
            for name, value in self.candidates.items()
        )
        return (
            f"ε is the smallest certified upper bound on ε(δ = {delta:.3g}) among the balls-in-bins "
            f"accountant's methods, here the {self.method} bound ({values}). No Monte Carlo point "
            "estimate is stated as ε."
        )


def query_seed(mechanism: BallsInBinsMechanism, epochs: int, delta: float) -> int:
    """The Monte Carlo method's seed: 128 bits of sha256 over the query WITHOUT σ, so that every σ
    of one calibration is estimated and verified on the same draws (common random numbers: the
    estimate is monotone in σ on them, and σ's search does not pick among independent
    verifications)."""
    described = {**mechanism.to_dict(), "noise_multiplier": None}
    text = json.dumps(
        {"mechanism": described, "epochs": int(epochs), "delta": float(delta)}, sort_keys=True
    )
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:16], "big")


def gaussian_epsilon(mu: float, delta: float) -> float:
    """ε(δ) of the Gaussian mechanism with sensitivity/σ = ``mu`` (Balle & Wang, "Improving the
    Gaussian Mechanism for Differential Privacy", Theorem 8): the smallest ε with
    Φ(μ/2 − ε/μ) − e^ε·Φ(−μ/2 − ε/μ) ≤ δ, found by bisection and returned on the private side."""

    def excess(eps: float) -> float:
        a = special.log_ndtr(mu / 2 - eps / mu)
        b = eps + special.log_ndtr(-mu / 2 - eps / mu)
        if a == -math.inf:
            return -delta
        return math.exp(a) * -math.expm1(b - a) - delta if b > -math.inf else math.exp(a) - delta

    if excess(0.0) <= 0:
        return 0.0
    low, high = 0.0, 1.0
    while excess(high) > 0:
        low, high = high, 2 * high
    for _ in range(200):
        if high - low <= 1e-12 * high:
            break
        middle = 0.5 * (low + high)
        if excess(middle) > 0:
            low = middle
        else:
            high = middle
    return high


def monte_carlo_draws(compositions: int, delta: float) -> int:
    """Estimate plus verification draws of the Monte Carlo method at ``delta`` for a pair
    composed ``compositions`` times (:func:`userdp.accounting.balls_in_bins.certified_draws`)."""
    estimate, verify = balls_in_bins.certified_draws(delta, compositions)
    return estimate + verify


def certified_epsilon(
    mechanism: BallsInBinsMechanism, epochs: int, delta: float, *, use_cache: bool = True
) -> CertifiedEpsilon:
    """The certified ε(δ) of ``epochs`` epochs of ``mechanism`` (module docstring); cached on disk
    under the same rules as calibration (:func:`userdp.accounting.calibration.cache_dir`)."""
    query = {
        "op": "certified_balls_in_bins_epsilon",
        "mechanism": mechanism.to_dict(),
        "epochs": int(epochs),
        "delta": float(delta),
        "monte_carlo_draw_limit": MONTE_CARLO_DRAW_LIMIT,
    }
    stored = _cached(query, use_cache, lambda: _compute(mechanism, epochs, delta).to_dict())
    return CertifiedEpsilon(**stored)


def random_allocation_bounds(
    pair: balls_in_bins.DominatingPair, sigma: float, delta: float
) -> tuple[float, float] | None:
    """(upper, lower) bounds on ε(δ) from the random-allocation PLD when the pair's modes are
    orthogonal and of one norm g = ‖mᵢ‖² (C = I, or any C that leaves them so): random
    allocation at σ/√g per participation, composed ``pair.compositions`` times (per-epoch bins:
    E epochs; fixed bins with C = I: g = E, one epoch). None for any other pair."""
    norm_sq = float(pair.gram[0, 0])
    if not (norm_sq > 0 and bool((pair.gram == norm_sq * np.eye(pair.bins)).all())):
        return None
    return random_allocation.allocation_epsilon_bounds(
        sigma / math.sqrt(norm_sq), pair.bins, pair.compositions, delta
    )


def _compute(mechanism: BallsInBinsMechanism, epochs: int, delta: float) -> CertifiedEpsilon:
    candidates: dict[str, float | None] = {}
    skipped: dict[str, str] = {}
    sigma = mechanism.noise_multiplier
    pair = balls_in_bins.dominating_pair(
        mechanism.bins,
        epochs,
        bin_semantics=mechanism.bin_semantics,
        correlation=mechanism.correlation,
    )
    bounds = random_allocation_bounds(pair, sigma, delta)
    seed = None
    if bounds is not None:
        candidates[RANDOM_ALLOCATION] = bounds[0]
        skipped[MONTE_CARLO] = "the random-allocation PLD applies (deterministic, tighter)"
        skipped[RENYI] = "the random-allocation PLD applies (deterministic, tighter)"
    else:
        skipped[RANDOM_ALLOCATION] = "correlated noise (C ≠ I)"
        candidates[RENYI] = balls_in_bins_renyi.renyi_epsilon(
            pair.gram, pair.compositions, sigma, delta
        ).epsilon
        draws = monte_carlo_draws(pair.compositions, delta)
        if draws > MONTE_CARLO_DRAW_LIMIT:
            skipped[MONTE_CARLO] = (
                f"{draws:.3g} draws at δ = {delta:.3g} exceed the limit "
                f"{MONTE_CARLO_DRAW_LIMIT:.3g}"
            )
        else:
            seed = query_seed(mechanism, epochs, delta)
            try:
                candidates[MONTE_CARLO] = float(
                    balls_in_bins.certified_epsilon(
                        sigma,
                        mechanism.bins,
                        epochs,
                        delta,
                        bin_semantics=mechanism.bin_semantics,
                        correlation=mechanism.correlation,
                        seed=seed,
                    )
                )
            except balls_in_bins.VerificationFailedError:
                skipped[MONTE_CARLO] = "the fresh-sample check failed; nothing certified"
    candidates[NO_AMPLIFICATION] = gaussian_epsilon(pair.sensitivity / sigma, delta)
    candidates = {name: candidates.get(name) for name in METHODS}
    finite = {name: value for name, value in candidates.items() if value is not None}
    method = min(finite, key=lambda name: finite[name])
    return CertifiedEpsilon(
        epsilon=float(finite[method]),
        method=method,
        candidates=candidates,
        skipped=skipped,
        seed=None if seed is None else str(seed),
    )
