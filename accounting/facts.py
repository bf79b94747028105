"""The vocabulary a privacy guarantee is stated in: unit, sampling scheme, adjacency.

One set of names from the config (``strategy.sampling``) through the samplers and strategies to
the privacy report, so the report can never describe a different scheme than the one that ran:

=========================  ==========================================================================
``poisson``                each unit independently with probability q, fresh every step
``padding``                Poisson, then truncated/padded to a fixed cohort (zero-out adjacency)
``shuffle``                fixed-size cohorts in shuffled order (no accountant matches it)
``balls-in-bins-fixed``    each unit in one of b bins, assigned once for the whole run
``balls-in-bins-epoch``    each unit in one of b bins, reassigned every epoch
=========================  ==========================================================================
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

__all__ = [
    "DETERMINISTIC_NOISE_CAVEAT",
    "FAST_NOISE_CAVEAT",
    "Adjacency",
    "PrivacyFacts",
    "Sampling",
    "Unit",
]


class Unit(StrEnum):
    """Who a guarantee protects (or which units a sampler draws)."""

    USER = "user"
    EXAMPLE = "example"


class Adjacency(StrEnum):
    """Neighbouring datasets: one unit added or removed, or one unit's data replaced by zero."""

    ADD_REMOVE = "add-remove"
    ZERO_OUT = "zero-out"


class Sampling(StrEnum):
    """How a step's cohort is drawn (the module docstring's table)."""

    POISSON = "poisson"
    PADDING = "padding"
    SHUFFLE = "shuffle"
    BALLS_IN_BINS_FIXED = "balls-in-bins-fixed"
    BALLS_IN_BINS_EPOCH = "balls-in-bins-epoch"
    CYCLIC_POISSON = "cyclic-poisson"

    @property
    def bin_semantics(self) -> str | None:
        """The balls-in-bins accountant's ``bin_semantics`` for this scheme (None otherwise)."""
        return {
            Sampling.BALLS_IN_BINS_FIXED: "fixed",
            Sampling.BALLS_IN_BINS_EPOCH: "per-epoch",
        }.get(self)

    @classmethod
    def of_bin_semantics(cls, semantics: str) -> Sampling:
        for scheme in (cls.BALLS_IN_BINS_FIXED, cls.BALLS_IN_BINS_EPOCH):
            if scheme.bin_semantics == semantics:
                return scheme
        raise ValueError(
            f"bin_semantics={semantics!r} is not allowed; expected 'fixed' or 'per-epoch'"
        )


def _member(kind: type[StrEnum], field: str, value: Any) -> Any:
    try:
        return kind(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in kind)
        raise ValueError(f"{field}={value!r} is not allowed; expected one of {allowed}") from None


# A strategy's noise caveats (PrivacyFacts.caveats); the report replaces them by its per-step count
# when the ledger's step records say which noise each step drew.
FAST_NOISE_CAVEAT = (
    "The noise came from fast floating-point generators (numpy PCG64 / torch), not a "
    "cryptographic keystream, and releases were not rounded onto a grid "
    "(privacy.secure_noise = false): an adversary who can predict the generator, or read the "
    "low-order bits of released floats, can learn more than ε allows"
)
DETERMINISTIC_NOISE_CAVEAT = (
    "The noise came from a fixed test seed (NoiseRng.for_testing): anyone who knows the seed can "
    "subtract it, so this run is NOT private whatever ε says"
)


@dataclass(frozen=True)
class PrivacyFacts:
    """What the privacy report states about a strategy besides its mechanism.

    unit: the privacy unit (always ``user`` for userdp's strategies). sampling: the scheme of
    :class:`Sampling`; sampled: which units the sampler draws (``example`` for ELS, whose
    privacy unit is still the user). adjacency: add/remove or zero-out.
    sampling_matches_accounting: False when no accountant matches the sampler (fixed-size
    shuffle): the reported ε is then NOT a guarantee. caveats: one line each, printed verbatim.
    secure_noise: True when the noise comes from a cryptographic keystream and releases lie on a
    fixed grid, False for floating-point noise from a fast generator, None when not stated.
    Strings are accepted for the enum fields and checked.
    """

    unit: Unit
    sampling: Sampling
    adjacency: Adjacency
    sampling_matches_accounting: bool
    caveats: tuple[str, ...] = ()
    sampled: Unit = Unit.USER
    secure_noise: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "unit", _member(Unit, "unit", self.unit))
        object.__setattr__(self, "sampling", _member(Sampling, "sampling", self.sampling))
        object.__setattr__(self, "adjacency", _member(Adjacency, "adjacency", self.adjacency))
        object.__setattr__(self, "sampled", _member(Unit, "sampled", self.sampled))
        object.__setattr__(self, "caveats", tuple(self.caveats))
        if self.secure_noise not in (True, False, None):
            raise ValueError(
                f"secure_noise={self.secure_noise!r} is not allowed; expected True, False or None"
            )

    def to_dict(self) -> dict[str, Any]:
        return {
            "unit": self.unit.value,
            "sampling": self.sampling.value,
            "sampled": self.sampled.value,
            "adjacency": self.adjacency.value,
            "sampling_matches_accounting": self.sampling_matches_accounting,
            "caveats": list(self.caveats),
            "secure_noise": self.secure_noise,
        }
