"""The strategy matrix C of a matrix mechanism and its streaming inverse: the one place both live.

A matrix mechanism (DP-FTRL) releases x_t + σ·(C⁻¹Z)_t for a lower-triangular Toeplitz C; all
releases together are post-processing of CX + σZ, so the privacy loss is read off C's columns
(Near Exact Privacy Amplification for Matrix Mechanisms, §2, arXiv:2410.06266). The accountant
needs C; the noise stream needs (C⁻¹Z)_t one step at a time. Both come from one
:class:`Correlation`, which :func:`from_spec` builds from the
:class:`~userdp.accounting.mechanisms.CorrelationSpec` the ledger records: its
:meth:`~Correlation.inverse_step` is the recurrence the noise streams of
:mod:`userdp.strategies.blt` run on model-sized numpy arrays or torch tensors, and
:meth:`~Correlation.inverse_coefs` is that same recurrence run on the unit impulse.

* :class:`BltCorrelation`, buffered linear Toeplitz (Dvijotham et al., "Efficient and
  Near-Optimal Noise Generation for Streaming Differential Privacy", arXiv:2404.16706; McMahan et
  al., "A Hassle-free Algorithm for Private Learning in Practice: Don't Use Tree Aggregation, Use
  BLTs"): c_0 = 1, c_k = Σ_j ω_j θ_j^{k−1} (k ≥ 1), θ ∈ (0, 1)^d. Streaming with d buffers S_j
  (start at 0)::

      x_t = z_t − Σ_j ω_j S_j ;   S_j ← θ_j S_j + x_t            (x = C⁻¹z exactly)

* :class:`BandedCorrelation`, c_0..c_{b−1} given and c_k = 0 for k ≥ b (Scaling up the Banded
  Matrix Factorization Mechanism for Differentially Private ML). Streaming by forward
  substitution over the last b − 1 outputs::

      x_t = (z_t − Σ_{k=1}^{b−1} c_k x_{t−k}) / c_0

  iid noise is its identity case, coefs (1,): x_t = z_t, no state.

Spec names: ``blt`` (``buf_decay`` θ, ``output_scale`` ω); ``banded`` and ``toeplitz``
(``coefs``: the first column, zero-padded to n); ``identity`` (banded with coefs (1,)).

Imports numpy only: never torch (tensors are handled through their own operators and
``add_``), never ``userdp.strategies``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from userdp.accounting.correlation_spec import CorrelationSpec

__all__ = [
    "BandedCorrelation",
    "BltCorrelation",
    "Correlation",
    "CorrelationError",
    "IDENTITY",
    "from_spec",
    "min_sep_column",
    "toeplitz_matrix",
]


class CorrelationError(ValueError):
    """Invalid correlation parameters; the message names the parameter and what is allowed."""


def toeplitz_matrix(coefs: Sequence[float] | np.ndarray) -> np.ndarray:
    """Dense lower-triangular Toeplitz matrix with first column ``coefs``."""
    coefs = np.asarray(coefs, dtype=np.float64)
    n = len(coefs)
    lag = np.subtract.outer(np.arange(n), np.arange(n))
    return np.where(lag >= 0, coefs[np.clip(lag, 0, None)], 0.0)


class Correlation(ABC):
    """A lower-triangular Toeplitz strategy matrix C, for any number of steps n."""

    @abstractmethod
    def toeplitz_coefs(self, n: int) -> np.ndarray:
        """c_0..c_{n−1}: the first column of the n×n C."""

    @abstractmethod
    def inverse_step(self, z: Any, state: list[Any]) -> tuple[Any, list[Any]]:
        """(x_t, state after t) with x_t = (C⁻¹Z)_t, from z_t and the state after t − 1 (``[]``
        at t = 0, meaning all zeros). ``z`` is a numpy array or torch tensor; the state holds
        arrays of its kind, shape and dtype. ``z`` and the state are updated in place where the
        recurrence allows, so the caller must own them."""

    def inverse_coefs(self, n: int) -> np.ndarray:
        """ĉ_0..ĉ_{n−1}: the first column of the n×n C⁻¹, as :meth:`inverse_step` streams it
        (its response to the unit impulse z = e_0)."""
        out = np.zeros(n)
        state: list[Any] = []
        for t in range(n):
            x, state = self.inverse_step(np.full(1, 1.0 if t == 0 else 0.0), state)
            out[t] = x[0]
        return out

    @property
    @abstractmethod
    def is_identity(self) -> bool:
        """Whether C = I for every n."""

    @abstractmethod
    def spec(self) -> CorrelationSpec:
        """The ledger's description of C; :func:`from_spec` of it has the same parameters."""

    def matrix(self, n: int) -> np.ndarray:
        """The dense n×n C."""
        return toeplitz_matrix(self.toeplitz_coefs(n))


def _floats(name: str, values: Any) -> tuple[float, ...]:
    out = tuple(float(v) for v in np.asarray(values, dtype=np.float64).reshape(-1))
    if not all(math.isfinite(v) for v in out):
        raise CorrelationError(f"{name}={out} has non-finite entries; expected finite numbers")
    return out


@dataclass(frozen=True)
class BltCorrelation(Correlation):
    """BLT C: ``buf_decay`` θ ∈ (0, 1)^d and ``output_scale`` ω, c_0 = 1 (Dvijotham et al., "Efficient and Near-Optimal Noise Generation for Streaming Differential Privacy").

    The streaming recurrence of the module docstring runs on exactly these (θ, ω)."""

    buf_decay: tuple[float, ...]
    output_scale: tuple[float, ...]

    def __post_init__(self) -> None:
        theta = _floats("buf_decay", self.buf_decay)
        omega = _floats("output_scale", self.output_scale)
        if len(theta) != len(omega):
            raise CorrelationError(
                f"buf_decay has {len(theta)} entries but output_scale {len(omega)}; expected equal"
            )
        if not all(0.0 < t < 1.0 for t in theta):
            raise CorrelationError(f"buf_decay={theta} is out of range; expected values in (0, 1)")
        object.__setattr__(self, "buf_decay", theta)
        object.__setattr__(self, "output_scale", omega)

    def toeplitz_coefs(self, n: int) -> np.ndarray:
        theta, omega = np.asarray(self.buf_decay), np.asarray(self.output_scale)
        powers = theta[None, :] ** np.arange(max(n - 1, 0))[:, None]
        return np.concatenate([[1.0], (omega[None, :] * powers).sum(axis=1)])[:n]

    def inverse_step(self, z: Any, state: list[Any]) -> tuple[Any, list[Any]]:
        """x_t = z_t − Σ_j ω_j S_j, then S_j ← θ_j S_j + x_t, all in place (x_t is ``z``)."""
        x = z
        if not state:  # S = 0: x_0 = z_0 and each S_j becomes x_0
            return x, [x * 1.0 for _ in self.buf_decay]  # x * 1.0: a copy, numpy or torch
        for w, s in zip(self.output_scale, state, strict=True):
            _axpy(x, -w, s)
        for t, s in zip(self.buf_decay, state, strict=True):
            s *= t
            _axpy(s, 1.0, x)
        return x, state

    @property
    def is_identity(self) -> bool:
        return not any(self.output_scale)

    def spec(self) -> CorrelationSpec:
        return CorrelationSpec.of(
            "blt", buf_decay=list(self.buf_decay), output_scale=list(self.output_scale)
        )


@dataclass(frozen=True)
class BandedCorrelation(Correlation):
    """Banded Toeplitz C with first column ``coefs`` c_0..c_{b−1} (c_0 > 0), zero below band b.

    The streaming forward substitution of the module docstring runs on exactly these coefs."""

    coefs: tuple[float, ...]

    def __post_init__(self) -> None:
        coefs = _floats("coefs", self.coefs)
        if not coefs or coefs[0] <= 0.0:
            raise CorrelationError(f"banded coefs={coefs} need c_0 > 0")
        object.__setattr__(self, "coefs", coefs)

    def toeplitz_coefs(self, n: int) -> np.ndarray:
        out = np.zeros(n)
        band = min(len(self.coefs), n)
        out[:band] = self.coefs[:band]
        return out

    def inverse_step(self, z: Any, state: list[Any]) -> tuple[Any, list[Any]]:
        """x_t = (z_t − Σ_{k≥1} c_k x_{t−k}) / c_0; the state is the last b − 1 outputs, newest
        first."""
        x = z
        for c, past in zip(self.coefs[1:], state, strict=False):
            x = x - c * past
        x = x / self.coefs[0]
        return x, [x, *state][: len(self.coefs) - 1]

    @property
    def is_identity(self) -> bool:
        return self.coefs[0] == 1.0 and not any(self.coefs[1:])

    def spec(self) -> CorrelationSpec:
        return CorrelationSpec.of("banded", coefs=list(self.coefs))


IDENTITY = BandedCorrelation((1.0,))
"""C = I: iid noise, x_t = z_t."""


def min_sep_column(coefs: np.ndarray, min_sep: int = 1, participations: int = 1) -> np.ndarray:
    """u_t = Σ_j c_{t − j·b}: the sum of C's columns 0, b, 2b, … (at most ``participations`` of
    them) for a Toeplitz C with first column ``coefs``, the worst participation pattern of C
    with non-negative, non-increasing coefs under ≤ k participations at least b = ``min_sep``
    apart (and mode 0 of the balls-in-bins pair with b bins, k epochs)."""
    n = len(coefs)
    k = min(int(participations), math.ceil(n / min_sep))
    column = np.zeros(n)
    for j in range(k):
        column[j * min_sep :] += coefs[: n - j * min_sep]
    return column


def _axpy(y: Any, a: float, x: Any) -> None:
    """y += a·x in place; a torch tensor (recognized by ``add_``) without a temporary."""
    add_ = getattr(y, "add_", None)
    if add_ is not None:
        add_(x, alpha=a)
    else:
        y += a * x


_PARAMS = {
    "identity": (),
    "blt": ("buf_decay", "output_scale"),
    "banded": ("coefs",),
    "toeplitz": ("coefs",),
}


def from_spec(spec: CorrelationSpec | Mapping[str, Any]) -> Correlation:
    """The :class:`Correlation` a spec (or its ``to_dict()`` form) describes.

    Raises :class:`CorrelationError` for an unknown name or a missing or unknown parameter."""
    if isinstance(spec, Mapping):
        spec = CorrelationSpec.from_dict(spec)
    params = dict(spec.params)
    expected = _PARAMS.get(spec.name)
    if expected is None:
        raise CorrelationError(
            f"correlation name={spec.name!r} is not allowed; expected one of {tuple(_PARAMS)}"
        )
    if sorted(params) != sorted(expected):
        raise CorrelationError(
            f"correlation {spec.name!r} has parameters {sorted(params)}; expected {list(expected)}"
        )
    if spec.name == "blt":
        return BltCorrelation(params["buf_decay"], params["output_scale"])
    if spec.name == "identity":
        return IDENTITY
    return BandedCorrelation(params["coefs"])
