"""Deterministic ε bounds for balls-in-bins sampling with iid Gaussian noise (random allocation).

Feldman & Shenfeld, "Efficient Privacy Loss Accounting for Subsampling and Random Allocation"
(ICML 2026, arXiv 2602.17284), through their package ``PLD_accounting``: a dominating (upper)
and a dominated (lower) privacy loss distribution of the random-allocation mechanism, each a
dp_accounting PLD, so ε(δ) of the upper one is a certified upper bound and of the lower one a
certified lower bound. This module is the only one that imports the package; it checks the
version it was written against and fails loudly on another.

The mapping of userdp's balls-in-bins mechanism onto it is made once, from the mechanism's
dominating pair, by :func:`userdp.accounting.balls_in_bins_certified.random_allocation_bounds`
(per-epoch bins: E epochs of "1 out of b steps"; fixed bins with C = I: a unit's E contributions
meet independent noise, so they are ONE epoch at σ/√E).
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
