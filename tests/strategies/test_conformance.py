"""The conformance kit (userdp.testing.check_strategy) passes on every built-in strategy and the
example plugin, and fails — naming the property — on strategies with one classic DP bug each."""

from __future__ import annotations

import numpy as np
import pytest
from userdp.accounting.facts import Adjacency
from userdp.accounting.mechanisms import UlsMechanism
from userdp.strategies import (
    AdaptiveClipping,
    Blt,
    DpFedAvg,
    ExampleLevelSampling,
    GroupPrivacyComparison,
    NoiseRng,
    RandomizedClipping,
    UserLevelSampling,
)
from userdp.strategies.base import NoisyStatistic, Release
from userdp.strategies.dpftrl import BltDpFtrl
from userdp.strategies.noise import GaussianNoise
from userdp.strategies.samplers import PoissonSampler

from userdp.testing import CHECKS, StrategyCheckError, check_strategy

from .helpers import example_plugin

WarmupUls = example_plugin()

SIGMA, CLIP, Q = 1.3, 0.7, 0.05


def uls(**kw):
    return UserLevelSampling(noise_multiplier=SIGMA, clip_norm=CLIP, sampling_prob=Q, **kw)


BUILTINS = {
    "uls": uls,
    "uls-padding": lambda: uls(sampling="padding", cohort_cap=30),
    "uls-shuffle": lambda: uls(sampling="shuffle"),
    "uls-balls-in-bins": lambda: UserLevelSampling(
        noise_multiplier=SIGMA, clip_norm=CLIP, sampling="balls-in-bins-epoch", bins=20, epochs=3
    ),
    "els": lambda: ExampleLevelSampling(
        noise_multiplier=SIGMA, clip_norm=CLIP, sampling_prob=0.02, group_size=4
    ),
    "group-privacy": lambda: GroupPrivacyComparison(
        noise_multiplier=SIGMA, clip_norm=CLIP, sampling_prob=0.02, group_size=4
    ),
    "dp-fedavg": lambda: DpFedAvg(
        noise_multiplier=SIGMA, clip_norm=CLIP, sampling_prob=Q, local_steps=2, local_lr=0.1
    ),
    "adaptive-clipping": lambda: AdaptiveClipping(
        noise_multiplier=SIGMA, clip_norm=CLIP, sampling_prob=Q, count_stddev=1.0
    ),
    "randomized-clipping": lambda: RandomizedClipping(
        noise_multiplier=SIGMA, clip_norm=CLIP, sampling_prob=Q, probes=16
    ),
    "blt-dp-ftrl-banded": lambda: BltDpFtrl(
        noise_multiplier=SIGMA, clip_norm=CLIP, bins=20, epochs=2, banded_coefs=[1.0, 0.5]
    ),
    "blt-dp-ftrl-cyclic-poisson": lambda: BltDpFtrl(
        noise_multiplier=SIGMA,
        clip_norm=CLIP,
        bins=4,
        epochs=75,  # 300 steps: the kit's sampling check runs whole cycles of them
        banded_coefs=[1.0, 0.5],
        sampling_prob=0.3,
    ),
    "blt-dp-ftrl": lambda: BltDpFtrl(
        noise_multiplier=SIGMA, clip_norm=CLIP, bins=20, epochs=2, blt=Blt((0.9,), (0.3,))
    ),
    "example-plugin": lambda: WarmupUls(
        noise_multiplier=SIGMA, clip_norm=CLIP, sampling_prob=Q, learning_rate=0.5
    ),
}
NOT_APPLICABLE = {  # checks that do not apply, and why
    "uls-padding": {"sampling"},  # truncated cohorts: no Poisson law to test
    "uls-shuffle": {"sampling"},  # no accountant matches; the facts say so
}


@pytest.mark.parametrize("name", sorted(BUILTINS))
def test_every_builtin_passes(name):
    result = check_strategy(BUILTINS[name])
    assert set(result.skipped) == NOT_APPLICABLE.get(name, set())
    assert set(result.passed) | set(result.skipped) == set(CHECKS)


# ---- one bug each ------------------------------------------------------------------------------


class NoiseNotScaledByClip(WarmupUls):
    def add_noise(self, step, summed, stats=None):
        return self.noise.add(step, summed, std=self.noise_multiplier)


class DividesByRealizedCohort(WarmupUls):
    def server_update(self, params, release):
        self.optimizer.step(
            params, {k: v / len(release.cohort) for k, v in release.noisy_sum.items()}
        )


class CountReleasedWithoutNoise(AdaptiveClipping):
    def privatize(self, step, summed, stats, cohort):
        exact = (stats.count - stats.clipped - 0.5 * stats.count) / cohort.expected_size + 0.5
        fraction = NoisyStatistic(exact, 0.5 / cohort.expected_size)
        return Release(step, cohort, self.add_noise(step, summed), {"unclipped_fraction": fraction})


class FixedNoiseSeed(WarmupUls):
    """Noise from a fixed seed: a restored run replays the original's noise."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.noise = GaussianNoise(NoiseRng.for_testing(7))

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.noise = GaussianNoise(NoiseRng.for_testing(7))


class SamplesWithReplacement(PoissonSampler):
    def sample(self, step, n):
        drawn = super().sample(step, n)
        return np.sort(np.concatenate([drawn, drawn[:1]]))


class DuplicateUnits(WarmupUls):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.sampler = SamplesWithReplacement(Q)


class WrongQInLedger(WarmupUls):
    def mechanism(self):
        return UlsMechanism(self.noise_multiplier, Q / 2)


class PaddingClaimsAddRemove(UserLevelSampling):
    def facts(self):
        from dataclasses import replace

        return replace(super().facts(), adjacency=Adjacency.ADD_REMOVE)


class SamplerNotCheckpointed(WarmupUls):
    def state_dict(self):
        state = super().state_dict()
        state["sampler"] = PoissonSampler(Q).state_dict()  # a fresh seed, not the run's
        return state


class BltNoiseNotCorrelated(BltDpFtrl):
    def add_noise(self, step, summed, stats=None):
        self.noise._advance(step)
        std = self.noise_multiplier * self.clip_norm
        return {k: v + std * self.noise.rng.normal_like(v) for k, v in summed.items()}


class CyclicPoissonIgnoresGroups(BltDpFtrl):
    """Poisson-samples ALL users every step but reports the banded-Poisson accountant (which
    needs every user's steps b̂ apart)."""

    def sample_cohort(self, step, population):
        self.sampler = PoissonSampler(0.3, seed=1)
        return super().sample_cohort(step, population)


class NoiseAddedByHand(WarmupUls):
    """The right std from the secure generator, but added as x + std·z: off the grid."""

    def add_noise(self, step, summed, stats=None):
        std = self.noise_multiplier * self.clip_norm
        return {k: v + std * self.noise.rng.normal_like(v) for k, v in summed.items()}


def _warmup(cls):
    return lambda: cls(noise_multiplier=SIGMA, clip_norm=CLIP, sampling_prob=Q, learning_rate=0.5)


BUGS = {
    "noise": [
        _warmup(NoiseNotScaledByClip),
        lambda: CountReleasedWithoutNoise(
            noise_multiplier=SIGMA, clip_norm=CLIP, sampling_prob=Q, count_stddev=1.0
        ),
        lambda: BltNoiseNotCorrelated(
            noise_multiplier=SIGMA, clip_norm=CLIP, bins=20, epochs=2, banded_coefs=[1.0, 0.5]
        ),
        _warmup(NoiseAddedByHand),
    ],
    "normalization": [_warmup(DividesByRealizedCohort)],
    "exactly_once": [_warmup(DuplicateUnits)],
    "fresh_noise": [_warmup(FixedNoiseSeed), _warmup(SamplerNotCheckpointed)],
    "sampling": [
        _warmup(WrongQInLedger),
        lambda: CyclicPoissonIgnoresGroups(
            noise_multiplier=SIGMA,
            clip_norm=CLIP,
            bins=4,
            epochs=75,
            banded_coefs=[1.0, 0.5],
            sampling_prob=0.3,
        ),
    ],
    "facts": [
        lambda: PaddingClaimsAddRemove(
            noise_multiplier=SIGMA,
            clip_norm=CLIP,
            sampling_prob=Q,
            sampling="padding",
            cohort_cap=30,
        )
    ],
}


@pytest.mark.parametrize(
    "check, factory",
    [(check, f) for check, factories in BUGS.items() for f in factories],
    ids=[f"{check}-{i}" for check, factories in BUGS.items() for i in range(len(factories))],
)
def test_a_bug_fails_its_check(check, factory):
    with pytest.raises(StrategyCheckError, match=rf"(?m)^{check}: "):
        check_strategy(factory, checks=[check])


def test_every_check_has_a_bug_that_fails_it():
    assert set(BUGS) == set(CHECKS)


def test_failures_are_collected_and_named():
    with pytest.raises(StrategyCheckError) as info:
        check_strategy(_warmup(NoiseNotScaledByClip))
    assert "NoiseNotScaledByClip fails 1 check(s)" in str(info.value)
    assert "\nnoise: " in str(info.value)
