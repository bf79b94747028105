"""Run a strategy's hooks in one process against a compute function: the reference step loop.

The step is :func:`userdp.strategies.step.run_step`; :func:`run_local_step` only supplies its
gather: the cohort's units dealt round-robin to ``workers`` calls of ``compute`` and summed with
:func:`~userdp.strategies.tensors.sum_tensor_dicts`. No network, retries or checkpoints; tests,
tutorials and ``userdp simulate --in-process`` use it.

``compute(task, unit_ids, params) -> (task_sum, UnitStats)`` plays one worker: for each unit it
computes the update at ``params``, clips it to ``task.clip_norm`` and returns the sum. For a
strategy with ``needs_unit_updates`` every unit is its own call, so each task sum is one unit's
clipped update, and the step receives them all (``CohortSum.unit_updates``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from userdp.strategies.base import Release, Strategy, TaskSpec, as_population
from userdp.strategies.step import CohortSum, ExecutionOptions, PlannedStep, run_step
from userdp.strategies.tensors import sum_tensor_dicts, zeros_like
from userdp.strategies.unit_stats import UnitStats

__all__ = ["StepRecord", "run_local_step", "run_local_steps"]

Compute = Callable[[TaskSpec, Sequence[str], Mapping[str, Any]], tuple[dict[str, Any], UnitStats]]


@dataclass(frozen=True)
class StepRecord:
    step: int
    units: int
    expected_size: float
    clipped: int
    clip_norm: float


def run_local_step(
    strategy: Strategy,
    step: int,
    params: dict[str, Any],
    population: Any,
    compute: Compute,
    *,
    ledger: Any = None,
    workers: int = 2,
    options: ExecutionOptions | None = None,
    on_release: Callable[[Release], None] | None = None,
    test_only_disable_noise: bool = False,
) -> StepRecord:
    """One step of :func:`~userdp.strategies.step.run_step` gathered from local ``compute`` calls;
    ``params`` is updated in place. ``ledger`` needs ``append(step, mechanism)``
    (and ``check_budget(mechanism)`` when it has a budget).

    ``test_only_disable_noise`` skips the noise (NOT PRIVATE) so tests can compare with the
    coordinator's noiseless mode; no config key or CLI flag reaches it."""

    def gather_units(planned: PlannedStep) -> CohortSum:
        updates, stats = {}, UnitStats()
        for unit in planned.cohort.unit_ids:
            updates[unit], unit_stats = compute(planned.task, [unit], params)
            stats += unit_stats
        task_sums = list(updates.values()) or [
            {name: zeros_like(value) for name, value in params.items()}
        ]
        return CohortSum(sum_tensor_dicts(task_sums), stats, unit_updates=updates)

    def gather(planned: PlannedStep) -> CohortSum:
        units = list(planned.cohort.unit_ids)
        task_sums, stats = [], UnitStats()
        for share in (units[i::workers] for i in range(workers)):
            if share:
                task_sum, task_stats = compute(planned.task, share, params)
                stats += task_stats
            else:
                task_sum = {name: zeros_like(value) for name, value in params.items()}
            task_sums.append(task_sum)
        return CohortSum(sum_tensor_dicts(task_sums), stats)

    planned, cohort_sum, _ = run_step(
        strategy,
        step,
        params,
        population,
        gather_units if strategy.needs_unit_updates else gather,
        ledger,
        options=options,
        on_release=on_release,
        test_only_disable_noise=test_only_disable_noise,
        unit_updates=True,
    )
    cohort = planned.cohort
    return StepRecord(
        step, len(cohort), cohort.expected_size, cohort_sum.stats.clipped, planned.task.clip_norm
    )


def run_local_steps(
    strategy: Strategy,
    params: dict[str, Any],
    population: Any,
    compute: Compute,
    steps: int,
    *,
    ledger: Any = None,
    start: int = 0,
    workers: int = 2,
) -> list[StepRecord]:
    """Steps ``start .. start + steps − 1`` of :func:`run_local_step`."""
    population = as_population(population)
    return [
        run_local_step(strategy, s, params, population, compute, ledger=ledger, workers=workers)
        for s in range(start, start + steps)
    ]
