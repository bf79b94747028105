"""Adaptive clipping by private quantile tracking (Andrew, Thakkar, McMahan, Ramaswamy 2021).

The clip norm follows the γ-quantile of user-update norms: each step also releases a noisy count
of users whose update norm was ≤ C_t, and the server moves C geometrically:

    b̃_t = ( Σ_{u∈S_t} (b_u − ½) + N(0, σ_b²) ) / M + ½,     b_u = 1[‖g_u‖ ≤ C_t]
    C_{t+1} = C_t · exp(−η_C (b̃_t − γ))

M is the EXPECTED cohort qN (the realized |S_t| is private, so it is not used).

Privacy cost and how it composes: the centered count Σ(b_u − ½) has add/remove sensitivity ½;
the update sum has sensitivity C_t. Releasing both with independent Gaussian noise
(std σ_Δ·C_t and σ_b) is ONE Gaussian mechanism on the concatenated, sensitivity-normalized
vector, with noise multiplier z = (σ_Δ⁻² + (2σ_b)⁻²)^(−1/2) (Andrew et al., Thm. 1). So one
step is exactly a Poisson-subsampled Gaussian with multiplier z, and the ledger records
``UlsMechanism(z, q)``; the count costs no separate budget, it raises σ_Δ instead:
σ_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2), which needs 2σ_b > z. The clip norm C_{t+1} is a function of
released values only (post-processing), so adaptive composition over steps is the usual one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from userdp.accounting.validation import in_unit_interval
from userdp.strategies.base import Cohort, NoisyStatistic, Release, StrategyError
from userdp.strategies.builtins import UserLevelSampling
from userdp.strategies.unit_stats import UnitStats

__all__ = ["AdaptiveClipping", "update_noise_multiplier"]


def update_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """σ_Δ such that (σ_Δ⁻² + (2σ_b)⁻²)^(−1/2) = z (Andrew et al. 2021, Thm. 1)."""
    if not 2.0 * count_stddev > noise_multiplier:
        raise StrategyError(
            f"count_stddev={count_stddev} is too small for noise_multiplier={noise_multiplier}; "
            "expected count_stddev > noise_multiplier / 2 (Andrew et al. suggest ≈ M/20)"
        )
    return (noise_multiplier**-2 - (2.0 * count_stddev) ** -2) ** -0.5


class AdaptiveClipping(UserLevelSampling):
    """ULS (Poisson users) whose clip norm tracks the ``target_quantile`` of update norms.

    ``noise_multiplier`` is the accounted z of the whole step (sum AND count);
    ``clip_norm`` is the initial C; ``count_stddev`` σ_b is the std of the noise on the clipped count; ``clip_lr`` is η_C.
    :meth:`privatize` releases the noisy fraction in ``Release.statistics`` and
    :meth:`server_update` moves C from it (the cohort's :class:`UnitStats`: ``count`` units,
    ``clipped`` of them with norm > C).
    """

    samplings = ("poisson",)

    def __init__(
        self,
        *,
        clip_norm: float,
        target_quantile: float = 0.5,
        clip_lr: float = 0.2,
        count_stddev: float,
        **uls: Any,
    ) -> None:
        super().__init__(clip_norm=clip_norm, **uls)
        self._require_poisson()
        self.target_quantile = in_unit_interval("target_quantile", target_quantile, StrategyError)
        self.clip_lr = float(clip_lr)
        self.count_stddev = float(count_stddev)
        update_noise_multiplier(self.noise_multiplier, count_stddev)  # refuse a too-small σ_b now
        self.history: list[tuple[int, float, float]] = []
        """(step, clip norm used, noisy unclipped fraction) per released step."""

    def calibrate(self, noise_multiplier: float) -> None:
        """Take the calibrated σ only if the count's noise leaves the sum a share of it
        (2σ_b > z, :func:`update_noise_multiplier`): the constructor checked the σ it was built
        with (σ = 1 when a run calibrates), not this one."""
        update_noise_multiplier(noise_multiplier, self.count_stddev)
        super().calibrate(noise_multiplier)

    @property
    def update_noise_multiplier(self) -> float:
        """σ_Δ, the sum's share of the step's noise multiplier (Andrew et al., Thm. 1)."""
        return update_noise_multiplier(self.noise_multiplier, self.count_stddev)

    def add_noise(
        self, step: int, summed: Mapping[str, Any], stats: UnitStats | None = None
    ) -> dict[str, Any]:
        """The sum's noise: σ_Δ·C (the count takes the rest of the step's budget)."""
        return self.noise.add(step, summed, std=self.update_noise_multiplier * self.clip_norm)

    def privatize(
        self, step: int, summed: Mapping[str, Any], stats: UnitStats, cohort: Cohort
    ) -> Release:
        """The noisy sum and the noisy unclipped fraction b̃ = (Σ(b_u − ½) + N(0, σ_b²))/M + ½
        (M the EXPECTED cohort); one unit moves b̃ by at most ½/M."""
        expected = cohort.expected_size
        centered = (stats.count - stats.clipped) - 0.5 * stats.count
        noisy = self.noise.rng.noisy_scalar(centered, self.count_stddev)
        fraction = NoisyStatistic(noisy / expected + 0.5, sensitivity=0.5 / expected)
        return Release(
            step, cohort, self.add_noise(step, summed, stats), {"unclipped_fraction": fraction}
        )

    def server_update(self, params: Mapping[str, Any], release: Release) -> None:
        """The inherited update, then C ← C·exp(−η_C(b̃ − γ)) from the released fraction."""
        super().server_update(params, release)
        fraction = release.statistics["unclipped_fraction"].value
        self.history.append((release.step, self.clip_norm, fraction))
        self.clip_norm *= math.exp(-self.clip_lr * (fraction - self.target_quantile))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "history": [list(h) for h in self.history]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.history = [tuple(h) for h in state["history"]]  # type: ignore[misc]
