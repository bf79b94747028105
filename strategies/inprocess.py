"""Run a strategy's hooks in one process against a compute function: the reference step loop.

The step is :func:`userdp.strategies.step.run_step`; this module only supplies its gather: the
cohort's units dealt round-robin to ``workers`` calls of ``compute`` and summed with
:func:`~userdp.strategies.tensors.sum_tensor_dicts`. No network, retries or checkpoints; tests, tutorials and ``userdp
simulate --in-process`` use it.

``compute(task, unit_ids, params) -> (partial_sum, ClipStatistics)`` plays one worker: for each
unit it computes the update at ``params``, clips it to ``task.clip_norm`` and returns the sum.
For a strategy with ``needs_unit_updates`` every unit is its own call, so each partial sum is
one unit's clipped update, and the step receives them all (``Gathered.units``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from userdp.strategies.base import ClipStatistics, Release, Strategy, TaskSpec, as_population
from userdp.strategies.step import ExecutionOptions, Gathered, PlannedStep
from userdp.strategies.step import run_step as run_one_step
from userdp.strategies.tensors import sum_tensor_dicts, zeros_like

__all__ = ["StepRecord", "run_step", "run_steps"]

Compute = Callable[
    [TaskSpec, Sequence[str], Mapping[str, Any]], tuple[dict[str, Any], ClipStatistics]
]


@dataclass(frozen=True)
class StepRecord:
    step: int
    units: int
    expected_size: float
    clipped: int
    clip_norm: float


def run_step(
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
    """One step; ``params`` is updated in place. ``ledger`` needs ``append(step, mechanism)``
    (and ``check_budget(mechanism)`` when it has a budget).

    ``test_only_disable_noise`` skips the noise (NOT PRIVATE) so tests can compare with the
    coordinator's noiseless mode; no config key or CLI flag reaches it."""

    def gather_units(planned: PlannedStep) -> Gathered:
        updates, units_done, clipped = {}, 0, 0
        for unit in planned.cohort.unit_ids:
            updates[unit], stat = compute(planned.task, [unit], params)
            units_done, clipped = units_done + stat.units, clipped + stat.clipped
        partials = list(updates.values()) or [
            {name: zeros_like(value) for name, value in params.items()}
        ]
        stats = ClipStatistics(units_done, clipped)
        return Gathered(sum_tensor_dicts(partials), stats, units=updates)

    def gather(planned: PlannedStep) -> Gathered:
        units = list(planned.cohort.unit_ids)
        partials, units_done, clipped = [], 0, 0
        for share in (units[i::workers] for i in range(workers)):
            if share:
                partial, stat = compute(planned.task, share, params)
                units_done, clipped = units_done + stat.units, clipped + stat.clipped
            else:
                partial = {name: zeros_like(value) for name, value in params.items()}
            partials.append(partial)
        return Gathered(sum_tensor_dicts(partials), ClipStatistics(units_done, clipped))

    planned, gathered, _ = run_one_step(
        strategy,
        step,
        population,
        params,
        gather_units if strategy.needs_unit_updates else gather,
        ledger,
        options=options,
        on_release=on_release,
        test_only_disable_noise=test_only_disable_noise,
        unit_updates=True,
    )
    cohort = planned.cohort
    return StepRecord(
        step, len(cohort), cohort.expected_size, gathered.stats.clipped, planned.task.clip_norm
    )


def run_steps(
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
    """Steps ``start .. start + steps − 1`` of :func:`run_step`."""
    population = as_population(population)
    return [
        run_step(strategy, s, params, population, compute, ledger=ledger, workers=workers)
        for s in range(start, start + steps)
    ]
