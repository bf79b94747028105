"""The ranks of one worker: rank 0 talks to the coordinator, the other ranks follow it.

A worker with N devices runs N processes of ``userdp worker`` under a launcher (``torchrun``), one
per device, in one torch.distributed process group (the one DeepSpeed joins). Rank 0 is the worker
the coordinator sees: it registers, receives model versions and tasks, serves the health port and
sends results. :class:`BroadcastCompute` is the
:class:`~userdp.clients.task_runner.TaskCompute` rank 0's client calls: it broadcasts each model
version and task to the other ranks, which run :func:`follow`, then computes it with them. A
task's clipped sum is the engine's collective
(:meth:`userdp.clients.engine.ClippingEngine.clipped_sum`: each rank takes a share of whole units,
the clipped sums are all-reduced once, or at ZeRO-3 reduce-scattered and gathered to rank 0), and
rank 0 sends that result as it is.

Between ranks a command is a JSON header (``kind``: model, task, idle or stop) and its payloads,
each a byte string broadcast from rank 0 (the task's protobuf, a tensor's raw bytes; no pickle).
A model version sends a ZeRO-3 parameter that DeepSpeed holds released as one scatter instead,
each rank receiving only its slice (:func:`send_model_version`).
``idle`` is sent every ``keepalive_s`` so a follower waiting for the next command never reaches the
process group's timeout while the coordinator sends nothing; ``stop`` ends the followers, and rank 0
sends it on every exit path (drained, refused, unreachable, an error), after which all ranks
leave the process group together (:func:`leave_process_group`). A follower that cannot receive
(rank 0 died) raises, and the launcher ends the other ranks.

Every rank agrees before each collective step that no rank failed the step before it
(:func:`userdp.clients.distributed.raise_if_any_rank_failed`): applying a model version, reading a
task's units (:class:`~userdp.clients.worker_service.EngineCompute`), the local clipped sums (the
engine). A failed task fails on every rank and rank 0 reports it; the ranks go on.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from userdp.clients.batching import EngineError
from userdp.clients.distributed import raise_if_any_rank_failed
from userdp.clients.zero3 import load_slice, rank_slice, slice_elements
from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.collectives import broadcast_bytes
from userdp.proto.results import TaskSum
from userdp.proto.tensors import WireTensor, wire_itemsize

log = logging.getLogger("userdp.worker")

KEEPALIVE_S = 60.0
_APPLY_FAILED = "another rank of this worker could not apply the model version (its log says why)"


def launched_rank() -> tuple[int, int]:
    """(rank, world size) the launcher gave this process (``RANK``, ``WORLD_SIZE``; (0, 1) when
    started without one), read before the process group exists."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def bind_local_device(device: str) -> None:
    """On CUDA, make this rank's device (``LOCAL_RANK``) the current one before the model is
    built, so no rank allocates on another rank's GPU."""
    if device == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))


class RankChannel:
    """Commands from rank 0 to the other ranks of the default process group (see the module
    docstring); tensors go through ``device`` (the engine's: NCCL broadcasts CUDA tensors)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def send(self, header: Mapping[str, Any], payloads: Sequence[bytes | bytearray] = ()) -> None:
        """Rank 0: broadcast one command."""
        text = json.dumps({**header, "payloads": len(payloads)}).encode()
        self._broadcast(text)
        for payload in payloads:
            self._broadcast(payload)

    def receive(self) -> tuple[dict[str, Any], list[bytearray]]:
        """Ranks > 0: the next command rank 0 sends (blocks until it comes)."""
        header = json.loads(self._broadcast(None))
        payloads = [self._broadcast(None) for _ in range(int(header.pop("payloads")))]
        return header, payloads

    def scatter(self, parts: Sequence[torch.Tensor] | None, length: int = 0) -> bytearray:
        """Rank 0: one byte string per rank (``parts``, uint8 tensors of one length; its own is
        dropped). Ranks > 0: this rank's string of ``length`` bytes."""
        dist = torch.distributed
        if parts is not None:
            length = parts[0].numel()
        mine = torch.empty(length, dtype=torch.uint8, device=self.device)
        inputs = None if parts is None else [p.to(self.device) for p in parts]
        dist.scatter(mine, inputs, src=0)
        return bytearray() if parts is not None else bytearray(mine.cpu().numpy())

    def _broadcast(self, data: bytes | bytearray | None) -> bytearray:
        """One byte string from rank 0 (``data``) to every rank (``None`` there, which gets it
        back)."""
        _, received = broadcast_bytes(data, device=self.device)
        return bytearray(received.numpy()) if data is None else bytearray()


class BroadcastCompute:
    """Rank 0's TaskCompute over ``compute`` (an
    :class:`~userdp.clients.worker_service.EngineCompute`): every model version and task goes to
    the other ranks first, then all ranks compute it (see the module docstring). Calls are
    serialized (the client calls from its stream and task threads); :meth:`stop` ends the
    followers and refuses later calls."""

    def __init__(self, compute: Any, keepalive_s: float = KEEPALIVE_S) -> None:
        self.local = compute
        self.device = compute.engine.device
        self.channel = RankChannel(self.device)
        self._lock = threading.Lock()
        self._stopped = False
        self._stopping = threading.Event()
        self._keepalive = threading.Thread(
            target=self._idle, args=(keepalive_s,), daemon=True, name="userdp-ranks-keepalive"
        )
        self._keepalive.start()

    def apply_model(self, tensors: Mapping[str, WireTensor], full: bool) -> None:
        with self._lock:
            self._running()
            error = send_model_version(self.channel, self.local.engine.module, tensors, full)
            error = error or _attempt(self.local.apply_model, tensors, full)
            raise_if_any_rank_failed(error, self.device, _APPLY_FAILED)

    def compute(self, task: pb.Task) -> TaskSum:
        with self._lock:
            self._running()
            self.channel.send({"kind": "task"}, [task.SerializeToString()])
            return self.local.compute(task)

    def stop(self) -> None:
        """Send ``stop`` to the followers (once; after a running call returns). A follower that
        is already gone is logged, not raised: this runs on the worker's exit paths."""
        self._stopping.set()
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            try:
                self.channel.send({"kind": "stop"})
                leave_process_group()
            except Exception as exc:  # noqa: BLE001 - exit path: the launcher ends the ranks
                log.warning("could not stop the other ranks of this worker: %s", exc)

    def _running(self) -> None:
        if self._stopped:
            raise EngineError("the other ranks of this worker were stopped")

    def _idle(self, interval_s: float) -> None:
        while not self._stopping.wait(interval_s):
            with self._lock:
                if self._stopped:
                    return
                try:
                    self.channel.send({"kind": "idle"})
                except Exception as exc:  # noqa: BLE001 - the next command raises it again
                    log.warning("the other ranks of this worker stopped answering: %s", exc)
                    return


def follow(compute: Any) -> None:
    """Ranks > 0: apply the model versions and compute the tasks rank 0 broadcasts, until it
    sends ``stop``. A task that fails fails on every rank (the engine's failure flag) and rank 0
    reports it; the follower goes on. A model version that any rank cannot apply raises."""
    device = compute.engine.device
    channel = RankChannel(device)
    rank = torch.distributed.get_rank()
    while True:
        header, payloads = channel.receive()
        kind = header["kind"]
        if kind == "stop":
            log.info("stopped by rank 0")
            leave_process_group()
            return
        if kind == "idle":
            continue
        if kind == "model":
            whole, slices = receive_model_version(channel, header, payloads)
            error = _attempt(_apply_version, compute, whole, slices, header["full"])
            raise_if_any_rank_failed(error, device, _APPLY_FAILED)
        elif kind == "task":
            task = pb.Task.FromString(bytes(payloads[0]))
            try:
                compute.compute(task)
            except Exception as exc:  # noqa: BLE001 - every rank failed it; rank 0 reports it
                log.warning("task %s failed on every rank: %s", task.task_id, exc)
        else:
            raise EngineError(f"rank {rank}: unknown command {kind!r} from rank 0")


def send_model_version(
    channel: RankChannel, module: torch.nn.Module, tensors: Mapping[str, WireTensor], full: bool
) -> BaseException | None:
    """Rank 0: a model version to the other ranks. A ZeRO-3 parameter that can take it slice by
    slice (:func:`userdp.clients.zero3.slice_elements`; partitioned over all the ranks, and the
    tensor of its shape) is scattered, so each rank receives only its slice; every other tensor
    is broadcast whole (a wrong shape then fails on every rank, in ``load_partitioned``). Every
    scatter completes even when rank 0 cannot slice a tensor (zeros go out instead, so the ranks
    stay in step): that error is returned, for the caller to fail the version on every rank."""
    params = dict(module.named_parameters())
    world = torch.distributed.get_world_size()
    entries, whole, sliced = [], [], []
    for name, tensor in tensors.items():
        size = _slice_size(params.get(name), tensor, world)
        entries.append([name, tensor.dtype, list(tensor.shape), size])
        (sliced if size else whole).append((tensor, size))
    header = {"kind": "model", "full": bool(full), "tensors": entries}
    channel.send(header, [tensor.data for tensor, _ in whole])
    error: BaseException | None = None
    for tensor, size in sliced:
        length = size * wire_itemsize(tensor.dtype)
        parts = None
        if error is None:
            try:
                flat = torch.frombuffer(bytearray(tensor.data), dtype=torch.uint8)
                parts = [rank_slice(flat, length, r) for r in range(world)]
            except Exception as exc:  # noqa: BLE001 - returned; the scatters go on with zeros
                error = exc
        channel.scatter(parts or [torch.zeros(length, dtype=torch.uint8)] * world)
    return error


def _slice_size(param: torch.Tensor | None, tensor: WireTensor, world: int) -> int:
    size = slice_elements(param)
    if not size or tuple(tensor.shape) != tuple(param.ds_shape):
        return 0
    if torch.distributed.get_world_size(getattr(param, "ds_process_group", None)) != world:
        return 0  # partitioned over part of the worker: every rank takes the whole tensor
    return size


def receive_model_version(
    channel: RankChannel, header: Mapping[str, Any], payloads: Sequence[bytearray]
) -> tuple[dict[str, WireTensor], dict[str, WireTensor]]:
    """Ranks > 0: the whole tensors and this rank's slices (1-D) of :func:`send_model_version`."""
    entries = header["tensors"]
    whole_entries = [entry for entry in entries if not entry[3]]
    whole = {
        name: WireTensor(dtype, tuple(shape), data)
        for (name, dtype, shape, _), data in zip(whole_entries, payloads, strict=True)
    }
    slices = {}
    for name, dtype, _shape, size in entries:
        if size:
            slices[name] = WireTensor(
                dtype, (size,), channel.scatter(None, size * wire_itemsize(dtype))
            )
    return whole, slices


def _apply_version(
    compute: Any, whole: Mapping[str, WireTensor], slices: Mapping[str, WireTensor], full: bool
) -> None:
    params = dict(compute.engine.module.named_parameters())
    unknown = sorted(set(slices) - set(params))
    if unknown:
        raise KeyError(f"the model has no parameters named {unknown[:3]}")
    compute.apply_model(whole, full)
    for name, part in slices.items():
        load_slice(params[name], part.torch())


def leave_process_group() -> None:
    """The ranks' last collective once rank 0 sent ``stop``: a barrier, then the process group is
    destroyed on every rank. (A rank that exits while another still tears down its gloo
    connections can make that one abort at exit, which the launcher reports as a failure.)
    Unreachable objects are collected first: a collective's work handle that DeepSpeed dropped
    without waiting keeps tensors alive in gloo's threads, and freeing them during interpreter
    finalization (no GIL to take) aborts the process."""
    gc.collect()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _attempt(action: Callable[..., Any], *args: Any) -> BaseException | None:
    """``action(*args)``'s exception, or None."""
    try:
        action(*args)
    except Exception as exc:  # noqa: BLE001 - returned, and raised once the ranks agree
        return exc
    return None
