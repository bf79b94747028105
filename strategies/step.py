"""The step contract, written once: sample → task → gather → privatize → ledger → update.

The coordinator (:mod:`userdp.server.coordinator`), the in-process loop
(:mod:`userdp.strategies.local_step`), the Flower adapter (:mod:`userdp.run.flower`) and
``userdp audit`` all run a step through this module; they differ only in how the clipped
partial sums are gathered (gRPC tasks with retries, a local function, Flower messages), which
they pass in. The order is the privacy contract:

1. the step's mechanism is checked against the ledger's budget before any work;
2. the strategy samples the cohort (data-independent) and configures the task;
3. the caller gathers the :class:`CohortSum`: the sum of CLIPPED unit updates over the cohort,
   exactly once per unit (and every unit's own update for a strategy with
   ``needs_unit_updates``, which only a caller that says ``unit_updates=True`` gathers; the
   others refuse it before any work);
4. the strategy privatizes it into a :class:`~userdp.strategies.base.Release` (fresh noise; a
   retried step draws new noise);
5. the ledger records the mechanism and a commitment to the release
   (:mod:`~userdp.strategies.release_commitment`) — fsync'd — BEFORE anything derived from the
   release leaves (a replayed step that was charged before a crash is not charged again);
6. ``on_release`` observers see the release (an auditor sees exactly what is published);
7. the strategy's server update applies it (post-processing).

Transports whose gather is a callback chain (Flower's configure/aggregate) call
:func:`begin_step` and :func:`finish_step`; the others call :func:`run_step`, which is the two
around a gather function.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from userdp.accounting.ledger import Ledger
from userdp.accounting.mechanisms import Mechanism
from userdp.strategies.base import Cohort, Release, Strategy, StrategyError, TaskSpec
from userdp.strategies.noise import noise_mode
from userdp.strategies.release_commitment import release_sha256
from userdp.strategies.unit_stats import UnitStats

__all__ = [
    "EXACT_ENGINES",
    "CohortSum",
    "ExecutionOptions",
    "PlannedStep",
    "begin_step",
    "finish_step",
    "run_step",
]

log = logging.getLogger(__name__)

EXACT_ENGINES = ("loop", "vectorized", "ghost")
"""Engines that compute every unit's exact norm: interchangeable without changing the mechanism."""


@dataclass(frozen=True)
class ExecutionOptions:
    """Run-level task options that do not change the mechanism (None = the strategy's value).

    ``engine`` must be an EXACT engine and replaces only an exact engine: a strategy that chose
    the randomized engine keeps it, since its accountant depends on it."""

    engine: str | None = None
    token_budget: int | None = None
    selection: str | None = None
    seq_len: int | None = None

    def __post_init__(self) -> None:
        if self.engine is not None and self.engine not in EXACT_ENGINES:
            raise StrategyError(
                f"engine={self.engine!r} changes the mechanism (estimated norms need their own "
                "accountant): use the randomized-clipping strategy instead of a run option"
            )

    def apply(self, spec: TaskSpec) -> TaskSpec:
        """``spec`` with these options set."""
        options = {f.name: getattr(self, f.name) for f in fields(self)}
        options = {k: v for k, v in options.items() if v is not None}
        if spec.engine not in EXACT_ENGINES:
            options.pop("engine", None)
        return replace(spec, **options) if options else spec


@dataclass(frozen=True)
class CohortSum:
    """Σ clip(g_u, C) over one step's cohort, every unit counted exactly once, and the units'
    statistics (the sum of the workers' task sums).

    ``unit_updates``: every unit's own clipped update (unit id → tensor dict), gathered only for
    a strategy with ``needs_unit_updates``; None otherwise."""

    sums: Mapping[str, Any]
    stats: UnitStats
    unit_updates: Mapping[str, Mapping[str, Any]] | None = None


@dataclass(frozen=True)
class PlannedStep:
    """A step between :func:`begin_step` and :func:`finish_step`."""

    step: int
    mechanism: Mechanism
    cohort: Cohort
    task: TaskSpec


Phase = Callable[[str], None]


def _phase(on_phase: Phase | None, name: str) -> None:
    if on_phase is not None:
        on_phase(name)


def begin_step(
    strategy: Strategy,
    step: int,
    population: Any,
    ledger: Any = None,
    *,
    options: ExecutionOptions | None = None,
    charge: bool = True,
    on_phase: Phase | None = None,
    unit_updates: bool = False,
) -> PlannedStep:
    """Steps 1–2: the budget check (skipped for a replay, ``charge=False``), the cohort and the
    task every worker of the step gets. ``unit_updates``: the caller's gather returns every
    unit's own update (:attr:`CohortSum.unit_updates`); a strategy that needs them is refused without."""
    if strategy.needs_unit_updates and not unit_updates:
        raise StrategyError(
            f"{type(strategy).__name__} needs every user's own clipped update, which only the "
            "in-process step gathers (workers of a coordinator return one sum per task): run "
            "it with `userdp simulate --in-process` or choose another strategy.name"
        )
    mechanism = strategy.mechanism()
    check = getattr(ledger, "check_budget", None)
    if charge and check is not None and getattr(ledger, "budget", True) is not None:
        check(mechanism)
    _phase(on_phase, "sample")
    cohort = strategy.sample_cohort(step, population)
    task = strategy.configure_task(step, cohort)
    if options is not None:
        task = options.apply(task)
    return PlannedStep(step, mechanism, cohort, task)


def finish_step(
    strategy: Strategy,
    planned: PlannedStep,
    cohort_sum: CohortSum,
    params: dict[str, Any],
    ledger: Any = None,
    *,
    charge: bool = True,
    on_phase: Phase | None = None,
    on_release: Callable[[Release], None] | None = None,
    test_only_disable_noise: bool = False,
) -> Release:
    """Steps 4–7 on the cohort's clipped sum; ``params`` is updated in place.

    ``charge=False`` for a step the ledger already holds (charged before a crash, never
    released). ``test_only_disable_noise`` (NOT PRIVATE) exists for tests that compare
    transports with a noiseless reference; no config key or CLI flag reaches it."""
    step, cohort = planned.step, planned.cohort
    _phase(on_phase, "noise")
    if test_only_disable_noise:
        log.warning("step %d: NOT PRIVATE: noise disabled (test-only mode)", step)
        release = Release(step, cohort, dict(cohort_sum.sums))
    elif strategy.needs_unit_updates:
        if cohort_sum.unit_updates is None:
            raise StrategyError(
                f"step {step}: {type(strategy).__name__} needs every unit's update; the gather "
                "returned only their sum"
            )
        release = strategy.privatize_units(step, cohort_sum.unit_updates, cohort_sum.stats, cohort)
    else:
        release = strategy.privatize(step, cohort_sum.sums, cohort_sum.stats, cohort)
    _phase(on_phase, "ledger")
    if charge and ledger is not None:  # fsync'd; refuses a step over the budget
        if isinstance(ledger, Ledger):  # which noise the step drew, and a commitment to it
            noise = (
                "none" if test_only_disable_noise else noise_mode(getattr(strategy, "noise", None))
            )
            commitment = release_sha256(release)
            ledger.append(step, planned.mechanism, noise=noise, release_sha256=commitment)
        else:  # any object with append(step, mechanism), e.g. a test's list
            ledger.append(step, planned.mechanism)
    if on_release is not None:
        on_release(release)
    _phase(on_phase, "update")
    strategy.server_update(params, release)
    return release


def run_step(
    strategy: Strategy,
    step: int,
    params: dict[str, Any],
    population: Any,
    gather: Callable[[PlannedStep], CohortSum],
    ledger: Any = None,
    *,
    options: ExecutionOptions | None = None,
    charge: bool = True,
    on_phase: Phase | None = None,
    on_release: Callable[[Release], None] | None = None,
    test_only_disable_noise: bool = False,
    unit_updates: bool = False,
) -> tuple[PlannedStep, CohortSum, Release]:
    """One whole step (the module docstring): :func:`begin_step`, ``gather(planned)``,
    :func:`finish_step`; ``params`` is updated in place. An exception from ``gather`` (an
    aborted step) leaves nothing drawn, charged or released. ``unit_updates``: see
    :func:`begin_step`."""
    planned = begin_step(
        strategy,
        step,
        population,
        ledger,
        options=options,
        charge=charge,
        on_phase=on_phase,
        unit_updates=unit_updates,
    )
    cohort_sum = gather(planned)
    release = finish_step(
        strategy,
        planned,
        cohort_sum,
        params,
        ledger,
        charge=charge,
        on_phase=on_phase,
        on_release=on_release,
        test_only_disable_noise=test_only_disable_noise,
    )
    return planned, cohort_sum, release
