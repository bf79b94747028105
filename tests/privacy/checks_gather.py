"""The coordinator's exactly-once gathering (``server.aggregation.StepGather``), driven directly.

A unit counted twice doubles its sensitivity for that step; an unclipped partial makes it
unbounded. These checks replay the failure orders that cause both — a task re-issued after a
timeout whose late result still arrives (before or after the re-issued one), a duplicated
delivery, a result from the wrong worker or attempt, a worker that did not clip — and assert the
released sum is exactly Σ clip(unit) over the cohort, each unit once. They use the real
``plan_groups`` and ``StepGather``; the loopback version over gRPC is in ``checks_coordinator``.
"""

from __future__ import annotations

import torch
from userdp.proto.results import TaskResult, TaskSum
from userdp.server.aggregation import ExactlyOnceViolation, StepGather, TensorSpec
from userdp.server.planning import plan_groups
from userdp.server.population import Population
from userdp.strategies.unit_stats import UnitStats

CLIP = 1.0
DIM = 16
STEP = 3


def _population() -> Population:
    shards = [f"shard-{i}" for i in range(4)]
    return Population(
        shard_of_user={f"user-{i}": shards[i % 4] for i in range(24)},
        shard_sha256={s: "0" * 64 for s in shards},
    )


def _contribution(unit: str) -> torch.Tensor:
    """A distinct clipped update per unit (norm ≤ C/2), so any double count is visible."""
    index = int(unit.rsplit("-", 1)[1])
    vector = torch.zeros(DIM, dtype=torch.float32)
    vector[index % DIM] = 0.02 * (index + 1)
    vector[(3 * index + 1) % DIM] -= 0.01 * (index + 1)
    return vector


def _partial(gather: StepGather, task_id: str, attempt: int, worker: str, scale: float = 1.0):
    units = gather.task_units(task_id)
    total = torch.zeros(DIM, dtype=torch.float32)
    for unit in units:
        total += _contribution(unit)
    return TaskResult(
        task_id=task_id,
        attempt=attempt,
        step=STEP,
        model_version=7,
        worker_id=worker,
        unit_ids=units,
        task_sum=TaskSum({"w": total * scale}, UnitStats(count=len(units))),
    )


def _new_gather(cohort: list[str], estimate_probes: int = 0) -> StepGather:
    groups = plan_groups(STEP, cohort, _population().shard_of_unit)
    assert len(groups) == 4, "the scenario needs four shard groups"
    template = {"w": TensorSpec((DIM,), "float32")}
    return StepGather(STEP, 7, groups, template, CLIP, estimate_probes=estimate_probes)


def _offer(gather: StepGather, partial: TaskResult, what: str):
    try:
        return gather.offer(partial)
    except ExactlyOnceViolation as exc:
        raise AssertionError(
            f"{what}: a unit would be counted twice — the result was not discarded as a "
            f"duplicate and only the last-resort per-unit guard stopped it ({exc})"
        ) from None


def _assert_sum_is_each_unit_once(gather: StepGather, cohort: list[str], scenario: str) -> None:
    result = gather.result()
    expected = torch.zeros(DIM, dtype=torch.float64)
    for unit in cohort:
        expected += _contribution(unit).double()
    released = result.sums["w"]
    error = float(torch.linalg.vector_norm(released - expected))
    assert gather.units_counted == len(cohort) and result.stats.count == len(cohort), (
        f"{scenario}: {gather.units_counted} units counted for a cohort of {len(cohort)}: a unit "
        "was counted twice (or dropped)"
    )
    assert error <= 1e-6, (
        f"{scenario}: released sum differs from Σ over the cohort of each unit once by "
        f"{error:.3g} (a unit was counted twice, or a partial was dropped)"
    )


def check_exactly_once_under_retries() -> None:
    """Late results of timed-out tasks (arriving after or before their re-issue), duplicated
    deliveries and results from the wrong worker/attempt are discarded; the sum counts each unit
    of the cohort exactly once."""
    cohort = [f"user-{i}" for i in range(0, 24, 2)] + ["user-1", "user-7"]

    # 1. one task for everything times out; its re-issue answers first, then the late original
    gather = _new_gather(cohort)
    groups = [g.group_id for g in gather.pending()]
    first, attempt = gather.issue("worker-a", groups, now=0.0)
    assert gather.fail(first, attempt, "timeout")
    second, attempt2 = gather.issue("worker-b", groups, now=1.0)
    assert attempt2 == attempt + 1, "a re-issued task must carry a higher attempt number"
    assert _offer(gather, _partial(gather, second, attempt2, "worker-b"), "re-issue").accepted
    for name, partial in (
        ("late result of the timed-out task", _partial(gather, first, attempt, "worker-a")),
        ("duplicated delivery", _partial(gather, second, attempt2, "worker-b")),
    ):
        verdict = _offer(gather, partial, name)
        assert not verdict.accepted, (
            f"scenario 1: {name} was accepted ({verdict.reason}): its units are counted twice"
        )
    _assert_sum_is_each_unit_once(gather, cohort, "late result after its re-issue")

    # 2. the late original arrives BEFORE the re-issued result, while other groups are pending
    gather = _new_gather(cohort)
    groups = [g.group_id for g in gather.pending()]
    slow, slow_attempt = gather.issue("worker-a", groups[:2], now=0.0)
    other, other_attempt = gather.issue("worker-c", groups[2:], now=0.0)
    assert gather.fail(slow, slow_attempt, "timeout")
    retry, retry_attempt = gather.issue("worker-b", groups[:2], now=1.0)
    offers = (
        ("late result before its re-issue", _partial(gather, slow, slow_attempt, "worker-a")),
        ("result from the wrong worker", _partial(gather, retry, retry_attempt, "worker-c")),
        ("result of a stale attempt", _partial(gather, retry, slow_attempt, "worker-b")),
    )
    for name, partial in offers:
        verdict = _offer(gather, partial, name)
        assert not verdict.accepted, (
            f"scenario 2: {name} was accepted ({verdict.reason}): its units are counted twice"
        )
    for task, attempt_no, worker in ((retry, retry_attempt, "worker-b"), (other, 0, "worker-c")):
        partial = _partial(gather, task, attempt_no, worker)
        assert _offer(gather, partial, "valid result").accepted, f"valid {task} was refused"
    # and once more after the step is complete: nothing more may enter
    again = _partial(gather, retry, retry_attempt, "worker-b")
    assert not _offer(gather, again, "duplicate after completion").accepted, (
        "a duplicate delivered after the step completed was accepted: counted twice"
    )
    _assert_sum_is_each_unit_once(gather, cohort, "late result before its re-issue")


def _partial_of_norm(gather, task, attempt, worker, norm: float) -> TaskResult:
    """The task's honest partial, rescaled to total norm ``norm``."""
    partial = _partial(gather, task, attempt, worker)
    scale = norm / float(torch.linalg.vector_norm(partial.task_sum.sums["w"]))
    partial.task_sum.sums = {"w": partial.task_sum.sums["w"] * scale}
    return partial


def check_unclipped_partial_is_rejected() -> None:
    """A worker that did not clip (‖partial‖ > count·C) is rejected and its groups re-issued;
    the released sum is the clipped one (the coordinator's defense against missing clipping)."""
    cohort = [f"user-{i}" for i in range(12)]
    gather = _new_gather(cohort)
    groups = [g.group_id for g in gather.pending()]
    task, attempt = gather.issue("worker-a", groups, now=0.0)
    count = len(gather.task_units(task))
    # an "unclipped" partial: norm 1.5·count·C (e.g. raw gradients summed)
    bad = _partial_of_norm(gather, task, attempt, "worker-a", 1.5 * count * CLIP)
    verdict = _offer(gather, bad, "unclipped partial")
    assert not verdict.accepted and verdict.reissue, (
        f"a partial of norm {1.5 * count * CLIP:.3g} > count·C = {count * CLIP:.3g} from "
        f"{count} units was accepted ({verdict.reason}): a worker that does not clip breaks the "
        "per-unit sensitivity C"
    )
    retry, retry_attempt = gather.issue("worker-b", groups, now=1.0)
    assert _offer(gather, _partial(gather, retry, retry_attempt, "worker-b"), "retry").accepted
    _assert_sum_is_each_unit_once(gather, cohort, "after rejecting an unclipped partial")


RC_PROBES = 32


def check_unclipped_partial_is_rejected_under_randomized_clipping() -> None:
    """Randomized clipping (units clipped by k-probe norm estimates): an honest worker's partial
    may exceed count·C (each unit contributes C·Z, Z = ‖g‖/√n̂), but a worker that does not clip
    is still rejected: a partial of 10·count·C, far above the envelope's bound (about 3·count·C
    for k = 32), is refused and re-issued, while 2·count·C (within it) is accepted."""
    cohort = [f"user-{i}" for i in range(12)]
    gather = _new_gather(cohort, estimate_probes=RC_PROBES)
    groups = [g.group_id for g in gather.pending()]
    task, attempt = gather.issue("worker-a", groups, now=0.0)
    count = len(gather.task_units(task))
    bad = _partial_of_norm(gather, task, attempt, "worker-a", 10 * count * CLIP)
    verdict = _offer(gather, bad, "unclipped partial under randomized clipping")
    assert not verdict.accepted and verdict.reissue, (
        f"a partial of norm {10 * count * CLIP:.3g} = 10·count·C from {count} units clipped by "
        f"{RC_PROBES}-probe estimates was accepted ({verdict.reason}): with estimated norms the "
        "coordinator must still refuse a worker that does not clip"
    )
    retry, retry_attempt = gather.issue("worker-b", groups, now=1.0)
    within = _partial_of_norm(gather, retry, retry_attempt, "worker-b", 2 * count * CLIP)
    assert _offer(gather, within, "estimated-norm partial").accepted, (
        f"a partial of 2·count·C from {count} units clipped by estimated norms was refused: "
        "the bound must allow the estimates' spread (Z > 1)"
    )
