"""Strategies: the DP mechanism as one object (sampler, clipping, noise, mechanism).

Subclass :class:`Strategy` (docs/strategies.md; name it in a config as
``"package.module:ClassName"``) or use a built-in::

    from userdp.strategies import UserLevelSampling, Adam
    strategy = UserLevelSampling(noise_multiplier=1.1, clip_norm=1.0, sampling_prob=0.01,
                                 optimizer=Adam(1e-3))
"""

from userdp.strategies.adaptive_clipping import AdaptiveClipping
from userdp.strategies.base import (
    Adjacency,
    ClipStatistics,
    Cohort,
    NoisyStatistic,
    PopulationCounts,
    PrivacyFacts,
    Release,
    Sampling,
    Strategy,
    StrategyError,
    TaskSpec,
    Unit,
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
from userdp.strategies.samplers import (
    BallsInBinsSampler,
    PoissonSampler,
    Sampler,
    ShuffleSampler,
    TruncatedSampler,
    make_sampler,
)
from userdp.strategies.step import ExecutionOptions, Gathered, begin_step, finish_step, run_step

__all__ = [
    "Adafactor",
    "Adam",
    "AdaptiveClipping",
    "Adjacency",
    "BallsInBinsSampler",
    "Blt",
    "BltDpFtrl",
    "BltNoise",
    "ClipStatistics",
    "Cohort",
    "DpFedAvg",
    "ExampleLevelSampling",
    "ExecutionOptions",
    "Gathered",
    "GaussianNoise",
    "GroupPrivacyComparison",
    "NoiseMechanism",
    "NoiseRng",
    "NoisyStatistic",
    "PoissonSampler",
    "PopulationCounts",
    "PrivacyFacts",
    "RandomizedClipping",
    "Release",
    "Sampler",
    "Sampling",
    "ServerOptimizer",
    "Sgd",
    "ShuffleSampler",
    "Strategy",
    "StrategyError",
    "TaskSpec",
    "TruncatedSampler",
    "Unit",
    "UserLevelSampling",
    "as_population",
    "begin_step",
    "estimate_and_double",
    "finish_step",
    "example_unit_id",
    "make_optimizer",
    "make_sampler",
    "optimize_blt",
    "parse_example_unit_id",
    "run_step",
]
