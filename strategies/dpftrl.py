"""BLT-DP-FTRL: balls-in-bins users (bins fixed for the run) + BLT (or banded) correlated noise.

Step t: cohort = users of bin t mod b (assigned once, seed 004 Def. 3.1); release
Σ clip(g_u) + σ·C_clip·(C⁻¹Z)_t; the server divides by the expected cohort N/b and steps its
optimizer. Accounted as :class:`~userdp.accounting.mechanisms.BallsInBinsMechanism` with
``bin_semantics="fixed"`` and the strategy matrix C in ``correlation`` (Monte Carlo accountant
on the b-mode mixture dominating pair, seed 004 Lemma 3.2). σ is the multiplier of Z BEFORE C⁻¹,
as that mechanism defines it; the sensitivity of C is the accountant's business.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from userdp.accounting.mechanisms import BallsInBinsMechanism, CorrelationSpec, Mechanism
from userdp.strategies.base import Cohort, PrivacyFacts, Strategy, StrategyError, as_population
from userdp.strategies.blt import BandedNoise, Blt, BltNoise, optimize_banded, optimize_blt
from userdp.strategies.noise import NoiseRng
from userdp.strategies.optimizers import ServerOptimizer
from userdp.strategies.samplers import BallsInBinsSampler

__all__ = ["BltDpFtrl"]


class BltDpFtrl(Strategy):
    """DP-FTRL with a BLT (default: optimized for ``bins × epochs`` steps, min-sep ``bins``,
    ``epochs`` participations, ``buffers`` buffers) or a banded C (``banded_coefs`` given, or
    ``bands`` ≤ bins optimized the same way)."""

    def __init__(
        self,
        *,
        noise_multiplier: float,
        clip_norm: float,
        bins: int,
        epochs: int,
        blt: Blt | None = None,
        buffers: int = 2,
        banded_coefs: Sequence[float] | None = None,
        bands: int | None = None,
        seed: int | None = None,
        rng: NoiseRng | None = None,
        optimizer: ServerOptimizer | None = None,
    ) -> None:
        if sum(x is not None for x in (blt, banded_coefs, bands)) > 1:
            raise StrategyError("pass at most one of blt=, banded_coefs=, bands=")
        if bands is not None:
            if bands > bins:
                raise StrategyError(f"bands={bands} > bins={bins}: participations would overlap")
            banded_coefs, _ = optimize_banded(
                bins * epochs, bands, min_sep=bins, participations=epochs
            )
        if banded_coefs is not None:
            if len(banded_coefs) > bins:
                raise StrategyError(
                    f"banded_coefs has {len(banded_coefs)} bands > bins={bins}: participations "
                    "would overlap the band and the min-sep accounting would not hold"
                )
            noise: Any = BandedNoise(banded_coefs, rng)
            self.correlation = CorrelationSpec.of("banded", coefs=list(noise.coefs))
        else:
            if blt is None:
                blt, _ = optimize_blt(bins * epochs, buffers, min_sep=bins, participations=epochs)
            noise = BltNoise(blt, rng)
            self.correlation = blt.correlation()
        super().__init__(
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            unit="user",
            noise=noise,
            optimizer=optimizer,
        )
        self.blt = blt
        self.bins, self.epochs = int(bins), int(epochs)
        self.sampler = BallsInBinsSampler(bins, "fixed", seed)
        self._seed_given = seed is not None
        self._population_size: int | None = None

    def sample_cohort(self, step: int, population: Any) -> Cohort:
        if step >= self.bins * self.epochs:
            raise StrategyError(
                f"step {step} is past bins × epochs = {self.bins * self.epochs} (the declared run)"
            )
        users = as_population(population).user_ids
        self._population_size = len(users)
        positions = self.sampler.sample(step, len(users))
        return Cohort(
            step, tuple(users[i] for i in positions.tolist()), self.expected_cohort_size, "user"
        )

    @property
    def expected_cohort_size(self) -> float:
        if self._population_size is None:
            raise StrategyError("expected_cohort_size is known after the first sample_cohort")
        return self._population_size / self.bins

    def mechanism(self) -> Mechanism:
        return BallsInBinsMechanism(
            noise_multiplier=self.noise_multiplier,
            bins=self.bins,
            epochs=self.epochs,
            bin_semantics="fixed",
            correlation=self.correlation,
        )

    def facts(self) -> PrivacyFacts:
        caveats = [
            "correlated-noise buffers are checkpointed: protect checkpoints like noise",
            "the normalizer N/b uses the number of users N, treated as public",
        ]
        if self._seed_given:
            caveats.append("the sampler seed was given explicitly; amplification assumes it secret")
        return PrivacyFacts("user", "balls-in-bins-fixed", "add-remove", True, tuple(caveats))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.sampler.load_state_dict(state["sampler"])
