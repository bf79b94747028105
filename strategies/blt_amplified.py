"""BLT parameters optimized for balls-in-bins amplification (Choquette-Choo et al., "Near Exact
Privacy Amplification for Matrix Mechanisms", arXiv:2410.06266, §4.2).

:func:`~userdp.strategies.blt.optimize_blt` minimizes sens²(C)·error(C⁻¹), the loss of a matrix
mechanism WITHOUT amplification: σ proportional to the sensitivity. Under balls-in-bins sampling
with bins fixed for the run (b bins, E epochs, n = bE steps) the σ that reaches (ε, δ) depends on
C through the whole b-mode dominating pair, not only through its sensitivity.
:func:`optimize_blt_amplified` therefore minimizes

    loss(C) = σ(C)² · error(C⁻¹),    σ(C): δ̂(ε; σ, C) = δ,

for one of two errors (:data:`~userdp.strategies.blt.OBJECTIVES`, A the n×n prefix-sum matrix):

* ``"rmse"`` (the paper's objective, §4.2 and §5.1): error = ‖A C⁻¹‖²_F / n, so
  loss = RMSE², the squared root-mean-squared error of the n prefix sums of x + σC⁻¹z;
* ``"max-error"``: error = max_t ‖row_t(A C⁻¹)‖², the largest prefix sum's squared error.

The paper writes the RMSE as σ·‖A C⁻¹‖_F; the 1/√n here is a constant that does not move the
optimum. δ̂ is the balls-in-bins accountant's own Monte Carlo estimate (its modes, Gram matrix and
loss sampler, :mod:`userdp.accounting.balls_in_bins_losses`, both directions, max) on FIXED draws
(k, g) of one seed: common random numbers, so σ(C) and the loss are deterministic, continuous
functions of the BLT parameters. The sampler uses the Cholesky factor of the Gram matrix G = MᵀM
(W = L g), which moves continuously with C.

Search: Nelder–Mead over the same (θ, θ̂) logits as :func:`~userdp.strategies.blt.optimize_blt`,
started from its unamplified optimum for the same objective (C stays non-negative: ω > 0). Few
draws suffice inside the search (the paper uses as few as 2⁹ at δ = 1e-5, §5.1.4): σ there is a
proxy that ranks BLTs; the σ a run uses must come from the accountant on the returned C
(``userdp account calibrate --mechanism balls-in-bins --bin-semantics fixed --correlation ...``),
which this module reports as the estimate on ``final_samples`` fresh draws and leaves
certification to the accountant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize as sopt
from userdp.accounting.balls_in_bins_estimates import gaussian_sigma
from userdp.accounting.balls_in_bins_losses import (
    ESTIMATE,
    DominatingPair,
    LossSampler,
    toeplitz_modes,
)
from userdp.strategies.blt import Blt, BltError, decode_pair, objective_error, optimize_blt

__all__ = ["AmplifiedBlt", "amplified_sigma", "optimize_blt_amplified"]


@dataclass(frozen=True)
class AmplifiedBlt:
    """The optimized BLT and the figures that compare it with the unamplified optimum of the same
    objective, all with σ from the same estimator (``final_samples`` draws of a fresh seed);
    ``loss`` is σ²·error(C⁻¹) (for ``"rmse"``, RMSE²)."""

    objective: str
    blt: Blt
    noise_multiplier: float
    loss: float
    unamplified_blt: Blt
    unamplified_noise_multiplier: float
    unamplified_loss: float
    evaluations: int


class _FixedDraws:
    """σ(C) on fixed draws: the balls-in-bins accountant's own loss sampler
    (:class:`~userdp.accounting.balls_in_bins_losses.LossSampler`, its estimate stream of
    ``seed``) on the pair of C's modes, so every C sees the same mode indices k and normals g."""

    def __init__(self, num_samples: int, seed: int) -> None:
        self.num_samples = num_samples
        self.seed = seed

    def sigma(self, modes: np.ndarray, epsilon: float, delta: float) -> float:
        pair = DominatingPair.of_modes(modes)
        sampler = LossSampler(pair, self.num_samples, self.seed, ESTIMATE)

        def excess(log_sigma: float) -> float:
            estimates = sampler.estimates(math.exp(log_sigma))
            delta_hat = max(estimate.point(epsilon) for estimate in estimates)
            return math.log(max(delta_hat, 1e-300)) - math.log(delta)

        hi = math.log(gaussian_sigma(epsilon, delta, pair.sensitivity))
        while excess(hi) > 0.0:
            hi += math.log(2.0)
        lo = hi - math.log(4.0)
        while excess(lo) <= 0.0:
            lo -= math.log(4.0)
        return math.exp(sopt.brentq(excess, lo, hi, xtol=1e-4))


def amplified_sigma(
    blt: Blt, bins: int, epochs: int, epsilon: float, delta: float, *, num_samples: int, seed: int
) -> float:
    """σ with δ̂(ε) = δ for ``blt`` under fixed balls-in-bins, on ``num_samples`` draws of
    ``seed`` (an estimate, for comparing BLTs; not a certified σ)."""
    modes = toeplitz_modes(blt.toeplitz_coefs(bins * epochs), bins, epochs)
    return _FixedDraws(num_samples, seed).sigma(modes, epsilon, delta)


def optimize_blt_amplified(
    bins: int,
    epochs: int,
    buffers: int,
    epsilon: float,
    delta: float,
    *,
    num_samples: int = 2**12,
    final_samples: int = 2**18,
    seed: int = 0,
    max_evaluations: int = 400,
    objective: str = "rmse",
) -> AmplifiedBlt:
    """The BLT with ``buffers`` buffers minimizing σ(C)²·error(C⁻¹) under fixed balls-in-bins,
    the error ``objective``'s (``"rmse"``: ‖A C⁻¹‖²_F / n; ``"max-error"``: max_t
    ‖row_t(A C⁻¹)‖²; see the module docstring), and the unamplified optimum (the search's
    start) for comparison. The search ranks BLTs on ``num_samples`` draws; the result is chosen
    on the final measurement (``final_samples`` fresh draws): the search's end, unless the start
    measures no worse there, so it is never worse than its start on that measurement."""
    error = objective_error(objective)
    if min(bins, epochs, buffers) < 1:
        raise BltError(f"bins={bins}, epochs={epochs}, buffers={buffers}; expected integers >= 1")
    if not (epsilon > 0.0 and 0.0 < delta < 1.0):
        raise BltError(f"epsilon={epsilon}, delta={delta}; expected epsilon > 0, 0 < delta < 1")
    n, d = bins * epochs, buffers
    draws = _FixedDraws(num_samples, seed)
    start_blt, _ = optimize_blt(n, d, min_sep=bins, participations=epochs, objective=objective)
    evaluations = 0

    def log_loss(params: np.ndarray) -> float:
        nonlocal evaluations
        evaluations += 1
        decoded = decode_pair(params, d, n)
        if decoded is None:
            return math.inf
        _, _, coefs, inverse = decoded
        modes, err = toeplitz_modes(coefs, bins, epochs), error(inverse)
        column = modes[:, 0]
        if not math.isfinite(float(column @ column) * err):  # the unamplified loss overflows
            return math.inf
        sigma = draws.sigma(modes, epsilon, delta)
        return math.log(sigma**2 * err)  # log: the simplex sees relative changes

    start = _start_params(start_blt)
    result = sopt.minimize(
        log_loss,
        start,
        method="Nelder-Mead",
        options={"maxfev": max_evaluations, "xatol": 1e-4, "fatol": 1e-5},
    )
    best = result.x if result.fun <= log_loss(start) else start
    theta, omega, _, _ = decode_pair(best, d, n)
    order = np.argsort(-theta)
    blt = Blt(tuple(theta[order]), tuple(omega[order]))
    final = _FixedDraws(final_samples, seed + 1)

    def measured(candidate: Blt) -> tuple[float, float]:
        modes = toeplitz_modes(candidate.toeplitz_coefs(n), bins, epochs)
        sigma = final.sigma(modes, epsilon, delta)
        return sigma, sigma**2 * error(candidate.inverse_coefs(n))

    sigma, loss = measured(blt)
    start_sigma, start_loss = measured(start_blt)
    if start_loss <= loss:
        # the search's objective is a noisy proxy (few draws): the final, finer measurement
        # decides, and the result is never worse than the start on it
        blt, sigma, loss = start_blt, start_sigma, start_loss
    return AmplifiedBlt(
        objective, blt, sigma, loss, start_blt, start_sigma, start_loss, evaluations
    )


def _start_params(blt: Blt) -> np.ndarray:
    """The (θ, θ̂) logits of ``blt``. θ̂ are the decays of C⁻¹: the roots w of
    1 + Σ_j ω_j/(w − θ_j) = 0 (the zeros of C's generating function in w = 1/z), i.e. the
    eigenvalues of diag(θ) − 1ωᵀ (matrix determinant lemma)."""
    theta = np.asarray(blt.buf_decay)
    omega = np.asarray(blt.output_scale)
    theta_hat = np.linalg.eigvals(np.diag(theta) - np.outer(np.ones_like(omega), omega)).real
    both = np.clip(np.concatenate([theta, np.sort(theta_hat)[::-1]]), 1e-9, 1 - 1e-9)
    return np.log(both / (1 - both))
