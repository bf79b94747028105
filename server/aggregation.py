"""Gathering one step's task sums EXACTLY ONCE per (step, unit) into the cohort's sum.

The cohort is partitioned into shard groups (:mod:`userdp.server.planning`); groups are batched
into tasks, one per worker. A task is identified by (step, task id, attempt). :class:`StepGather`
accepts AT MOST ONE result (:class:`~userdp.proto.results.TaskResult`) per task, and only from a
*live* task: issued to that worker, for this step and model version, covering exactly the task's
units. A failed task (worker lost, timeout,
TaskFailed, bad result) is closed for good and its groups return to the pending pool, to be
re-batched under a new task id with a higher attempt number, never to the worker that failed them.
Results of closed tasks (late duplicates), of other steps or attempts are discarded; a bad result
(wrong units, counts, tensor names, shapes, dtypes, non-finite values, or a norm above what
``count`` clipped units can sum to — a worker that did not clip; :func:`contribution_bound`)
is rejected and its groups re-issued. So is a result for a live task of this step, from its
worker and attempt, that is labelled with another step: waiting would only end at the task's
deadline, since that worker answered the task and will send nothing else. Each
unit belongs to exactly one group and a group is marked done exactly once, so every unit
contributes exactly once; :meth:`StepGather.result` re-checks that before anything is released.

The running sum is kept in float64 so the released sum does not depend on arrival order beyond
float64 rounding. Memory is one model-sized buffer, whatever the number of tasks.

Under the collective data plane (``arrival`` :attr:`SumArrival.REDUCED
<userdp.server.sum_plane.SumArrival.REDUCED>`, as the fleet's plane says) a task's sum stays on its
worker: the result carries the units and statistics only (``held``) and is judged as above,
except its tensors. Once every group is done, :meth:`StepGather.held_by` names each worker's accepted sums,
the workers reduce exactly those, and :meth:`StepGather.offer_reduced` checks the one reduced sum
(names, shapes, finite values, and ‖sum‖ ≤ the bound of all the step's counted units) and each
member's share (the norm it reports of the sum it reduced ≤ the bound of the units accepted from
it) before :meth:`StepGather.result` returns it. A result of the other plane (a streamed sum when the task
said hold, or a held one when it did not) is rejected.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from scipy import stats
from userdp.proto.results import TaskResult
from userdp.proto.tensors import FLOAT_DTYPES, WireTensor, wire_dtype
from userdp.server.planning import ShardGroup
from userdp.server.sum_plane import SumArrival
from userdp.strategies.step import CohortSum
from userdp.strategies.unit_stats import UnitStats

NORM_TOLERANCE = 1e-3
"""Relative slack on the ‖task sum‖ ≤ count · C check (float32 sums of clipped vectors)."""
ESTIMATE_ALPHA = 1e-9
"""Randomized clipping: the probability that an honest task sum exceeds its bound (then it is
only re-issued, which costs time, not privacy)."""


def contribution_bound(count: int, clip_norm: float, probes: int = 0) -> float:
    """The largest norm a sum of ``count`` clipped units can have.

    Exact norms: count·C. Norms estimated with k Gaussian probes (randomized clipping) clip a
    unit by its estimate, so it contributes C·Z with Z = ‖g‖/√n̂ unbounded; its law is dominated
    by the randomized-clipping accountant's envelope Z_cons = max(1, √(k/χ²_k)) ("Efficient
    DP-SGD for LLMs with Randomized Clipping", the rank-1 spectrum; see
    userdp.accounting.randomized_clipping). By a union bound over the units, count·C·z* with
    z* = √(k / χ²_k⁻¹(α/count)) holds for an honest worker except with probability α =
    :data:`ESTIMATE_ALPHA` (z* ≈ 3.24 for k = 32, count = 100), while a worker that does not clip
    at all sends ‖Σ g_u‖, typically far above it."""
    bound = count * clip_norm
    if probes > 0 and count > 0:
        quantile = float(stats.chi2.ppf(ESTIMATE_ALPHA / count, probes))
        bound *= max(1.0, math.sqrt(probes / quantile))
    return bound * (1 + NORM_TOLERANCE) + 1e-6


@dataclass(frozen=True)
class TensorSpec:
    """What a task sum's tensor must look like: the trainable parameter's shape and dtype."""

    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Verdict:
    """What :meth:`StepGather.offer` did: ``accepted``; else ``reissue`` says whether the task went
    back to pending (a bad result of the current attempt) or the message was just discarded."""

    accepted: bool
    reissue: bool
    reason: str


class ExactlyOnceViolation(AssertionError):
    """A unit would be counted twice; raised instead of releasing (a bug, never expected)."""


@dataclass
class _GroupState:
    group: ShardGroup
    tries: int = 0
    task_id: str | None = None
    done: bool = False
    failed_workers: set[str] = field(default_factory=set)


@dataclass
class _TaskState:
    task_id: str
    attempt: int
    worker: str
    groups: tuple[str, ...]
    unit_ids: tuple[str, ...]
    issued_at: float
    live: bool = True


class StepGather:
    """Exactly-once bookkeeping and running sum for one step (see the module docstring).

    Besides the sum (:meth:`result`) it counts how the gather went: ``units_counted`` (units of
    the accepted tasks, checked against ``stats.count + stats.nonfinite``), ``attempts`` (tasks
    issued: first tries and re-issues), ``failed_tasks`` (tasks closed without being counted:
    worker lost, timeout, refused, rejected) and ``compute_seconds`` (the workers' own)."""

    def __init__(
        self,
        step: int,
        model_version: int,
        groups: Sequence[ShardGroup],
        template: Mapping[str, TensorSpec],
        clip_norm: float,
        *,
        estimate_probes: int = 0,
        arrival: SumArrival = SumArrival.IN_RESULTS,
        retry: int = 0,
    ) -> None:
        """``arrival``: how the sums arrive, as the data plane says (the module docstring).
        ``retry``: how many gathers of this step were aborted before (task ids of a retry differ
        from the aborted gathers', so a worker never mistakes one for a task it was told to
        cancel or a sum it holds).
        ``estimate_probes`` > 0: units were clipped by norms ESTIMATED with that many Gaussian
        probes (randomized clipping), so a unit may legitimately contribute C·Z with Z > 1
        (covered by its accountant): the norm bound is :func:`contribution_bound`'s for k
        probes instead of count·C."""
        self.step = step
        self.model_version = model_version
        self.clip_norm = float(clip_norm)
        self.estimate_probes = int(estimate_probes)
        self.arrival = arrival
        self.retry = retry
        self._task_prefix = f"{step}." if retry == 0 else f"{step}r{retry}."
        self._held: dict[str, list[str]] = {}
        self._held_counts: dict[str, int] = {}
        """Worker → the counted units of its accepted held sums (its share's bound)."""
        self._reduced = False
        self.template = dict(template)
        self._groups = {g.group_id: _GroupState(g) for g in groups}
        self._tasks: dict[str, _TaskState] = {}
        self._unit_owner: dict[str, str] = {}
        for g in groups:
            for unit in g.unit_ids:
                if unit in self._unit_owner:
                    raise ExactlyOnceViolation(f"unit {unit!r} planned in two shard groups")
                self._unit_owner[unit] = g.group_id
        self._contributed: set[str] = set()
        self._sums = {
            name: torch.zeros(spec.shape, dtype=torch.float64) for name, spec in template.items()
        }
        self.stats = UnitStats()
        self.units_counted = 0
        self.attempts = 0
        self.failed_tasks = 0
        self.compute_seconds = 0.0

    # ---- issuing --------------------------------------------------------------------------------

    def pending(self) -> list[ShardGroup]:
        """Shard groups that are neither done nor part of a live task."""
        return [s.group for s in self._groups.values() if not s.done and s.task_id is None]

    def outstanding(self) -> list[tuple[str, int, str, float]]:
        """(task id, attempt, worker, issued_at) of every live task."""
        return [
            (t.task_id, t.attempt, t.worker, t.issued_at) for t in self._tasks.values() if t.live
        ]

    def task_units(self, task_id: str) -> tuple[str, ...]:
        return self._tasks[task_id].unit_ids

    def failed_workers(self, group_id: str) -> set[str]:
        return set(self._groups[group_id].failed_workers)

    def issue(self, worker_id: str, group_ids: Sequence[str], now: float) -> tuple[str, int]:
        """Batch pending groups into a new task for ``worker_id``; returns (task id, attempt),
        where attempt = the most any of its groups was tried before."""
        states = [self._groups[g] for g in group_ids]
        for state in states:
            if state.done or state.task_id is not None:
                raise ValueError(f"group {state.group.group_id} is not pending")
        attempt = max(s.tries for s in states)
        task_id = f"{self._task_prefix}{len(self._tasks)}"
        for state in states:
            state.tries += 1
            state.task_id = task_id
        units = tuple(u for s in states for u in s.group.unit_ids)
        self._tasks[task_id] = _TaskState(task_id, attempt, worker_id, tuple(group_ids), units, now)
        self.attempts += 1
        return task_id, attempt

    def fail(self, task_id: str, attempt: int, reason: str) -> bool:
        """A live task failed (timeout, TaskFailed, bad result): its groups go back to pending and
        its worker is not tried again for them. False when the task is not live (no change)."""
        task = self._tasks.get(task_id)
        if task is None or not task.live or task.attempt != attempt:
            return False
        task.live = False
        self.failed_tasks += 1
        for group_id in task.groups:
            state = self._groups[group_id]
            state.task_id = None
            state.failed_workers.add(task.worker)
        return True

    def fail_worker(self, worker_id: str) -> list[str]:
        """Fail every live task of ``worker_id`` (it disconnected); returns their task ids."""
        failed = [t.task_id for t in self._tasks.values() if t.live and t.worker == worker_id]
        for task_id in failed:
            self.fail(task_id, self._tasks[task_id].attempt, "worker lost")
        return failed

    # ---- results --------------------------------------------------------------------------------

    def offer(self, result: TaskResult) -> Verdict:
        """Accept the task result into the sum, discard it, or reject it (see the module
        docstring)."""
        task = self._tasks.get(result.task_id)
        if result.step != self.step:
            if (
                task is not None
                and task.live
                and result.attempt == task.attempt
                and result.worker_id == task.worker
            ):
                problem = (
                    f"result labelled step {result.step} for task {task.task_id} of step "
                    f"{self.step}"
                )
                self.fail(task.task_id, task.attempt, problem)
                return Verdict(False, True, problem)
            return Verdict(False, False, f"late result for step {result.step}")
        if task is None:
            return Verdict(False, False, f"unknown task {result.task_id!r}")
        if result.attempt != task.attempt:
            return Verdict(False, False, f"attempt {result.attempt} != issued {task.attempt}")
        if result.worker_id != task.worker:
            return Verdict(False, False, f"task was issued to {task.worker}")
        if not task.live:
            return Verdict(False, False, f"duplicate or late: task {task.task_id} is closed")
        problem = self._check(result, task.unit_ids)
        if problem is None and result.held != (self.arrival is SumArrival.REDUCED):
            problem = (
                "the sum was held on the worker, but this step streams sums"
                if result.held
                else "the sum was streamed, but this step reduces held sums in the group"
            )
        if problem is not None:
            self.fail(task.task_id, task.attempt, problem)
            return Verdict(False, True, problem)
        tensors = {name: _as_torch(value) for name, value in result.task_sum.sums.items()}
        for unit in task.unit_ids:
            if unit in self._contributed:
                raise ExactlyOnceViolation(f"step {self.step}: unit {unit!r} counted twice")
        self._contributed.update(task.unit_ids)
        if result.held:
            self._held.setdefault(task.worker, []).append(f"{task.task_id}/{task.attempt}")
            count = self._held_counts.get(task.worker, 0)
            self._held_counts[task.worker] = count + result.task_sum.stats.count
        for name, value in tensors.items():
            self._sums[name].add_(value.to(torch.float64))
        task.live = False
        for group_id in task.groups:
            self._groups[group_id].done = True
        self.units_counted += len(task.unit_ids)
        self.stats += result.task_sum.stats
        self.compute_seconds += result.compute_seconds
        return Verdict(True, False, "accepted")

    def _check(self, result: TaskResult, unit_ids: tuple[str, ...]) -> str | None:
        if result.model_version != self.model_version:
            return f"model version {result.model_version}, expected {self.model_version}"
        if tuple(result.unit_ids) != unit_ids:
            return "unit ids differ from the task's"
        stats, tensors = result.task_sum.stats, result.task_sum.sums
        n, count, nonfinite = len(unit_ids), stats.count, stats.nonfinite
        if count < 0 or nonfinite < 0 or count + nonfinite != n:
            return f"count {count} + nonfinite {nonfinite} != {n} units"
        if result.held:
            return "a held result carries tensors" if tensors else None
        return self._check_sum(tensors, count, allow_float32=False)

    def _check_sum(
        self, tensors: Mapping[str, WireTensor | torch.Tensor], count: int, allow_float32: bool
    ) -> str | None:
        """Names, dtypes, shapes, finite values and the norm bound of ``count`` clipped units
        (``allow_float32``: a reduced sum may be float32 whatever the parameter's dtype)."""
        if set(tensors) != set(self.template):
            missing = sorted(set(self.template) - set(tensors))[:3]
            extra = sorted(set(tensors) - set(self.template))[:3]
            return f"tensor names differ (missing {missing}, unexpected {extra})"
        squared = 0.0
        for name, spec in self.template.items():
            value = tensors[name]
            dtype = value.dtype if isinstance(value, WireTensor) else wire_dtype(value)
            shape = tuple(value.shape)
            expected = {spec.dtype, "float32"} if allow_float32 else {spec.dtype}
            if dtype not in expected or dtype not in FLOAT_DTYPES:
                return f"tensor {name!r} has dtype {dtype}, expected {spec.dtype}"
            if shape != spec.shape:
                return f"tensor {name!r} has shape {list(shape)}, expected {list(spec.shape)}"
            t = _as_torch(value)
            if t.dtype not in (torch.float32, torch.float64):
                t = t.to(torch.float32)  # exact for bf16/fp16, whose squares would round
            # Σ t² accumulated in float64 (the squares rounded to float32 at most: relative
            # 2^-24, far inside NORM_TOLERANCE); it is finite exactly when every value is,
            # unless a square overflows float32, which the bound refuses anyway
            tensor_squared = float(t.square().sum(dtype=torch.float64))
            if not math.isfinite(tensor_squared) and not bool(torch.isfinite(t).all()):
                return f"tensor {name!r} has non-finite values"
            squared += tensor_squared
        bound = contribution_bound(count, self.clip_norm, self.estimate_probes)
        if math.sqrt(squared) > bound:
            what = (
                f"the bound of {count} units clipped by {self.estimate_probes}-probe norm estimates"
                if self.estimate_probes
                else "count*clip_norm"
            )
            return (
                f"sum norm {math.sqrt(squared):.6g} exceeds {what} = {bound:.6g} "
                "(units not clipped)"
            )
        return None

    # ---- the collective data plane ---------------------------------------------------------------

    def template_tensors(self) -> dict[str, torch.Tensor]:
        """The step's sum tensors (their names, order and shapes are the template's)."""
        return dict(self._sums)

    def held_by(self) -> dict[str, list[str]]:
        """Worker id → its accepted held sums ("task_id/attempt"), once every group is done."""
        if not self.complete():
            raise RuntimeError(f"step {self.step}: shard groups not done")
        return {worker: list(keys) for worker, keys in self._held.items()}

    def offer_reduced(
        self,
        tensors: Mapping[str, WireTensor | torch.Tensor],
        member_norms: Mapping[str, float],
    ) -> str | None:
        """Check the group's reduced sum of every accepted held sum, and each member's share of
        it (``member_norms``: worker → ‖the sum it reduced‖), and take it as the step's sum;
        returns the problem (nothing taken) or None."""
        if self.arrival is not SumArrival.REDUCED or not self.complete() or self._reduced:
            return "no reduced sum is expected for this step now"
        problem = self._check_sum(tensors, self.stats.count, allow_float32=True)
        if problem is not None:
            return f"reduced sum: {problem}"
        problem = self._check_members(member_norms)
        if problem is not None:
            return problem
        # kept as reduced (float32, already summed): the noise is added in at least float32
        self._sums = {name: _as_torch(tensors[name]) for name in self.template}
        self._reduced = True
        return None

    def _check_members(self, member_norms: Mapping[str, float]) -> str | None:
        """Every member's share within the bound of the units accepted from it, as the gRPC
        plane checks every task's sum: one worker that does not clip cannot hide in the others'
        slack under the total's bound. A worker that holds accepted sums but reported no norm
        (it was no member of the reduce) fails too."""
        for worker in sorted(set(member_norms) | set(self._held)):
            norm = member_norms.get(worker)
            if norm is None:
                return f"member {worker}: no norm reported for its held sums"
            count = self._held_counts.get(worker, 0)
            bound = contribution_bound(count, self.clip_norm, self.estimate_probes)
            if not norm <= bound:  # a NaN norm fails too
                return (
                    f"member {worker}: sum norm {norm:.6g} exceeds the bound of its {count} "
                    f"units = {bound:.6g} (units not clipped)"
                )
        return None

    # ---- completion -----------------------------------------------------------------------------

    def complete(self) -> bool:
        return all(s.done for s in self._groups.values())

    def result(self) -> CohortSum:
        """The cohort's sum (float64); only when every group is done and every unit counted
        exactly once."""
        if not self.complete():
            raise RuntimeError(f"step {self.step}: shard groups not done")
        if self._contributed != set(self._unit_owner):
            raise ExactlyOnceViolation(f"step {self.step}: contributed units != cohort units")
        if self.arrival is SumArrival.REDUCED and not self._reduced:
            raise RuntimeError(f"step {self.step}: the group's reduced sum has not arrived")
        return CohortSum(self._sums, self.stats)


def _as_torch(value: WireTensor | torch.Tensor) -> torch.Tensor:
    return value.torch() if isinstance(value, WireTensor) else value


def template_of(tensors: Mapping[str, torch.Tensor]) -> dict[str, TensorSpec]:
    """The task-sum template of a set of trainable parameters."""
    return {name: TensorSpec(tuple(t.shape), wire_dtype(t)) for name, t in tensors.items()}
