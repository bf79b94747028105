"""Accountant for banded matrix factorization with cyclic Poisson sampling (Choquette-Choo et al.,
"(Amplified) Banded Matrix Factorization: A unified approach to private training"; the "Poisson"
baseline of "Near Exact Privacy Amplification for Matrix Mechanisms", §5.1.1).

The mechanism (:class:`~userdp.accounting.mechanisms.BandedPoissonMechanism`):

* **Sampling.** Each unit belongs to one of b̂ groups. Step t looks only at group t mod b̂ and
  includes each of its units independently with probability p.
* **Release.** The run releases CX + σZ, Z ~ N(0, I), for a lower-triangular Toeplitz C whose
  first column c has c_k = 0 for k ≥ b̂ (b̂-banded).

The reduction:

* **Disjoint columns.** Take the unit added or removed. It can appear only in the steps
  t₁ < t₂ < … of its group, which are b̂ apart. Column tᵣ of C is non-zero only in rows
  tᵣ … tᵣ + b̂ − 1, so the columns of different participations have disjoint supports.
* **Independent blocks.** The adversary's view of that unit therefore splits into independent
  blocks, one per participation r: N(Bᵣ·‖C e_{tᵣ}‖·u, σ²) along the unit's (clipped,
  norm ≤ 1) direction u, with Bᵣ ~ Bernoulli(p), against N(0, σ²).
* **DP-SGD equivalent.** So the run is dominated by ⌈n/b̂⌉ Poisson-subsampled Gaussian
  mechanisms with noise multiplier σ/‖c‖, where ‖c‖ = max_j ‖C e_j‖ = ‖c‖₂, the first column's
  norm. This is DP-SGD with ⌈n/b̂⌉ rounds of rate p (adaptive composition; dp_accounting's PLD).
* **Shorter runs.** A run of n steps is charged ⌈n/b̂⌉ rounds, the most any unit can take part
  in.
* **Neither C nor the sampling can be changed without breaking the argument.** A C with b̂ or
  more non-zero diagonals (a BLT, or a Toeplitz C with a longer first column) couples
  participations, and is refused with a pointer to the balls-in-bins accountant.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from userdp.accounting.api import epsilon as pld_epsilon
from userdp.accounting.correlation import CorrelationError, from_spec
from userdp.accounting.correlation_spec import CorrelationSpec
from userdp.accounting.mechanisms import BandedPoissonMechanism, UlsMechanism

__all__ = ["BandedPoissonError", "column_norm", "equivalent_dpsgd"]


class BandedPoissonError(ValueError):
    """The correlation is not b̂-banded (the reduction does not hold); the message says why."""


def column_norm(correlation: CorrelationSpec | None, bands: int, steps: int) -> float:
    """‖c‖₂ of C's first column over ``steps`` steps, after checking that C is ``bands``-banded
    (c_k = 0 for k ≥ bands)."""
    if correlation is None:
        return 1.0
    try:
        coefs = np.asarray(from_spec(correlation).toeplitz_coefs(max(steps, bands)), float)
    except CorrelationError as exc:
        raise BandedPoissonError(str(exc)) from None
    tail = np.flatnonzero(coefs[bands:])
    if tail.size:
        raise BandedPoissonError(
            f"correlation {correlation.name!r} has c_{bands + int(tail[0])} = "
            f"{coefs[bands + int(tail[0])]:.3g} != 0, so it is not {bands}-banded and a unit's "
            "participations share rows of C; use bands >= its number of non-zero diagonals, or "
            "the balls-in-bins accountant for a general C"
        )
    return float(np.linalg.norm(coefs))


def equivalent_dpsgd(mechanism: BandedPoissonMechanism, steps: int) -> tuple[UlsMechanism, int]:
    """(one Poisson-subsampled Gaussian round, number of rounds) that dominate ``steps`` steps of
    ``mechanism`` (see the module docstring)."""
    norm = column_norm(mechanism.correlation, mechanism.bands, steps)
    rounds = math.ceil(steps / mechanism.bands)
    return UlsMechanism(mechanism.noise_multiplier / norm, mechanism.sampling_prob), rounds


def epsilon(mechanism: BandedPoissonMechanism, steps: int, delta: float, **pld: Any) -> float:
    """ε(δ) after ``steps`` steps: dp_accounting's PLD of the equivalent DP-SGD run."""
    round_mechanism, rounds = equivalent_dpsgd(mechanism, steps)
    if rounds == 0:
        return 0.0
    return pld_epsilon(round_mechanism, rounds, delta, **pld)
