"""The collective patterns userdp uses at every level, written once: the ranks of one worker (the
default process group, :mod:`userdp.clients.ranks`) and the workers' groups with the coordinator
(standalone gloo groups, :mod:`userdp.proto.gloo`).

- :func:`start_failure_count` / :func:`failure_count`: every rank says whether it failed and all
  learn how many did (an all-reduce SUM of one flag each), so no rank goes on alone into a
  collective a failed one never reaches.
- :func:`broadcast_bytes`: a byte string from rank 0 to every rank, after a header of integers
  (its length first, then the caller's fields), so every rank takes exactly the bytes the source
  sends and can tell from the header what they are.

``group`` is a standalone process group (a :class:`torch.distributed.ProcessGroupGloo` of
:mod:`userdp.proto.gloo`), or None for the default process group; ``device`` is where the
tensors go (NCCL moves CUDA tensors).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

Buffer = bytes | bytearray | np.ndarray
"""Bytes to send: anything with the buffer protocol (a wire tensor's raw bytes)."""


def start_failure_count(
    failed: bool, group: Any = None, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, Any]:
    """Issue the failure count: (the one-element tensor that holds it once the returned work
    completed, the work). Every rank of ``group`` must call it, failed or not."""
    count = torch.tensor([1.0 if failed else 0.0], device=device)
    if group is None:
        return count, dist.all_reduce(count, op=dist.ReduceOp.SUM, async_op=True)
    return count, group.allreduce([count])


def failure_count(failed: bool, group: Any = None, device: torch.device | str = "cpu") -> int:
    """How many ranks of ``group`` failed (:func:`start_failure_count`, waited for)."""
    count, work = start_failure_count(failed, group, device)
    work.wait()
    return int(count.item())


def broadcast_bytes(
    data: Buffer | torch.Tensor | None,
    *,
    group: Any = None,
    device: torch.device | str = "cpu",
    header: Sequence[int] = (),
) -> tuple[list[int], torch.Tensor]:
    """Rank 0 (``data``: bytes or a tensor's bytes; None when it has no bytes, only a ``header``) sends (len(data),
    *header), then the bytes; the other ranks (``data`` None, a ``header`` of the same length
    whose values are placeholders) receive them. Returns (the header's fields after the length, the bytes
    received: a CPU uint8 tensor, empty at rank 0)."""
    payload = _as_uint8(data) if data is not None else None
    length = 0 if payload is None else payload.numel()
    fields = torch.tensor([length, *header], dtype=torch.int64, device=device)
    _broadcast(fields, group)
    length, *rest = (int(v) for v in fields.tolist())
    if length == 0:
        return rest, torch.empty(0, dtype=torch.uint8)
    if payload is not None:  # the source
        _broadcast(payload.to(device), group)
        return rest, torch.empty(0, dtype=torch.uint8)
    buffer = torch.empty(length, dtype=torch.uint8, device=device)
    _broadcast(buffer, group)
    return rest, buffer.cpu()


def _as_uint8(data: Buffer | torch.Tensor) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        return data.reshape(-1).view(torch.uint8)
    writable = data if isinstance(data, bytearray) else bytearray(data)
    if not writable:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(writable, dtype=torch.uint8)


def _broadcast(tensor: torch.Tensor, group: Any) -> None:
    """``tensor`` from rank 0 of ``group``, in place."""
    if group is None:
        dist.broadcast(tensor, src=0)
        return
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()
