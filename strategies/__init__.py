"""Strategies: the DP mechanism as one object (unit, sampler, clipping, noise, event).

Subclass :class:`Strategy` (see docs/strategies.md) or use a built-in::

    from userdp.strategies import UserLevelSampling, Adam
    strategy = UserLevelSampling(noise_multiplier=1.1, clip_norm=1.0, sampling_prob=0.01,
                                 optimizer=Adam(1e-3))
"""

from userdp.strategies.adaptive_clipping import AdaptiveClipping
from userdp.strategies.base import (
    ClipStatistics,
    Cohort,
    PopulationCounts,
    PrivacyFacts,
    Strategy,
    StrategyError,
    TaskSpec,
    as_population,
    example_unit_id,
    parse_example_unit_id,
)
from userdp.strategies.blt import Blt, BltNoise, optimize_blt
from userdp.strategies.builtins import (
    DpFedAvg,
    ExampleLevelSampling,
    GroupPrivacyComparison,
    RandomizedClipping,
    UserLevelSampling,
)
from userdp.strategies.compute_budget import estimate_and_double
from userdp.strategies.dpftrl import BltDpFtrl
from userdp.strategies.noise import GaussianNoise, NoiseMechanism, NoiseRng
from userdp.strategies.optimizers import Adafactor, Adam, ServerOptimizer, Sgd, make_optimizer

__all__ = [
    "Adafactor",
    "Adam",
    "AdaptiveClipping",
    "Blt",
    "BltDpFtrl",
    "BltNoise",
    "ClipStatistics",
    "Cohort",
    "DpFedAvg",
    "ExampleLevelSampling",
    "GaussianNoise",
    "GroupPrivacyComparison",
    "NoiseMechanism",
    "NoiseRng",
    "PopulationCounts",
    "PrivacyFacts",
    "RandomizedClipping",
    "ServerOptimizer",
    "Sgd",
    "Strategy",
    "StrategyError",
    "TaskSpec",
    "UserLevelSampling",
    "as_population",
    "estimate_and_double",
    "example_unit_id",
    "make_optimizer",
    "optimize_blt",
    "parse_example_unit_id",
]
