"""The statistics a task reports about its units next to its clipped sum, declared once.

Every stage that carries them holds a :class:`UnitStats`: the worker's accumulator
(:mod:`userdp.clients.clipping`), its task sum and the coordinator's task result
(:mod:`userdp.proto.results`), the cohort's sum the strategy privatizes
(:class:`userdp.strategies.step.CohortSum`) and the coordinator's step report
(:mod:`userdp.server.coordinator`). On the wire they are fields of the ``Result`` message, mapped
only by :mod:`userdp.proto.codec`. A new statistic is a field here, its field in ``Result`` and
its two lines in the codec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["UnitStats"]


@dataclass(frozen=True)
class UnitStats:
    """Statistics of a set of units (one task's, or a step's); ``+`` is their union.

    count: finite units (including units without usable examples, norm 0); nonfinite: units that
        contributed zero because their loss or gradient was NaN/Inf; count + nonfinite = units.
    clipped: finite units whose (exact or estimated) norm exceeded C.
    norm_*: over the finite units, of the norm used for clipping (‖g‖, or √n̂ when randomized);
        norm_min and norm_max are 0 when there is no finite unit.
    loss_sum / tokens: summed next-token cross-entropy and predicted tokens of the finite units.
    """

    count: int = 0
    nonfinite: int = 0
    clipped: int = 0
    norm_min: float = 0.0
    norm_max: float = 0.0
    norm_sum: float = 0.0
    norm_sum_sq: float = 0.0
    loss_sum: float = 0.0
    tokens: int = 0

    @classmethod
    def finite_unit(cls, norm: float, clip_norm: float, loss_sum: float, tokens: int) -> UnitStats:
        """One finite unit clipped by ``norm`` against ``clip_norm``."""
        return cls(
            count=1,
            clipped=int(norm > clip_norm),
            norm_min=norm,
            norm_max=norm,
            norm_sum=norm,
            norm_sum_sq=norm * norm,
            loss_sum=loss_sum,
            tokens=tokens,
        )

    def __add__(self, other: UnitStats) -> UnitStats:
        """The statistics of both sets of units (the norm extremes over their finite units)."""
        if not isinstance(other, UnitStats):
            return NotImplemented
        finite = [s for s in (self, other) if s.count]
        return UnitStats(
            count=self.count + other.count,
            nonfinite=self.nonfinite + other.nonfinite,
            clipped=self.clipped + other.clipped,
            norm_min=min((s.norm_min for s in finite), default=0.0),
            norm_max=max((s.norm_max for s in finite), default=0.0),
            norm_sum=self.norm_sum + other.norm_sum,
            norm_sum_sq=self.norm_sum_sq + other.norm_sum_sq,
            loss_sum=self.loss_sum + other.loss_sum,
            tokens=self.tokens + other.tokens,
        )

    @property
    def loss_mean(self) -> float:
        """Mean next-token loss per predicted token (NaN without tokens)."""
        return self.loss_sum / self.tokens if self.tokens else math.nan
