"""Correlated noise for DP-FTRL / matrix mechanisms: buffered linear Toeplitz (BLT) and banded C.

A matrix mechanism releases x_t + σ·(C⁻¹Z)_t for a lower-triangular Toeplitz strategy matrix C
(Near Exact Privacy Amplification for Matrix Mechanisms, §2). All releases together are
post-processing of CX + σZ, one Gaussian mechanism whose sensitivity is the norm of C's
participating columns.

C itself (its coefficients, inverse and dense form, and the parameters the streams below run on)
comes from :mod:`userdp.accounting.correlation`, the module the accountant builds C with:
:class:`Blt` is its :class:`~userdp.accounting.correlation.BltCorrelation`, :class:`BandedNoise`
holds a :class:`~userdp.accounting.correlation.BandedCorrelation`. This module streams C⁻¹Z
(:class:`CorrelatedNoise`: :class:`BltNoise`, :class:`BandedNoise`) with C's own
:meth:`~userdp.accounting.correlation.Correlation.inverse_step`, and optimizes C.

Optimization (:func:`optimize_blt`) minimizes loss(C) = sens²(C; b, k) · error(C⁻¹), A the
prefix-sum matrix, for one of two errors (:data:`OBJECTIVES`): ``"max-error"``, jax_privacy's
max_t ‖row_t(A C⁻¹)‖² (the default), or ``"rmse"``, the mean ‖A C⁻¹‖²_F / n (the squared RMSE of
prefix sums, §1.2 of "Near Exact Privacy Amplification for Matrix Mechanisms", arXiv:2410.06266).
The search runs over the ``buf_decay_pair`` parameterization (θ, θ̂) → (ω, ω̂) in closed form
(Lemma 5.2 of 2404.16706), with numpy/scipy instead of JAX. Pinned against jax_privacy 2.0.0
(max error): n=1000 single participation, 3 buffers → 10.692; n=1000, min_sep=100, k=10,
2 buffers → 223.591. :func:`optimize_banded` fits banded coefficients to the same objectives.

The buffers are checkpointed (a resumed run must continue the SAME correlated stream); they are
secret like the noise itself, so checkpoints must be protected like the model's noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from scipy import optimize as sopt
from userdp.accounting.correlation import (
    BandedCorrelation,
    BltCorrelation,
    Correlation,
    CorrelationError,
    min_sep_column,
    toeplitz_matrix,
)
from userdp.accounting.correlation_spec import CorrelationSpec
from userdp.accounting.validation import positive_int
from userdp.strategies import tensors as T
from userdp.strategies.noise import NoiseMechanism, NoiseRng

__all__ = [
    "Blt",
    "BltError",
    "BandedNoise",
    "BltNoise",
    "CorrelatedNoise",
    "OBJECTIVES",
    "banded_inverse_coefs",
    "max_error",
    "mean_error",
    "decode_pair",
    "min_sep_column",
    "min_sep_sensitivity_squared",
    "optimize_banded",
    "optimize_blt",
    "toeplitz_matrix",
]


class BltError(CorrelationError):
    """Invalid BLT / banded parameters or noise-stream state."""


@dataclass(frozen=True)
class Blt(BltCorrelation):
    """A BLT strategy matrix: ``buf_decay`` θ and ``output_scale`` ω (c_0 = 1).

    ``toeplitz_coefs(n)``, ``inverse_coefs(n)`` and ``matrix(n)`` are the accountant's
    (:class:`~userdp.accounting.correlation.BltCorrelation`); :class:`BltNoise` streams with
    these same (θ, ω)."""

    def __post_init__(self) -> None:
        try:
            super().__post_init__()
        except CorrelationError as exc:
            raise BltError(str(exc)) from None

    @property
    def buffers(self) -> int:
        return len(self.buf_decay)

    def correlation(self) -> CorrelationSpec:
        """The accountant's description of C (``userdp.accounting.mechanisms.CorrelationSpec``)."""
        return self.spec()


# ---------------------------------------------------------------------------------------------
# objective pieces


def max_error(inverse_coefs: np.ndarray) -> float:
    """max_t ‖row_t(A C⁻¹)‖² = Σ_{i<n} (Σ_{j≤i} ĉ_j)² for Toeplitz C⁻¹ (the last row is max)."""
    return float(np.sum(np.cumsum(inverse_coefs) ** 2))


def mean_error(inverse_coefs: np.ndarray) -> float:
    """‖A C⁻¹‖²_F / n = (1/n) Σ_{i<n} (n − i)(Σ_{j≤i} ĉ_j)² for Toeplitz C⁻¹: the squared error
    of the n prefix sums, averaged (RMSE² at σ = 1, §1.2 of arXiv:2410.06266)."""
    prefix = np.cumsum(inverse_coefs)
    n = len(prefix)
    return float(np.sum((n - np.arange(n)) * prefix**2) / n)


OBJECTIVES: dict[str, Callable[[np.ndarray], float]] = {
    "max-error": max_error,
    "rmse": mean_error,
}
"""The error of A C⁻¹ each objective name stands for (a function of C⁻¹'s first column)."""


def objective_error(objective: str) -> Callable[[np.ndarray], float]:
    """The error function of ``objective`` (:data:`OBJECTIVES`)."""
    try:
        return OBJECTIVES[objective]
    except KeyError:
        raise BltError(
            f"objective={objective!r} is not known; expected one of {', '.join(OBJECTIVES)}"
        ) from None


def min_sep_sensitivity_squared(coefs: np.ndarray, min_sep: int = 1, participations: int = 1):
    """sens² = ‖u‖² of :func:`min_sep_column` (jax_privacy
    ``toeplitz.minsep_sensitivity_squared``)."""
    column = min_sep_column(coefs, min_sep, participations)
    return float(column @ column)


def omega_from_theta_pair(theta: np.ndarray, theta_hat: np.ndarray) -> np.ndarray:
    """ω_i = ∏_j (θ_i − θ̂_j) / ∏_{j≠i} (θ_i − θ_j) (Lemma 5.2 of "Efficient and Near-Optimal Noise Generation for Streaming Differential Privacy")."""
    diff_hat = theta[:, None] - theta_hat[None, :]
    diff = theta[:, None] - theta[None, :]
    np.fill_diagonal(diff, 1.0)
    return np.prod(diff_hat, axis=1) / np.prod(diff, axis=1)


def blt_loss(blt: Blt, n: int, min_sep: int = 1, participations: int = 1) -> float:
    """sens²(C) · max error(C⁻¹): jax_privacy's ``max_loss`` (unnormalized)."""
    sens2 = min_sep_sensitivity_squared(blt.toeplitz_coefs(n), min_sep, participations)
    return sens2 * max_error(blt.inverse_coefs(n))


def decode_pair(params: np.ndarray, d: int, n: int) -> tuple[np.ndarray, ...] | None:
    """(θ, ω, c, ĉ) of the (θ, θ̂) logits ``params`` (C's and C⁻¹'s first columns over n steps),
    or None outside the search box or when (θ, θ̂) does not give ω > 0 > ω̂."""
    if np.max(np.abs(params)) > 25.0:  # θ within 1.4e-11 of 0 or 1: outside the search box
        return None
    theta = 1.0 / (1.0 + np.exp(-params[:d]))
    theta_hat = 1.0 / (1.0 + np.exp(-params[d:]))
    if np.min(np.abs(np.subtract.outer(theta, theta) + np.eye(d))) < 1e-9:
        return None
    omega = omega_from_theta_pair(theta, theta_hat)
    omega_hat = omega_from_theta_pair(theta_hat, theta)
    if not ((omega > 0).all() and (omega_hat < 0).all()):  # NaN fails too
        return None
    coefs = BltCorrelation(theta, omega).toeplitz_coefs(n)
    inverse = BltCorrelation(theta_hat, omega_hat).toeplitz_coefs(n)  # C⁻¹ is the BLT (θ̂, ω̂)
    return theta, omega, coefs, inverse


def _pair_loss(
    params: np.ndarray,
    d: int,
    n: int,
    min_sep: int,
    participations: int,
    error: Callable[[np.ndarray], float] = max_error,
) -> tuple[float, np.ndarray | None, np.ndarray | None]:
    decoded = decode_pair(params, d, n)
    if decoded is None:
        return math.inf, None, None
    theta, omega, coefs, inverse = decoded
    loss = min_sep_sensitivity_squared(coefs, min_sep, participations) * error(inverse)
    return (loss if math.isfinite(loss) else math.inf), theta, omega


def optimize_blt(
    n: int,
    buffers: int,
    *,
    min_sep: int = 1,
    participations: int = 1,
    restarts: int = 4,
    seed: int = 0,
    objective: str = "max-error",
) -> tuple[Blt, float]:
    """The BLT with ``buffers`` buffers minimizing sens² · error for n steps, and its loss; the
    error is ``objective``'s (:data:`OBJECTIVES`: max error, or ‖A C⁻¹‖²_F / n for ``"rmse"``).

    Nelder–Mead on logits of (θ, θ̂) from a few deterministic and random starts, then a
    polishing run from the best. Single participation: min_sep=1, participations=1.
    """
    positive_int("buffers", buffers, BltError)
    d = buffers
    rng = np.random.default_rng(seed)
    error = objective_error(objective)

    def loss_of(p: np.ndarray) -> float:
        return _pair_loss(p, d, n, min_sep, participations, error)[0]

    def logit(x: np.ndarray) -> np.ndarray:
        return np.log(x / (1 - x))

    def interlaced(theta: np.ndarray, u: np.ndarray) -> np.ndarray:
        # ω > 0 and ω̂ < 0 need θ₁ > θ̂₁ > θ₂ > θ̂₂ > … (the pair interlaces)
        lower = np.append(theta[1:], 0.0)
        return np.concatenate([logit(theta), logit(theta - u * (theta - lower))])

    starts = [interlaced(1.0 - np.logspace(-3, -0.5, d), np.full(d, 0.5))]
    for _ in range(restarts):
        theta = np.sort(1.0 - 10 ** rng.uniform(-3.5, -0.2, d))[::-1]
        starts.append(interlaced(theta, rng.uniform(0.2, 0.8, d)))
    best = None
    for start in starts:
        if not math.isfinite(loss_of(start)):
            continue
        res = sopt.minimize(
            loss_of,
            start,
            method="Nelder-Mead",
            options={"maxiter": 4000 * d, "xatol": 1e-10, "fatol": 1e-12},
        )
        if best is None or res.fun < best.fun:
            best = res
    if best is None:
        raise BltError("no feasible starting point found")
    for _ in range(3):  # restarted Nelder-Mead polishes the simplex
        res = sopt.minimize(
            loss_of,
            best.x,
            method="Nelder-Mead",
            options={"maxiter": 4000 * d, "xatol": 1e-12, "fatol": 1e-14},
        )
        if res.fun < best.fun:
            best = res
    loss, theta, omega = _pair_loss(best.x, d, n, min_sep, participations, error)
    order = np.argsort(-theta)
    return Blt(tuple(theta[order]), tuple(omega[order])), float(loss)


# ---------------------------------------------------------------------------------------------
# streaming noise


class CorrelatedNoise(NoiseMechanism):
    """Streaming (C⁻¹Z)_t: z_t from the generator, then C's own
    :meth:`~userdp.accounting.correlation.Correlation.inverse_step` (the recurrence the
    accountant's C⁻¹ is computed with) on each tensor, with that tensor's stream state.

    Each step must be noised exactly once and in order (a retried or aborted step that drew noise
    would desynchronize the stream: the coordinator draws noise only after gathering succeeded).
    """

    kind = ""

    def __init__(self, correlation: Correlation, rng: NoiseRng | None = None) -> None:
        super().__init__(rng)
        self.correlation = correlation
        self.next_step: int | None = None
        self.buffers: dict[str, list[Any]] = {}

    def _advance(self, step: int) -> None:
        if self.next_step is not None and step != self.next_step:
            raise BltError(
                f"correlated noise for step {step} requested but the stream is at step "
                f"{self.next_step}; steps must be noised once each, in order"
            )
        self.next_step = step + 1

    def sample(self, step: int, like: Mapping[str, Any]) -> dict[str, Any]:
        self._advance(step)
        out = {}
        for name, value in like.items():
            z = self.rng.normal_like(value)
            state = [T.match(s, z) for s in self.buffers.get(name, [])]
            out[name], self.buffers[name] = self.correlation.inverse_step(z, state)
        return out

    def state_dict(self) -> dict[str, Any]:
        buffers = {name: [T.clone(b) for b in values] for name, values in self.buffers.items()}
        return {"kind": self.kind, "next_step": self.next_step, "buffers": buffers}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("kind") != self.kind:
            raise BltError(f"noise state is for {state.get('kind')!r}; expected {self.kind!r}")
        super().load_state_dict(state)  # fresh RNG
        self.next_step = state["next_step"]
        self.buffers = {name: list(values) for name, values in state["buffers"].items()}


class BltNoise(CorrelatedNoise):
    """Streaming (C⁻¹Z)_t for a BLT C, d model-sized buffers per tensor: ``blt``'s own
    recurrence on its (θ, ω)."""

    kind = "blt"

    def __init__(self, blt: Blt, rng: NoiseRng | None = None) -> None:
        super().__init__(blt, rng)
        self.blt = blt


class BandedNoise(CorrelatedNoise):
    """Streaming (C⁻¹Z)_t for a banded Toeplitz C with ``coefs`` c_0..c_{b−1} (c_0 > 0),
    keeping the last b − 1 outputs per tensor. ``banded`` is the accountant's
    :class:`~userdp.accounting.correlation.BandedCorrelation` of these coefs."""

    kind = "banded"

    def __init__(self, coefs: Sequence[float], rng: NoiseRng | None = None) -> None:
        try:
            banded = BandedCorrelation(coefs)
        except CorrelationError as exc:
            raise BltError(str(exc)) from None
        super().__init__(banded, rng)
        self.banded = banded

    @property
    def coefs(self) -> tuple[float, ...]:
        return self.banded.coefs


def banded_inverse_coefs(coefs: Sequence[float], n: int) -> np.ndarray:
    """First column of C⁻¹ for the banded Toeplitz C with first column ``coefs``."""
    return BandedCorrelation(coefs).inverse_coefs(n)


def _banded_loss(
    coefs: Sequence[float],
    n: int,
    min_sep: int,
    participations: int,
    error: Callable[[np.ndarray], float] = max_error,
) -> float:
    banded = BandedCorrelation(coefs)
    sens2 = min_sep_sensitivity_squared(banded.toeplitz_coefs(n), min_sep, participations)
    return sens2 * error(banded.inverse_coefs(n))


def optimize_banded(
    n: int,
    bands: int,
    *,
    min_sep: int = 1,
    participations: int = 1,
    objective: str = "max-error",
) -> tuple[np.ndarray, float]:
    """Banded Toeplitz coefficients c_0 = 1, c_1..c_{bands−1} ∈ [0, 1] minimizing
    sens² · error (the BLT objectives, :data:`OBJECTIVES`), by L-BFGS-B. With
    ``bands ≤ min_sep`` participations never share a band, so the min-sep sensitivity is exact."""
    positive_int("bands", bands, BltError)
    error = objective_error(objective)
    coefs = np.ones(1)
    if bands > 1:

        def loss_of(free: np.ndarray) -> float:
            return _banded_loss(np.concatenate([[1.0], free]), n, min_sep, participations, error)

        start = 0.5 ** np.arange(1, bands)
        res = sopt.minimize(loss_of, start, method="L-BFGS-B", bounds=[(0.0, 1.0)] * (bands - 1))
        coefs = np.concatenate([[1.0], res.x])
    return coefs, float(_banded_loss(coefs, n, min_sep, participations, error))
