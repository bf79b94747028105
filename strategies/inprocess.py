"""Run a strategy's hooks in one process against a compute function: the reference step loop.

This is the smallest faithful version of the coordinator's step (DESIGN.md steps 1–9): sample,
configure, compute partial sums on "workers", aggregate, noise, ledger FIRST, update. It has no
network, retries or checkpoints; tests, tutorials and the Flower adapter use it, and the
coordinator must behave the same way on the same hooks.

``compute(task, unit_ids, params) -> (partial_sum, ClipStatistics)`` plays one worker: for each
unit it computes the update at ``params``, clips it to ``task.clip_norm`` and returns the sum.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from userdp.strategies.base import ClipStatistics, Cohort, Strategy, TaskSpec, as_population
from userdp.strategies.tensors import zeros_like

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
    test_only_disable_noise: bool = False,
) -> StepRecord:
    """One step; ``params`` is updated in place. ``ledger`` needs ``append(step, mechanism)``.

    ``test_only_disable_noise`` skips the noise (NOT PRIVATE) so tests can compare with the
    coordinator's noiseless mode; no config key or CLI flag reaches it."""
    population = as_population(population)
    mechanism = strategy.mechanism()
    if ledger is not None and hasattr(ledger, "check_budget"):
        ledger.check_budget(mechanism)
    cohort: Cohort = strategy.sample_cohort(step, population)
    task = strategy.task_for(step, cohort)
    units = list(cohort.unit_ids)
    shares = [units[i::workers] for i in range(workers)]
    partials, stats = [], []
    for share in shares:
        if share:
            partial, stat = compute(task, share, params)
        else:
            partial = {name: zeros_like(value) for name, value in params.items()}
            stat = ClipStatistics(0, 0)
        partials.append(partial)
        stats.append(stat)
    summed = strategy.aggregate(partials)
    total = ClipStatistics(sum(s.units for s in stats), sum(s.clipped for s in stats))
    noisy = summed if test_only_disable_noise else strategy.add_noise(step, summed, total)
    if ledger is not None:
        ledger.append(step, mechanism)  # before anything derived from `noisy` is released
    strategy.server_update(params, noisy, cohort)
    return StepRecord(step, len(units), cohort.expected_size, total.clipped, task.clip_norm)


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
