"""A task's result on its way from a worker to the coordinator's gather.

- :class:`TaskSum`: a worker's sum of the CLIPPED updates of one task's units and their
  :class:`~userdp.strategies.unit_stats.UnitStats`. The engines (:mod:`userdp.clients.clipping`)
  build it, the worker streams it (:func:`userdp.proto.codec.result_parts` and
  :func:`~userdp.proto.codec.result_proto`).
- :class:`TaskResult`: a :class:`TaskSum` as the coordinator receives it for one task attempt:
  the task's labels, the worker that answered, its tensors still wire-encoded
  (:func:`userdp.proto.codec.result_from_proto`). The gather
  (:class:`userdp.server.aggregation.StepGather`) checks it and adds it to the cohort's sum,
  :class:`userdp.strategies.step.CohortSum`.

No torch at run time, so the transport stays light.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from userdp.proto.tensors import WireTensor
from userdp.strategies.unit_stats import UnitStats

if TYPE_CHECKING:
    import torch

__all__ = ["TaskResult", "TaskSum"]


@dataclass
class TaskSum:
    """Σ clip(g_u, C) over one task's units and their statistics.

    sums: parameter name -> tensor, trainable parameters only (CPU float32 torch tensors on the
        worker; :class:`~userdp.proto.tensors.WireTensor` views as received).
    stats: the units' statistics.
    skipped_examples: examples dropped for having fewer than 2 tokens (the worker's own; not on
        the wire).
    """

    sums: Mapping[str, torch.Tensor | WireTensor]
    stats: UnitStats = field(default_factory=UnitStats)
    skipped_examples: int = 0


@dataclass
class TaskResult:
    """A worker's :class:`TaskSum` for one task attempt, with the labels the gather checks."""

    task_id: str
    attempt: int
    step: int
    model_version: int
    worker_id: str
    unit_ids: tuple[str, ...]
    task_sum: TaskSum
    compute_seconds: float = 0.0
    held: bool = False
    """The collective data plane: the sum stayed on the worker (``task_sum.sums`` is empty)
    until the group's reduce."""
