"""Strategies: the DP mechanism as one object (sampler, clipping, noise, mechanism).

Subclass :class:`Strategy` (docs/strategies.md; name it in a config as
``"package.module:ClassName"``) or use a built-in::

    from userdp.strategies import UserLevelSampling, Adam
    strategy = UserLevelSampling(noise_multiplier=1.1, clip_norm=1.0, sampling_prob=0.01,
                                 optimizer=Adam(1e-3))

The names below are loaded on first use, so a plugin importing :class:`Strategy` does not load
the optimizers of BLT (scipy) or anything else it does not use.
"""

import importlib

# public name -> the module of this package that defines it
_EXPORTS = {
    "AboveThreshold": "above_threshold",
    "AdaptiveClipping": "adaptive_clipping",
    "Adjacency": "base",
    "Cohort": "base",
    "NoisyStatistic": "base",
    "PrivacyFacts": "base",
    "Release": "base",
    "Sampling": "base",
    "Strategy": "base",
    "TaskSpec": "base",
    "Unit": "base",
    "Blt": "blt",
    "BltNoise": "blt",
    "optimize_blt": "blt",
    "DpFedAvg": "builtins",
    "ExampleLevelSampling": "builtins",
    "GroupPrivacyComparison": "builtins",
    "RandomizedClipping": "builtins",
    "UserLevelSampling": "builtins",
    "estimate_and_double": "compute_budget",
    "BltDpFtrl": "dpftrl",
    "StrategyError": "errors",
    "GaussianNoise": "noise",
    "NoiseMechanism": "noise",
    "NoiseRng": "noise",
    "Adafactor": "optimizers",
    "Adam": "optimizers",
    "ServerOptimizer": "optimizers",
    "Sgd": "optimizers",
    "make_optimizer": "optimizers",
    "PopulationCounts": "population",
    "as_population": "population",
    "example_unit_id": "population",
    "parse_example_unit_id": "population",
    "BallsInBinsSampler": "samplers",
    "PoissonSampler": "samplers",
    "Sampler": "samplers",
    "ShuffleSampler": "samplers",
    "TruncatedSampler": "samplers",
    "make_sampler": "samplers",
    "ExecutionOptions": "step",
    "CohortSum": "step",
    "begin_step": "step",
    "finish_step": "step",
    "run_step": "step",
    "UnitStats": "unit_stats",
    "TrainingHalted": "user_filter",
    "UserWiseFilter": "user_filter",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'userdp.strategies' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"userdp.strategies.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
