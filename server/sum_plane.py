"""How a step's task sums reach the coordinator and a model version reaches the workers: the
part of a :class:`~userdp.server.fleet.Fleet` that differs between the data planes.

The fleet's gather and broadcast are written once (:mod:`userdp.server.fleet`); at each point
where the planes differ it asks its :class:`SumPlane`, as PyTorch's DistributedDataParallel asks
its communication hook, instead of being subclassed per plane. Two planes answer:

- :class:`StreamedPlane` (``coordinator.data_plane = "grpc"``): every task result carries its
  sum over gRPC, checked task by task as it arrives; every model version streams from the
  coordinator to every worker.
- :class:`~userdp.server.group_plane.GroupPlane` (``"collective"``): the workers of a step form
  a process group, hold their sums and reduce them to the coordinator once every shard group is
  done; a model version passes from the leader through the group.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # types only: the fleet and the gather import this module
    from userdp.server.aggregation import StepGather
    from userdp.server.coordinator import CoordinatorSettings
    from userdp.server.fleet import Fleet
    from userdp.server.registry import Event, WorkerSession


class SumArrival(enum.Enum):
    """How a step's sum reaches its :class:`~userdp.server.aggregation.StepGather`."""

    IN_RESULTS = "in results"
    """Every task result carries its task's sum (tasks do not say ``hold``)."""
    REDUCED = "reduced"
    """Workers hold their sums (tasks say ``hold``, results carry none); once every shard group
    is done one reduced sum of the accepted ones arrives, with each member's norm."""


class SumPlane(Protocol):
    """What a fleet asks its data plane (see the module docstring)."""

    arrival: SumArrival
    """How the gather receives the sums; tasks say ``hold`` when they are :attr:`REDUCED
    <SumArrival.REDUCED>`."""

    def ack_wait_s(self, settings: CoordinatorSettings) -> float:
        """How long a step's start waits for the workers sent the current version to
        acknowledge it."""
        ...

    def start_gather(
        self, eligible: Mapping[str, WorkerSession], settings: CoordinatorSettings
    ) -> None:
        """Before a gather's first task, given the workers that may get tasks."""
        ...

    def task_workers(self, eligible: Mapping[str, WorkerSession]) -> dict[str, WorkerSession]:
        """The workers, of ``eligible``, that a task may go to."""
        ...

    def complete_gather(self, fleet: Fleet, collect: StepGather, deadline: float) -> None:
        """Once every shard group of ``collect`` is done: make its sum complete, or raise
        :class:`~userdp.server.fleet.StepAborted` (nothing released or charged)."""
        ...

    def observe(self, event: Event) -> None:
        """What a worker event means to the plane, before the fleet handles it."""
        ...

    def broadcast(
        self, fleet: Fleet, targets: Sequence[WorkerSession], trainable: Mapping[str, object]
    ) -> list[WorkerSession]:
        """Start passing the fleet's current version on to ``targets`` (the workers that held
        the previous one); returns those the fleet streams it to over gRPC."""
        ...


class StreamedPlane:
    """The gRPC data plane: every task's sum streams to the coordinator in its result, and every
    version streams from it to every worker."""

    arrival = SumArrival.IN_RESULTS

    def ack_wait_s(self, settings: CoordinatorSettings) -> float:
        """The coordinator's ``ack_wait_s``."""
        return settings.ack_wait_s

    def start_gather(
        self, eligible: Mapping[str, WorkerSession], settings: CoordinatorSettings
    ) -> None:
        """Nothing to form: each task's result brings its own sum."""

    def task_workers(self, eligible: Mapping[str, WorkerSession]) -> dict[str, WorkerSession]:
        """Every eligible worker."""
        return dict(eligible)

    def complete_gather(self, fleet: Fleet, collect: StepGather, deadline: float) -> None:
        """Nothing left to receive: the accepted results carried the sums."""

    def observe(self, event: Event) -> None:
        """No state of its own to update."""

    def broadcast(
        self, fleet: Fleet, targets: Sequence[WorkerSession], trainable: Mapping[str, object]
    ) -> list[WorkerSession]:
        """Every target, over gRPC."""
        return list(targets)
