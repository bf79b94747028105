"""AboveThreshold (the sparse vector technique), answering "is the query still above the
threshold?" until its first "below" (Dwork & Roth, "The Algorithmic Foundations of Differential
Privacy", §3.6, Algorithm 1), as Asi & Liu use it in "User-level Differentially Private
Stochastic Convex Optimization: Efficient Algorithms with Optimal Rates".

For adaptively chosen queries f₁, f₂, … of sensitivity Δ and a fixed threshold T: draw
ρ ~ Lap(2Δ/ε) once; at query i draw νᵢ ~ Lap(4Δ/ε) and answer ⊤ if fᵢ + νᵢ ≥ T + ρ, else ⊥ and
stop answering. The answers up to and including the first ⊥ are ε-DP together, however many ⊤
come first: this is Dwork & Roth's AboveThreshold (Theorem 3.23) run on −fᵢ against −T, which
halts at its first "above", with ρ and νᵢ negated (the Laplace law is symmetric).

The noisy comparisons are never released, only their bits. The draws come from the caller's
:class:`~userdp.strategies.noise.NoiseRng` (secure by default), passed to :meth:`above` rather
than kept here, so the strategy's generator mode (secure, fast, test) applies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from userdp.accounting.validation import positive_float
from userdp.strategies.errors import StrategyError
from userdp.strategies.noise import NoiseRng

__all__ = ["AboveThreshold"]


class AboveThreshold:
    """One AboveThreshold instance (module docstring) at ``epsilon`` for queries of
    ``sensitivity`` Δ against ``threshold``; halts after its first ⊥.

    ``threshold_scale`` = 2Δ/ε and ``query_scale`` = 4Δ/ε are the Laplace scales of ρ and νᵢ.
    ρ is drawn at the first query and is part of :meth:`state_dict` (a checkpoint resumes the
    same instance; a fresh ρ would be a second instance and a second ε)."""

    def __init__(self, epsilon: float, sensitivity: float, threshold: float = 0.0) -> None:
        for name, value in (("epsilon", epsilon), ("sensitivity", sensitivity)):
            positive_float(f"AboveThreshold {name}", value, StrategyError)
        if not math.isfinite(threshold):
            raise StrategyError(f"AboveThreshold threshold={threshold!r}; expected a finite float")
        self.epsilon = float(epsilon)
        self.sensitivity = float(sensitivity)
        self.threshold = float(threshold)
        self._noisy_threshold: float | None = None
        self.halted = False

    @property
    def threshold_scale(self) -> float:
        """2Δ/ε: the Laplace scale of the threshold noise ρ."""
        return 2.0 * self.sensitivity / self.epsilon

    @property
    def query_scale(self) -> float:
        """4Δ/ε: the Laplace scale of each query's noise νᵢ."""
        return 4.0 * self.sensitivity / self.epsilon

    def above(self, value: float, rng: NoiseRng) -> bool:
        """⊤ (True) if ``value`` + Lap(4Δ/ε) ≥ T + ρ; ⊥ (False) otherwise, which halts this
        instance: a further query raises StrategyError (its ε covers one ⊥)."""
        if self.halted:
            raise StrategyError(
                "AboveThreshold already answered below; its epsilon covers no further query"
            )
        if not math.isfinite(value):
            raise StrategyError(f"AboveThreshold query value {value!r} is not finite")
        if self._noisy_threshold is None:
            self._noisy_threshold = self.threshold + rng.laplace(self.threshold_scale)
        answer = value + rng.laplace(self.query_scale) >= self._noisy_threshold
        self.halted = not answer
        return answer

    def state_dict(self) -> dict[str, Any]:
        """ρ (as T + ρ; secret, like the sampler seed) and whether it halted."""
        return {"noisy_threshold": self._noisy_threshold, "halted": self.halted}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        noisy = state["noisy_threshold"]
        self._noisy_threshold = None if noisy is None else float(noisy)
        self.halted = bool(state["halted"])
