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
optimum. δ̂ is the balls-in-bins Monte Carlo estimate (:mod:`userdp.accounting.balls_in_bins_losses`,
both directions, max) on FIXED draws (k, g): common random numbers, so σ(C) and the loss are
deterministic, continuous functions of the BLT parameters. The draws use the Cholesky factor of
the Gram matrix G = MᵀM (W = L g), which moves continuously with C (an eigen-factor would not).

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
from userdp.accounting.balls_in_bins import gaussian_sigma
from userdp.strategies.blt import (
    Blt,
    BltError,
    decode_pair,
    min_sep_column,
    objective_error,
    optimize_blt,
)

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
    """σ(C) on fixed draws: mode indices k and standard normals g, in chunks of ``_CHUNK``."""

    def __init__(self, bins: int, num_samples: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.bins = bins
        self.k = rng.integers(0, bins, size=num_samples)
        self.g = rng.standard_normal((num_samples, bins), dtype=np.float32)

    def sigma(self, gram: np.ndarray, epsilon: float, delta: float) -> float:
        chol = np.linalg.cholesky(gram).astype(np.float32)
        w = self.g @ chol.T  # W ~ N(0, G)
        diag = np.diag(gram)
        log_b = math.log(self.bins)
        m = len(self.k)

        def delta_hat(sigma: float) -> float:
            total_pq = total_qp = 0.0
            for start in range(0, m, _CHUNK):
                part = slice(start, start + _CHUNK)
                base = w[part] / sigma - (0.5 * diag / sigma**2).astype(np.float32)
                y_qp = -(_logsumexp(base) - log_b)
                base += (gram[self.k[part]] / sigma**2).astype(np.float32)
                y_pq = _logsumexp(base) - log_b
                total_pq += _hockey_stick_sum(y_pq, epsilon)
                total_qp += _hockey_stick_sum(y_qp, epsilon)
            return max(total_pq, total_qp) / m

        def excess(log_sigma: float) -> float:
            return math.log(max(delta_hat(math.exp(log_sigma)), 1e-300)) - math.log(delta)

        hi = math.log(gaussian_sigma(epsilon, delta, math.sqrt(float(diag.max()))))
        while excess(hi) > 0.0:
            hi += math.log(2.0)
        lo = hi - math.log(4.0)
        while excess(lo) <= 0.0:
            lo -= math.log(4.0)
        return math.exp(sopt.brentq(excess, lo, hi, xtol=1e-4))


_CHUNK = 2**15


def _logsumexp(x: np.ndarray) -> np.ndarray:
    """log Σ over the last axis, in float64 (exp in float32)."""
    peak = x.max(axis=1)
    return np.log(np.exp(x - peak[:, None]).sum(axis=1, dtype=np.float64)) + peak


def _hockey_stick_sum(losses: np.ndarray, epsilon: float) -> float:
    return float(np.sum(-np.expm1(np.minimum(epsilon - losses, 0.0))))


def _gram(coefs: np.ndarray, bins: int, epochs: int) -> np.ndarray:
    """G = MᵀM, M[:, i] = Σ_j C e_{bj+i} for C's first column ``coefs`` over bins·epochs steps."""
    return _shifted_gram(min_sep_column(coefs, bins, epochs), bins)


def _shifted_gram(column: np.ndarray, bins: int) -> np.ndarray:
    """MᵀM for mode 0 = ``column`` (:func:`~userdp.strategies.blt.min_sep_column`): mode i is
    mode 0 shifted down by i rows."""
    n = len(column)
    modes = np.zeros((n, bins))
    for i in range(bins):
        modes[i:, i] = column[: n - i]
    return modes.T @ modes


def amplified_sigma(
    blt: Blt, bins: int, epochs: int, epsilon: float, delta: float, *, num_samples: int, seed: int
) -> float:
    """σ with δ̂(ε) = δ for ``blt`` under fixed balls-in-bins, on ``num_samples`` draws of
    ``seed`` (an estimate, for comparing BLTs; not a certified σ)."""
    gram = _gram(blt.toeplitz_coefs(bins * epochs), bins, epochs)
    return _FixedDraws(bins, num_samples, seed).sigma(gram, epsilon, delta)


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
    ‖row_t(A C⁻¹)‖²; see the module docstring), and the unamplified optimum for comparison."""
    error = objective_error(objective)
    if min(bins, epochs, buffers) < 1:
        raise BltError(f"bins={bins}, epochs={epochs}, buffers={buffers}; expected integers >= 1")
    if not (epsilon > 0.0 and 0.0 < delta < 1.0):
        raise BltError(f"epsilon={epsilon}, delta={delta}; expected epsilon > 0, 0 < delta < 1")
    n, d = bins * epochs, buffers
    draws = _FixedDraws(bins, num_samples, seed)
    start_blt, _ = optimize_blt(n, d, min_sep=bins, participations=epochs, objective=objective)
    evaluations = 0

    def log_loss(params: np.ndarray) -> float:
        nonlocal evaluations
        evaluations += 1
        decoded = decode_pair(params, d, n)
        if decoded is None:
            return math.inf
        _, _, coefs, inverse = decoded
        column, err = min_sep_column(coefs, bins, epochs), error(inverse)
        if not math.isfinite(float(column @ column) * err):  # the unamplified loss overflows
            return math.inf
        sigma = draws.sigma(_shifted_gram(column, bins), epsilon, delta)
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
    final = _FixedDraws(bins, final_samples, seed + 1)

    def measured(candidate: Blt) -> tuple[float, float]:
        sigma = final.sigma(_gram(candidate.toeplitz_coefs(n), bins, epochs), epsilon, delta)
        return sigma, sigma**2 * error(candidate.inverse_coefs(n))

    sigma, loss = measured(blt)
    start_sigma, start_loss = measured(start_blt)
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
