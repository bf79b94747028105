"""The one module that reads dp_accounting internals, for the versions it was written against.

The fast PLD paths (:mod:`userdp.accounting.pld_ops`, :mod:`userdp.accounting.fast_pld`,
:mod:`userdp.accounting.randomized_clipping`) need a PLD's two PMFs, a dense PMF's arrays and a
mixture-of-Gaussians loss's precomputed constants; dp_accounting keeps all of them in private
attributes. Every such read is a function here, and importing this module checks the installed
dp_accounting against :data:`SUPPORTED_VERSIONS` (the range pyproject.toml pins): another
version raises :class:`UnsupportedDpAccountingVersionError` before any internal is read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib import metadata

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism as plm

__all__ = [
    "SUPPORTED_VERSIONS",
    "DenseArrays",
    "UnsupportedDpAccountingVersionError",
    "check_version",
    "dense_arrays",
    "directions",
    "distinct_pmfs",
    "installed_version",
    "mixture_loss_constants",
]

SUPPORTED_VERSIONS = ((0, 5), (0, 7))
"""dp_accounting versions whose internals this module reads: >= 0.5 and < 0.7 (major, minor)."""


class UnsupportedDpAccountingVersionError(ImportError):
    """The installed dp_accounting is outside :data:`SUPPORTED_VERSIONS`."""


def installed_version() -> str:
    """The installed dp-accounting distribution's version string."""
    return metadata.version("dp-accounting")


def check_version() -> None:
    """Raise :class:`UnsupportedDpAccountingVersionError` unless :func:`installed_version` is
    in :data:`SUPPORTED_VERSIONS`."""
    version = installed_version()
    (low, high) = SUPPORTED_VERSIONS
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or not low <= (int(match[1]), int(match[2])) < high:
        raise UnsupportedDpAccountingVersionError(
            f"dp-accounting {version} is installed; userdp.accounting reads its internals and "
            f"supports dp-accounting>={low[0]}.{low[1]},<{high[0]}.{high[1]}: install a version "
            "in that range"
        )


check_version()


@dataclass(frozen=True)
class DenseArrays:
    """The fields of a ``DensePLDPmf``: probability ``probs[i]`` of loss
    ``(lower_loss + i)·discretization``, plus the mass at +∞."""

    discretization: float
    lower_loss: int
    probs: np.ndarray
    infinity_mass: float
    pessimistic_estimate: bool


def directions(
    pld: pld_lib.PrivacyLossDistribution,
) -> tuple[pld_pmf.PLDPmf, pld_pmf.PLDPmf]:
    """The (REMOVE, ADD) PMFs of ``pld`` (the same object twice for a symmetric PLD)."""
    return pld._pmf_remove, pld._pmf_add  # noqa: SLF001


def distinct_pmfs(pld: pld_lib.PrivacyLossDistribution) -> tuple[pld_pmf.PLDPmf, ...]:
    """The PMFs that define ``pld``: (REMOVE,) when symmetric, else (REMOVE, ADD); the
    ``PrivacyLossDistribution`` of them is ``pld`` again."""
    return (pld._pmf_remove,) if pld._symmetric else directions(pld)  # noqa: SLF001


def dense_arrays(pmf: pld_pmf.PLDPmf) -> DenseArrays | None:
    """The arrays of a dense PMF, or None for a sparse one."""
    if not isinstance(pmf, pld_pmf.DensePLDPmf):
        return None
    return DenseArrays(
        pmf._discretization,  # noqa: SLF001
        pmf._lower_loss,  # noqa: SLF001
        pmf._probs,  # noqa: SLF001
        pmf._infinity_mass,  # noqa: SLF001
        pmf._pessimistic_estimate,  # noqa: SLF001
    )


def mixture_loss_constants(
    loss: plm.MixtureGaussianPrivacyLoss,
) -> tuple[float, float, np.ndarray]:
    """(σ, σ², a) of a mixture-of-Gaussians loss, with a_k the constants of its loss
    ±logsumexp_k(a_k ∓ s_k·x/σ²) (REMOVE: +, −; ADD: −, +)."""
    return (
        loss._standard_deviation,  # noqa: SLF001
        loss._variance,  # noqa: SLF001
        loss._precompute_privacy_loss_constants,  # noqa: SLF001
    )
