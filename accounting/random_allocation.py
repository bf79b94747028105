"""Deterministic ε bounds for balls-in-bins sampling with iid Gaussian noise (random allocation).

Feldman & Shenfeld, "Efficient Privacy Loss Accounting for Subsampling and Random Allocation"
(ICML 2026, arXiv 2602.17284), through their package ``PLD_accounting``: a dominating (upper)
and a dominated (lower) privacy loss distribution of the random-allocation mechanism, each a
dp_accounting PLD, so ε(δ) of the upper one is a certified upper bound and of the lower one a
certified lower bound. This module is the only one that imports the package; it checks the
version it was written against and fails loudly on another.

Mapping of userdp's balls-in-bins mechanism (C = I only: correlated noise has no such bound
here):

- bins redrawn every epoch (``per-epoch``): E epochs of "1 out of b steps" random allocation,
  ``num_steps = b``, ``num_selected = 1``, ``num_epochs = E``;
- bins fixed for the whole run (``fixed``): a unit in bin i joins steps i, i + b, …, i + (E−1)b,
  and its E contributions meet independent N(0, σ²) noise, so the E releases it joins are one
  Gaussian release of sensitivity √E: ONE epoch of random allocation at σ/√E.
"""

from __future__ import annotations

import importlib.metadata
import math
import warnings
from typing import Any

from userdp.accounting.errors import InvalidMechanismError

__all__ = [
    "PACKAGE_VERSION",
    "RandomAllocationError",
    "allocation_epsilon_bounds",
    "epsilon_bounds",
    "equivalent_allocation",
]

PACKAGE = "PLD_accounting"
PACKAGE_VERSION = "2.0"
"""The version of ``PLD_accounting`` this adapter was written and tested against."""


class RandomAllocationError(InvalidMechanismError):
    """The random-allocation accountant is missing, of another version, or failed."""


def _package() -> Any:
    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise RandomAllocationError(
            f"the balls-in-bins accountant needs {PACKAGE}=={PACKAGE_VERSION} (pip install "
            f"'pld-accounting=={PACKAGE_VERSION}'); it is not installed"
        ) from None
    if version != PACKAGE_VERSION:
        raise RandomAllocationError(
            f"{PACKAGE} {version} is installed, but userdp's balls-in-bins accountant is written "
            f"against {PACKAGE_VERSION}; install pld-accounting=={PACKAGE_VERSION}"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ImportWarning)  # "numba not installed": slower, same result
        import PLD_accounting

    return PLD_accounting


def equivalent_allocation(
    noise_multiplier: float, bins: int, epochs: int, bin_semantics: str
) -> tuple[float, int]:
    """(σ, epochs) of the random-allocation mechanism with ``num_steps = bins`` that has the same
    privacy loss as balls-in-bins with C = I (module docstring)."""
    if bin_semantics == "fixed":
        return noise_multiplier / math.sqrt(epochs), 1
    if bin_semantics == "per-epoch":
        return noise_multiplier, epochs
    raise RandomAllocationError(
        f"bin_semantics={bin_semantics!r} is not allowed; expected 'fixed' or 'per-epoch'"
    )


def epsilon_bounds(
    noise_multiplier: float, bins: int, epochs: int, delta: float, bin_semantics: str
) -> tuple[float, float]:
    """(upper, lower) bounds on ε(δ) of ``epochs`` epochs of balls-in-bins over ``bins`` bins with
    iid Gaussian noise of multiplier ``noise_multiplier`` (module docstring's mapping)."""
    sigma, rounds = equivalent_allocation(noise_multiplier, bins, epochs, bin_semantics)
    return allocation_epsilon_bounds(sigma, bins, rounds, delta)


def allocation_epsilon_bounds(
    sigma: float, num_steps: int, num_epochs: int, delta: float
) -> tuple[float, float]:
    """(upper, lower) bounds on ε(δ) of ``num_epochs`` epochs of "1 out of ``num_steps``" random
    allocation with Gaussian noise of std ``sigma`` (sensitivity 1): the package's adaptive
    refinement (dominating and dominated PLDs on one grid, refined until upper/lower ≤ 1.1)."""
    package = _package()
    try:
        upper, lower = package.gaussian_allocation_epsilon_range(
            delta=float(delta),
            sigma=float(sigma),
            num_steps=int(num_steps),
            num_epochs=int(num_epochs),
        )
    except (ValueError, ArithmeticError) as exc:
        raise RandomAllocationError(
            f"random-allocation accounting failed for σ = {sigma:g}, {num_steps} steps, "
            f"{num_epochs} epoch(s), δ = {delta:g}: {exc}"
        ) from None
    upper, lower = float(upper), float(lower)
    if not (math.isfinite(upper) and upper >= lower >= 0):
        raise RandomAllocationError(
            f"random-allocation accounting returned upper = {upper!r} < lower = {lower!r}"
        )
    return upper, lower
