"""Run-level execution options reach every task but can never change the mechanism: estimated
norms (the randomized engine) need the randomized-clipping accountant."""

from __future__ import annotations

import numpy as np
import pytest
from userdp.strategies.base import Cohort, StrategyError
from userdp.strategies.builtins import RandomizedClipping, UserLevelSampling
from userdp.strategies.step import CohortSum, ExecutionOptions, run_step
from userdp.strategies.unit_stats import UnitStats

from userdp.config import parse_config
from userdp.run.components import execution_options
from userdp.run.registry import build_strategy

COHORT = Cohort(step=0, unit_ids=("u1",), expected_size=1.0)


def test_options_reach_the_task_of_an_exact_strategy() -> None:
    uls = UserLevelSampling(noise_multiplier=1.0, clip_norm=1.0, sampling_prob=0.1, group_size=4)
    options = ExecutionOptions(engine="loop", token_budget=512, selection="longest", seq_len=64)
    spec = options.apply(uls.configure_task(0, COHORT))
    assert (spec.engine, spec.token_budget, spec.selection, spec.seq_len) == (
        "loop",
        512,
        "longest",
        64,
    )
    assert spec.group_size == 4 and spec.clip_norm == 1.0  # the strategy's own fields stay


def test_the_step_hands_the_options_to_the_gather() -> None:
    uls = UserLevelSampling(noise_multiplier=1.0, clip_norm=1.0, sampling_prob=0.5, seed=1)
    seen = []

    def gather(planned):
        seen.append(planned.task)
        return CohortSum({"w": np.zeros(1)}, UnitStats(count=len(planned.cohort)))

    params = {"w": np.zeros(1)}
    run_step(uls, 0, params, ["a", "b"], gather, options=ExecutionOptions(token_budget=77))
    assert seen[0].token_budget == 77 and seen[0].engine == "vectorized"


def test_an_exact_strategy_cannot_be_switched_to_estimated_norms() -> None:
    with pytest.raises(StrategyError, match="changes the mechanism"):
        ExecutionOptions(engine="randomized")
    with pytest.raises(TypeError):
        ExecutionOptions(clip_norm=5.0)  # type: ignore[call-arg]


def test_randomized_clipping_keeps_its_engine() -> None:
    rc = RandomizedClipping(probes=8, noise_multiplier=1.0, clip_norm=1.0, sampling_prob=0.1)
    options = ExecutionOptions(engine="vectorized", token_budget=256)
    spec = options.apply(rc.configure_task(0, COHORT))
    assert spec.engine == "randomized" and spec.probes == 8 and spec.token_budget == 256


def test_config_refuses_the_randomized_engine_without_its_accountant() -> None:
    config = parse_config({"strategy": {"name": "uls", "engine": "randomized"}})
    with pytest.raises(ValueError, match="randomized-clipping"):
        build_strategy(config, 100, 1.0)
    config = parse_config({"strategy": {"name": "randomized-clipping", "engine": "randomized"}})
    strategy = build_strategy(config, 100, 1.0)
    spec = execution_options(config).apply(strategy.configure_task(0, COHORT))
    assert spec.engine == "randomized"
