"""BLT-DP-FTRL: balls-in-bins users (bins fixed for the run) + BLT (or banded) correlated noise,
or cyclic Poisson users + banded noise.

Step t: cohort = users of bin t mod b (assigned once; "Near Exact Privacy Amplification for
Matrix Mechanisms", Def. 3.1); release Σ clip(g_u) + σ·C_clip·(C⁻¹Z)_t; the server divides by the
expected cohort N/b and steps its optimizer. Accounted as
:class:`~userdp.accounting.mechanisms.BallsInBinsMechanism` with ``bin_semantics="fixed"`` and the
strategy matrix C in ``correlation`` (Monte Carlo accountant on the b-mode mixture dominating
pair, same paper, Lemma 3.2). σ is the multiplier of Z BEFORE C⁻¹,
as that mechanism defines it; the sensitivity of C is the accountant's business.

With ``sampling_prob`` p given, users are assigned once to ``bins`` groups and step t
Poisson-samples group t mod b at rate p (:class:`~userdp.strategies.samplers.CyclicPoissonSampler`);
C must then be banded with at most ``bins`` bands, and the run is accounted as
:class:`~userdp.accounting.mechanisms.BandedPoissonMechanism` ("(Amplified) Banded Matrix
Factorization: A unified approach to private training").
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from userdp.accounting.facts import Sampling
from userdp.accounting.mechanisms import BallsInBinsMechanism, BandedPoissonMechanism, Mechanism
from userdp.strategies.base import Cohort, Strategy, StrategyError
from userdp.strategies.blt import BandedNoise, Blt, BltNoise, optimize_banded, optimize_blt
from userdp.strategies.builtins import N_CAVEAT
from userdp.strategies.noise import NoiseRng
from userdp.strategies.optimizers import ServerOptimizer
from userdp.strategies.samplers import BallsInBinsSampler, CyclicPoissonSampler

__all__ = ["BltDpFtrl"]


@functools.lru_cache(maxsize=8)
def optimized_blt(steps: int, buffers: int, min_sep: int, participations: int) -> Blt:
    """The BLT :func:`~userdp.strategies.blt.optimize_blt` finds for a run. A run's build
    optimizes it once (the strategy is built once and calibrated on its mechanism value); the
    cache (it is deterministic) saves the optimization when one process builds the same run
    again (a notebook or a test that builds twice)."""
    return optimize_blt(steps, buffers, min_sep=min_sep, participations=participations)[0]


@functools.lru_cache(maxsize=8)
def optimized_banded(steps: int, bands: int, min_sep: int, participations: int) -> tuple:
    """The banded coefficients :func:`~userdp.strategies.blt.optimize_banded` finds for a run,
    computed once per process (as :func:`optimized_blt`)."""
    return tuple(optimize_banded(steps, bands, min_sep=min_sep, participations=participations)[0])


class BltDpFtrl(Strategy):
    """DP-FTRL with a BLT (default: optimized for ``bins × epochs`` steps, min-sep ``bins``,
    ``epochs`` participations, ``buffers`` buffers) or a banded C (``banded_coefs`` given, or
    ``bands`` ≤ bins optimized the same way)."""

    samplings = ("balls-in-bins-fixed", "cyclic-poisson")
    banded_samplings = ("balls-in-bins-fixed", "cyclic-poisson")

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
        sampling_prob: float | None = None,
        expected_cohort_size: float | None = None,
        seed: int | None = None,
        rng: NoiseRng | None = None,
        optimizer: ServerOptimizer | None = None,
    ) -> None:
        if sum(x is not None for x in (blt, banded_coefs, bands)) > 1:
            raise StrategyError("pass at most one of blt=, banded_coefs=, bands=")
        if sampling_prob is not None and banded_coefs is None and bands is None:
            raise StrategyError(
                "cyclic Poisson sampling (sampling_prob=) needs a banded C: pass bands= or "
                "banded_coefs= (a BLT couples a user's participations)"
            )
        if bands is not None:
            if bands > bins:
                raise StrategyError(f"bands={bands} > bins={bins}: participations would overlap")
            banded_coefs = optimized_banded(bins * epochs, bands, bins, epochs)
        if banded_coefs is not None:
            if len(banded_coefs) > bins:
                raise StrategyError(
                    f"banded_coefs has {len(banded_coefs)} bands > bins={bins}: participations "
                    "would overlap the band and the min-sep accounting would not hold"
                )
            noise: Any = BandedNoise(banded_coefs, rng)
            self.correlation = noise.banded.spec()
        else:
            if blt is None:
                blt = optimized_blt(bins * epochs, buffers, bins, epochs)
            noise = BltNoise(blt, rng)
            self.correlation = blt.correlation()
        super().__init__(
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            sampler=BallsInBinsSampler(bins, Sampling.BALLS_IN_BINS_FIXED, seed)
            if sampling_prob is None
            else CyclicPoissonSampler(bins, sampling_prob, seed),
            unit="user",
            noise=noise,
            optimizer=optimizer,
            expected_cohort_size=expected_cohort_size,
        )
        self.blt = blt
        self.bins, self.epochs = int(bins), int(epochs)

    def sample_cohort(self, step: int, population: Any) -> Cohort:
        if step >= self.bins * self.epochs:
            raise StrategyError(
                f"step {step} is past bins × epochs = {self.bins * self.epochs} (the declared run)"
            )
        return super().sample_cohort(step, population)

    def mechanism(self) -> Mechanism:
        if isinstance(self.sampler, CyclicPoissonSampler):
            return BandedPoissonMechanism(
                noise_multiplier=self.noise_multiplier,
                sampling_prob=self.sampler.sampling_prob,
                bands=self.bins,
                correlation=self.correlation,
            )
        return BallsInBinsMechanism(
            noise_multiplier=self.noise_multiplier,
            bins=self.bins,
            epochs=self.epochs,
            bin_semantics=self.sampler.sampling.bin_semantics,
            correlation=self.correlation,
        )

    def caveats(self) -> tuple[str, ...]:
        return (
            *super().caveats(),
            "correlated-noise buffers are checkpointed: protect checkpoints like noise",
            *((N_CAVEAT,) if self.fixed_cohort_size is None else ()),
        )
