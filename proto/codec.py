"""The wire codec of a task and its result: each conversion written once, imported by both ends.

- :func:`task_proto`: a step's :class:`~userdp.strategies.base.TaskSpec` plus one task's envelope
  (task id, attempt, step, model version, unit ids, deadline) -> ``pb.Task``. The coordinator and
  the in-process simulator both use it, so both run the workers' code on the same input.
- :func:`task_from_proto`: ``pb.Task`` -> :class:`WorkerTask`, the fields a worker computes with.
  A zero or empty wire field means "the default": the :class:`TaskSpec` default for the example
  selection, the worker's own engine configuration for the engine options.
- :func:`result_parts` and :func:`result_proto`: a worker's
  :class:`~userdp.proto.results.TaskSum` -> its ``ResultPart`` chunks (in their
  ``WorkerMessage`` envelopes) and the ``Result`` that closes them.
- :func:`result_from_proto`: a ``Result`` and its reassembled tensors -> the coordinator's
  :class:`~userdp.proto.results.TaskResult`.
- ``_stats_fields`` / ``_stats_from_result``: :class:`~userdp.strategies.unit_stats.UnitStats`
  <-> the ``Result`` fields that carry it, the only mapping between the two.
- :func:`example_unit_id` / :func:`parse_example_unit_id`: example unit ids
  ``"<user id>/<example index>"``, the strategy API's own (:mod:`userdp.strategies.base`),
  re-exported here for the two ends.

No torch: the worker's transport stays free of it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.chunk_messages import ChunkMessage, result_part_messages
from userdp.proto.results import TaskResult, TaskSum
from userdp.proto.tensors import WireTensor
from userdp.strategies.base import TaskSpec, example_unit_id, parse_example_unit_id
from userdp.strategies.unit_stats import UnitStats

__all__ = [
    "WorkerTask",
    "example_unit_id",
    "parse_example_unit_id",
    "result_from_proto",
    "result_parts",
    "result_proto",
    "task_from_proto",
    "task_proto",
]

DEFAULT_SELECTION = "random"
"""Example selection when the task names none (the :class:`TaskSpec` default)."""
DEFAULT_SEQ_LEN = 128
"""Tokens per example when the task names no length (the :class:`TaskSpec` default)."""


# ---- tasks ----------------------------------------------------------------------------------


def task_proto(
    spec: TaskSpec,
    step: int,
    task_id: str,
    attempt: int,
    model_version: int,
    units: Sequence[str],
    deadline_s: float,
    *,
    hold: bool = False,
    gather: int = 0,
) -> pb.Task:
    """The wire ``Task`` for ``units`` of a step whose workers are told ``spec``; ``hold``: the
    worker keeps the sum for the group's reduce (the collective data plane); ``gather``: which
    gather of the step the task belongs to (0 = the first, n = its n-th retry)."""
    return pb.Task(
        hold=hold,
        gather=gather,
        task_id=task_id,
        attempt=attempt,
        step=step,
        model_version=model_version,
        unit_ids=list(units),
        clip_norm=spec.clip_norm,
        engine=pb.EngineOptions(
            engine=spec.engine,
            probes=spec.probes,
            estimator=spec.estimator,
            token_budget=spec.token_budget,
            unit=spec.unit,
            local_steps=spec.local_steps,
            local_lr=spec.local_lr,
            local_batch_size=spec.local_batch_size,
        ),
        selection=pb.Selection(
            strategy=spec.selection, group_size=spec.group_size, seq_len=spec.seq_len
        ),
        deadline_s=deadline_s,
        selection_seed=spec.selection_seed,
    )


@dataclass(frozen=True)
class WorkerTask:
    """A ``pb.Task`` as the worker computes it (see :func:`task_from_proto`).

    ``unit``: ``"user"`` or ``"example"`` (unit ids ``"<user id>/<index>"``). ``group_size``:
    examples per user (None = all). ``engine``, ``probes``, ``token_budget``: None = the worker's
    configured engine, exact norms, the engine's token budget. ``estimator``: the randomized
    engine's norm estimator (an empty wire field is ``"hutchinson"``), None for other engines."""

    task_id: str
    attempt: int
    step: int
    model_version: int
    unit_ids: tuple[str, ...]
    clip_norm: float
    unit: str
    selection: str
    group_size: int | None
    seq_len: int
    selection_seed: int
    engine: str | None
    probes: int | None
    estimator: str | None
    token_budget: int | None
    local_steps: int
    local_lr: float
    local_batch_size: int


def task_from_proto(task: pb.Task) -> WorkerTask:
    """The worker's view of a wire ``Task``: zero or empty fields become their defaults."""
    options, selection = task.engine, task.selection
    return WorkerTask(
        task_id=task.task_id,
        attempt=task.attempt,
        step=task.step,
        model_version=task.model_version,
        unit_ids=tuple(task.unit_ids),
        clip_norm=task.clip_norm,
        unit=options.unit or "user",
        selection=selection.strategy or DEFAULT_SELECTION,
        group_size=selection.group_size or None,
        seq_len=selection.seq_len or DEFAULT_SEQ_LEN,
        selection_seed=task.selection_seed,
        engine=options.engine or None,
        probes=options.probes if options.engine == "randomized" else None,
        estimator=(options.estimator or "hutchinson") if options.engine == "randomized" else None,
        token_budget=options.token_budget or None,
        local_steps=options.local_steps,
        local_lr=options.local_lr,
        local_batch_size=options.local_batch_size,
    )


# ---- results --------------------------------------------------------------------------------


def result_parts(
    task: pb.Task, sums: Mapping[str, Any], chunk_bytes: int
) -> Iterator[ChunkMessage]:
    """The ``WorkerMessage`` envelopes carrying a task's summed tensors as ``ResultPart``
    chunks of at most ``chunk_bytes``, encoded around one copy of the bytes
    (:mod:`userdp.proto.chunk_messages`)."""
    return result_part_messages(task.task_id, task.attempt, sums, chunk_bytes)


def _stats_fields(stats: UnitStats) -> dict[str, Any]:
    """The ``Result`` fields carrying ``stats`` (keyword arguments of ``pb.Result``)."""
    return {
        "count": stats.count,
        "nonfinite": stats.nonfinite,
        "clipped": stats.clipped,
        "norms": pb.NormStats(
            min=stats.norm_min, max=stats.norm_max, sum=stats.norm_sum, sum_sq=stats.norm_sum_sq
        ),
        "loss_sum": stats.loss_sum,
        "tokens": stats.tokens,
    }


def _stats_from_result(result: pb.Result) -> UnitStats:
    """The :class:`UnitStats` a ``Result`` carries (inverse of ``_stats_fields``)."""
    return UnitStats(
        count=result.count,
        nonfinite=result.nonfinite,
        clipped=result.clipped,
        norm_min=result.norms.min,
        norm_max=result.norms.max,
        norm_sum=result.norms.sum,
        norm_sum_sq=result.norms.sum_sq,
        loss_sum=result.loss_sum,
        tokens=result.tokens,
    )


def result_proto(
    task: pb.Task, task_sum: TaskSum, compute_seconds: float, *, held: bool = False
) -> pb.Result:
    """The ``Result`` closing a task's parts: the task's labels and the task sum's statistics.
    ``held``: no parts precede it; the sum stays on the worker for the group's reduce."""
    return pb.Result(
        task_id=task.task_id,
        attempt=task.attempt,
        step=task.step,
        model_version=task.model_version,
        held=held,
        num_tensors=0 if held else len(task_sum.sums),
        **_stats_fields(task_sum.stats),
        compute_seconds=compute_seconds,
        unit_ids=task.unit_ids,
    )


def result_from_proto(
    result: pb.Result, worker_id: str, tensors: Mapping[str, WireTensor]
) -> TaskResult:
    """The coordinator's :class:`~userdp.proto.results.TaskResult` of a ``Result`` from
    ``worker_id`` whose parts reassembled into ``tensors`` (judged later, by the step's gather)."""
    return TaskResult(
        task_id=result.task_id,
        attempt=result.attempt,
        step=result.step,
        model_version=result.model_version,
        worker_id=worker_id,
        unit_ids=tuple(result.unit_ids),
        task_sum=TaskSum(tensors, _stats_from_result(result)),
        compute_seconds=result.compute_seconds,
        held=result.held,
    )
