"""The coordinator: the step of :mod:`userdp.strategies.step` over gRPC workers, then checkpoint
and broadcast, correct under worker and coordinator failure.

The step contract (sample → task → gather → noise → ledger → update) is
:func:`userdp.strategies.step.run_step`; the coordinator supplies its gather and keeps the
checkpoints, the release journal and resume around it. Its workers are a
:class:`~userdp.server.fleet.Fleet` (dispatch, events, retries, resyncs, broadcast). One step, as
:meth:`Coordinator.run_next_step` performs it:

0. ``sync``: the fleet handles joins/acks, resyncs workers that missed a model version, and gives
   workers a moment to acknowledge the current version so the work spreads over all of them.
1. ``sample``: the strategy samples the cohort (units) from the population (user ids only).
2. ``plan``: the cohort is split into shard groups (:mod:`~userdp.server.planning`).
3. ``gather``: the fleet batches the groups into one task per live, in-sync worker holding them;
   the workers' task sums are accepted exactly once per task (and so per unit) by
   :class:`~userdp.server.aggregation.StepGather` into the cohort's sum, and a failed task's
   groups are re-issued to other holders. When the step cannot complete by its deadline it is ABORTED
   (:class:`~userdp.server.fleet.StepAborted`): no noise is drawn, nothing is released or
   charged, and the same step index is retried (the strategy's sampler decides the cohort; the
   built-in samplers draw the same one for a seed and step).
4. ``noise``: the strategy adds its noise (generator seeded from ``os.urandom`` by the strategy).
5. ``ledger``: ``append`` (fsync'd; it refuses a step over the budget, which stops the run with
   nothing of that step released) — BEFORE anything leaves the process.
6. ``update``: the strategy's server optimizer steps on the noisy sum (÷ EXPECTED cohort size).
7. ``checkpoint`` (every ``checkpoint_every`` steps): model, strategy state (optimizer, sampler,
   correlated-noise buffers), step, model version, ledger offset.
8. ``broadcast``: the step is appended (fsync'd) to the release journal with the commitment to
   its release (a replay's own, never the discarded draw's), then the fleet sends the new
   trainable tensors to every connected worker (chunked).

Resume (:meth:`Coordinator.resume`): the ledger, not the checkpoint, says what was spent. It
starts from the newest checkpoint that verifies (:mod:`userdp.server.resume_point`: checksums,
ledger and release journal), and refuses when the journal shows a step released that the ledger
does not charge. A step the ledger holds beyond the checkpoint stays charged. If it is the one
step right after the checkpoint and the release journal shows it was never broadcast (the crash
came between the ledger append and the broadcast), it is replayed with FRESH noise and not
charged again. Otherwise it may have been released and is NOT replayed: the run continues after
the last charged step, and the model version jumps past every version that could have been
broadcast, so workers holding a lost update are resynced, never trusted. With correlated noise
(BLT) the lost steps' noise state cannot be rebuilt, so resume refuses (:class:`ResumeError`);
``checkpoint_every = 1`` (a checkpoint before every broadcast) rules that case out.

``fault_hook(phase, step)`` is called at the start of every phase; tests make it raise to simulate
a coordinator crash at that point. ``test_only_disable_noise`` exists for exactly-once tests that
compare with a noiseless reference; it is a constructor argument only (no config key or CLI flag
can reach it) and every step logs a NOT PRIVATE warning while it is on. One idea — the step and
resume contract around the fleet (:mod:`userdp.server.fleet`).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from userdp.accounting.ledger import BudgetExceededError
from userdp.proto.codec import task_proto as task_proto  # the simulator imports it from here
from userdp.server.aggregation import StepGather, template_of
from userdp.server.checkpoint import save_checkpoint
from userdp.server.fleet import Fleet, StepAborted
from userdp.server.planning import plan_groups
from userdp.server.population import Population
from userdp.server.publisher import ModelPublisher
from userdp.server.registry import Event, WorkerRegistry, WorkerSession
from userdp.server.release_journal import append_release_journal, read_release_records
from userdp.server.resume_point import ResumeError as ResumeError  # tests import it from here
from userdp.server.resume_point import continue_after_lost_steps, restore_resume_point
from userdp.server.startup import WorkerProgress
from userdp.server.sum_plane import StreamedPlane, SumPlane
from userdp.strategies.release_commitment import release_sha256
from userdp.strategies.step import CohortSum, ExecutionOptions, PlannedStep, run_step
from userdp.strategies.unit_stats import UnitStats

log = logging.getLogger(__name__)

PHASES: tuple[str, ...] = (
    "sync",
    "sample",
    "plan",
    "gather",
    "noise",
    "ledger",
    "update",
    "checkpoint",
    "broadcast",
)


@dataclass(frozen=True)
class CoordinatorSettings:
    step_deadline_s: float = 300.0
    task_deadline_s: float = 120.0
    max_attempts: int = 4
    """Attempts per task before the step aborts."""
    max_step_retries: int = 3
    """Aborted attempts of one step index before :meth:`Coordinator.run` gives up."""
    checkpoint_every: int = 1
    worker_startup_s: float = 1800.0
    """The longest wait for every shard to have a ready worker (see :mod:`userdp.server.startup`)."""
    worker_stall_s: float = 300.0
    """While waiting, the longest silence of every worker still starting before the wait fails
    (a dead process; a hung one keeps reporting and is ended by ``worker_startup_s``)."""
    ack_wait_s: float = 5.0
    """At a step's start, how long to wait for workers to acknowledge the current model."""
    heartbeat_timeout_s: float = 30.0
    """A worker silent this long (workers heartbeat every 5 s) is treated as lost."""


@dataclass
class StepReport:
    """What one released step did: its units and their statistics, tasks and phase times."""

    step: int
    model_version: int
    units: int
    expected_cohort_size: float
    stats: UnitStats
    attempts: int
    failed_tasks: int
    shard_groups: int
    seconds: dict[str, float] = field(default_factory=dict)


class Coordinator:
    """Runs steps against connected workers (see the module docstring)."""

    def __init__(
        self,
        *,
        strategy: Any,
        ledger: Any,
        params: dict[str, torch.Tensor],
        population: Population,
        registry: WorkerRegistry,
        publisher: ModelPublisher,
        checkpoint_dir: str | Path,
        settings: CoordinatorSettings = CoordinatorSettings(),
        frozen: Mapping[str, torch.Tensor] | None = None,
        options: ExecutionOptions | None = None,
        fault_hook: Callable[[str, int], None] | None = None,
        test_only_disable_noise: bool = False,
        plane: SumPlane | None = None,
        data_check: Callable[[], None] | None = None,
    ) -> None:
        """``plane``: how sums and versions travel (:mod:`userdp.server.sum_plane`): a
        :class:`~userdp.server.group_plane.GroupPlane` for the collective data plane; None = the
        gRPC plane (every worker streams its sums to this process and receives each version
        from it).
        ``data_check``: raises when the run's data is gone, which ends :meth:`run` before the
        step under way releases anything (:class:`~userdp.server.fleet.Fleet`)."""
        self.strategy = strategy
        self.options = options
        self.ledger = ledger
        self.params = params
        self.frozen = dict(frozen or {})
        self.population = population
        self.registry = registry
        self.publisher = publisher
        self.checkpoint_dir = Path(checkpoint_dir)
        self.settings = settings
        self.fault_hook = fault_hook
        self._no_noise = bool(test_only_disable_noise)
        shards = frozenset(population.shard_sha256)
        self.fleet = Fleet(
            registry, publisher, shards, settings, plane or StreamedPlane(), data_check
        )
        self.template = template_of(params)
        self.step = 0
        self.reports: list[StepReport] = []
        self._charged_unreleased: int | None = None
        self._retries = 0
        """Aborted gathers of the current step (its task ids say which gather they are of)."""
        self.budget_exhausted = False

    @property
    def model_version(self) -> int:
        """The current model version: the one workers must hold to be given tasks."""
        return self.fleet.model_version

    @model_version.setter
    def model_version(self, version: int) -> None:
        self.fleet.model_version = version

    # ---- lifecycle ------------------------------------------------------------------------------

    def resume(self) -> None:
        """Load the newest checkpoint that verifies (if any), reconcile it with the ledger and
        the release journal (see the module docstring), and publish the model."""
        charged = [int(step) for step in self._ledger_steps()]
        checkpoint = restore_resume_point(self.checkpoint_dir, self.params, self.strategy, charged)
        journal = read_release_records(self.checkpoint_dir)
        if checkpoint is not None:
            self.step = checkpoint.step
            self.model_version = checkpoint.model_version
        last = max(charged, default=-1)
        released = {r["step"] for r in journal if r["step"] >= self.step}
        if last == self.step and not released:
            # Charged after the checkpoint but never broadcast (broadcast follows the checkpoint
            # and the journal): redo it with FRESH noise, without charging it twice.
            log.warning(
                "step %d is charged in the ledger but was never released; replaying it with "
                "fresh noise (not charged again)",
                self.step,
            )
            self._charged_unreleased = self.step
        elif last >= self.step:  # released, or more than one step after the checkpoint
            resumed = continue_after_lost_steps(self.strategy, self.step, last)
            broadcast = max((r.get("model_version", 0) for r in journal), default=0)
            self.model_version = max(self.model_version + resumed - self.step, broadcast) + 1
            self.step = resumed
        self.publisher.publish(self.model_version, self.params, self.frozen)

    def _ledger_steps(self) -> list[int]:
        return [int(record["step"]) for record in self.ledger.records]

    def run(
        self, steps: int, on_step: Callable[[StepReport], None] | None = None
    ) -> list[StepReport]:
        """Run until ``steps`` steps are done (counting from step 0, so a resumed run continues),
        or until the ledger's budget would be exceeded: then it stops BEFORE that step (nothing of
        it is released or charged) and sets :attr:`budget_exhausted`. ``on_step(report)`` runs
        after every released step (metrics, progress)."""
        retries = 0
        while self.step < steps:
            try:
                self._retries = retries
                report = self.run_next_step()
                self.reports.append(report)
                retries = 0
                if on_step is not None:
                    on_step(report)
            except BudgetExceededError as exc:
                log.warning("stopping before step %d: %s", self.step, exc)
                self.budget_exhausted = True
                return self.reports
            except StepAborted as exc:
                retries += 1
                log.warning("step %d aborted (%s); retry %d", self.step, exc, retries)
                if retries > self.settings.max_step_retries:
                    raise
        return self.reports

    def _phase(self, phase: str, step: int, times: dict[str, float], started: list[float]) -> None:
        now = time.perf_counter()
        if times:
            times[next(reversed(times))] = now - started[0]
        times[phase] = 0.0
        started[0] = now
        if self.fault_hook is not None:
            self.fault_hook(phase, step)

    # ---- one step -------------------------------------------------------------------------------

    def run_next_step(self) -> StepReport:
        """Step :attr:`step` of the contract over the workers, then checkpoint and broadcast (the
        module docstring); returns its report."""
        step = self.step
        times: dict[str, float] = {}
        started = [time.perf_counter()]

        def phase(name: str) -> None:
            self._phase(name, step, times, started)

        phase("sync")
        self.fleet.sync()
        state: dict[str, Any] = {}

        def gather(planned: PlannedStep) -> CohortSum:
            return self._gather(step, planned, phase, state)

        replay = self._charged_unreleased == step  # charged before a crash, never released
        planned, _, release = run_step(
            self.strategy,
            step,
            self.params,
            self.population,
            gather,
            self.ledger,
            options=self.options,
            charge=not replay,
            on_phase=phase,
            test_only_disable_noise=self._no_noise,
        )
        if replay:
            self._charged_unreleased = None
        self.model_version += 1
        self.step = step + 1

        phase("checkpoint")
        if self.step % self.settings.checkpoint_every == 0:
            self.save()

        phase("broadcast")
        append_release_journal(
            self.checkpoint_dir,
            step,
            self.model_version,
            release_sha256=self._commitment(step, release, replay),
            replayed=replay,
        )
        self.fleet.broadcast(self.params)
        phase("done")
        times.pop("done")
        report = _report(
            step, self.model_version, state["gather"], state["groups"], planned.cohort, times
        )
        log.info(
            "step %d: %d units, loss %.4f, %d attempts, %.3fs",
            step,
            report.units,
            report.stats.loss_mean,
            report.attempts,
            sum(times.values()),
        )
        return report

    def _gather(
        self, step: int, planned: PlannedStep, phase: Callable[[str], None], state: dict
    ) -> CohortSum:
        """The step's cohort sum from the fleet's workers (:class:`StepGather` checks every
        contribution); ``state`` keeps the gather and its group count for the step's report."""
        phase("plan")
        groups = plan_groups(step, list(planned.cohort.unit_ids), self.population.shard_of_unit)
        spec = planned.task
        collect = StepGather(
            step,
            self.model_version,
            groups,
            self.template,
            spec.clip_norm,
            estimate_probes=spec.probes if spec.engine == "randomized" else 0,
            arrival=self.fleet.plane.arrival,
            retry=self._retries,
        )
        phase("gather")
        self.fleet.gather(collect, spec)
        cohort_sum = collect.result()
        state.update(gather=collect, groups=len(groups))
        summed = {  # noise is added in at least fp32, even for bf16/fp16 parameters
            name: t.to(torch.promote_types(self.params[name].dtype, torch.float32))
            for name, t in cohort_sum.sums.items()
        }
        return CohortSum(summed, cohort_sum.stats)

    def _commitment(self, step: int, release: Any, replay: bool) -> str:
        """The release's commitment: the one the ledger recorded with this step's charge (not
        hashed twice), or, for a replay (charged by an earlier process for the draw its crash
        discarded), the release's own."""
        last = self.ledger.records[-1] if self.ledger.records else {}
        if not replay and last.get("step") == step and "release_sha256" in last:
            return last["release_sha256"]
        return release_sha256(release)

    def save(self) -> Path:
        return save_checkpoint(
            self.checkpoint_dir,
            step=self.step,
            model_version=self.model_version,
            ledger_entries=len(self._ledger_steps()),
            state={"params": self.params, "strategy": self.strategy.state_dict()},
        )

    # ---- the workers ----------------------------------------------------------------------------

    def pump_events(self, timeout: float = 0.0) -> None:
        """Handle queued worker events outside a step (joins, acks, resyncs)."""
        self.fleet.pump_events(timeout)

    def wait_for_workers(
        self,
        timeout_s: float | None = None,
        *,
        on_progress: Callable[[list[WorkerProgress]], None] | None = None,
        check: Callable[[], None] | None = None,
    ) -> None:
        """Wait until every shard has an in-sync holder: :meth:`Fleet.wait_for_workers
        <userdp.server.fleet.Fleet.wait_for_workers>`."""
        self.fleet.wait_for_workers(timeout_s, on_progress=on_progress, check=check)

    def _eligible(self) -> dict[str, WorkerSession]:
        return self.fleet.eligible()

    def _handle(self, event: Event, gather: StepGather | None) -> None:
        self.fleet.handle(event, gather)


def _report(
    step: int,
    version: int,
    gather: StepGather,
    shard_groups: int,
    cohort: Any,
    times: dict[str, float],
) -> StepReport:
    return StepReport(
        step=step,
        model_version=version,
        units=gather.units_counted,
        expected_cohort_size=float(getattr(cohort, "expected_size", math.nan)),
        stats=gather.stats,
        attempts=gather.attempts,
        failed_tasks=gather.failed_tasks,
        shard_groups=shard_groups,
        seconds=dict(times),
    )
