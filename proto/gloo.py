"""The collective data plane's transport, shared by both ends: gloo groups and the reduce's
buckets.

Under ``coordinator.data_plane = "collective"`` (docs/protocol.md) each generation of the
workers' process group is two gloo groups that rendezvous in the coordinator's TCPStore:

- the *reduce group*: the coordinator as rank 0 (the reduce's root) and member ``r`` as rank
  ``r + 1``, under ``<prefix>reduce``;
- the *members' group*: the members alone, member ``r`` as rank ``r``, under ``<prefix>members``;
  the leader (rank 0) passes each model version on through it.

Both ends cut the reduced sum into the same :func:`buckets` (whole tensors, in the order the
coordinator's ``GroupReduce`` lists them), so every rank issues the same collectives in the same
order.
"""

from __future__ import annotations

import datetime
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from userdp.proto.layout import TensorLayout

BUCKET_ELEMENTS = 1 << 23
"""float32 elements per reduce (32 MiB): large enough for gloo's bandwidth, small enough that no
member holds a second flat copy of the model."""

REDUCE_PREFIX = "reduce"
MEMBERS_PREFIX = "members"
ARRIVED_PREFIX = "arrived"
"""Under it, member ``r`` sets key ``r + 1`` when it starts joining a generation, and the
coordinator key ``0`` once every member's key is there. Each side waits for the keys it needs
with a loop it can leave (:func:`wait_arrived`), then builds its rank: a rendezvous blocked
inside gloo cannot be left, and aborts the process if it exits meanwhile."""

POLL_S = 0.02
"""How often a waiting rank looks for the others' arrival keys."""


def wait_arrived(
    store: dist.Store, prefix: str, ranks: list[int], timeout_s: float, stop: Callable[[], bool]
) -> None:
    """Wait until the arrival keys of ``ranks`` are set under ``prefix`` + :data:`ARRIVED_PREFIX`;
    raises TimeoutError after ``timeout_s``, RuntimeError when ``stop()`` or when the process's
    main thread has ended (the interpreter is exiting)."""
    arrived = dist.PrefixStore(prefix + ARRIVED_PREFIX, store)
    keys = [str(rank) for rank in ranks]
    deadline = time.monotonic() + timeout_s
    while not arrived.check(keys):
        if stop() or not threading.main_thread().is_alive():
            raise RuntimeError("stopped waiting for the group's other ranks")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the group's other ranks did not arrive within {timeout_s:.0f}s")
        time.sleep(POLL_S)


def arrive(store: dist.Store, prefix: str, rank: int) -> None:
    """Set this rank's arrival key (see :data:`ARRIVED_PREFIX`)."""
    dist.PrefixStore(prefix + ARRIVED_PREFIX, store).set(str(rank), "1")


def device() -> Any:
    """The gloo transport device: the interface named by ``GLOO_SOCKET_IFNAME`` (as
    torch.distributed's own gloo groups read it), else the one the host name resolves to."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")[0]
    if interface:
        return dist.ProcessGroupGloo.create_device(interface=interface)
    return dist.ProcessGroupGloo.create_default_device()


def group(
    store: dist.Store,
    prefix: str,
    rank: int,
    size: int,
    timeout_s: float,
    transport: Any = None,
) -> dist.ProcessGroupGloo:
    """This process as ``rank`` of a gloo group of ``size`` that rendezvouses in ``store`` under
    ``prefix`` over ``transport`` (default: :func:`device`); blocks until every rank has joined
    (or raises after ``timeout_s``), and every collective of the group fails after
    ``timeout_s``."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._devices = [transport if transport is not None else device()]
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, options)


def client_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the coordinator's TCPStore at ``host:port``."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore(host, port, is_master=False, timeout=timeout)


def buckets(layout: TensorLayout) -> list[TensorLayout]:
    """The reduce's buckets: consecutive tensors of ``layout`` in buckets of at least
    :data:`BUCKET_ELEMENTS` elements (the last may be smaller; a tensor is never split)."""
    return layout.buckets(BUCKET_ELEMENTS)


def reduce_options() -> dist.ReduceOptions:
    """A sum reduced to the coordinator (rank 0 of the reduce group)."""
    options = dist.ReduceOptions()
    options.rootRank = 0
    options.reduceOp = dist.ReduceOp.SUM
    return options
