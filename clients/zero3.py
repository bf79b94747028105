"""ZeRO-3 workers: parameters partitioned over a worker's ranks, per-unit clipping in lockstep.

Under DeepSpeed ZeRO stage 3 a rank keeps only its partition of every parameter
(``param.ds_tensor``, a flat slice of ``ceil(numel / N)`` elements) and DeepSpeed's module hooks
all-gather a module's parameters just before its forward (and again before its backward) and
release them after. Those gathers are collectives over the worker's ranks, so the ranks must run
the same sequence of module calls. The engines' passes are of two kinds, each with a fixed
sequence of module calls whatever the data:

- a **micro-batch pass** of the vectorized engines: one forward with the capture hooks, one
  backward to the recorded layer outputs (plus, on the attribution-check pass, the plain
  parameter backwards of :mod:`userdp.clients.attribution`, as many on every rank);
- a **chunk pass** of the ``loop`` path (a unit, or a chunk of an oversized unit): one forward,
  one backward to the parameters.

A rank's units give it some number of passes of each kind; :class:`Lockstep` all-reduces the
largest count of each kind, and a rank with fewer runs the rest on a two-token dummy unit whose
sums are never kept (:func:`dummy_unit`, :class:`userdp.clients.clipping.Discard`). Per-unit
norms and book-keeping products need a weight's shape, never its values (:func:`param_shape` reads
DeepSpeed's ``ds_shape``), and they run on the activations and output gradients each rank holds
for its own units, so a unit is never split and nothing unclipped leaves a rank: the clipped sums
are reduced exactly as at stages 0-2 (:func:`userdp.clients.distributed.all_reduce_result`).

A model version arrives as whole tensors; :func:`load_partitioned` copies into each rank's
partition only its own slice (and into the gathered tensor too while DeepSpeed keeps one, as it
does for small "persistent" parameters): no rank gathers a parameter to write it. (The version
itself still reaches every rank whole, from rank 0's broadcast.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from userdp.clients.batching import EngineError, PreparedUnit, Unit, prepare_units


def is_partitioned(param: torch.Tensor) -> bool:
    """Whether ``param`` is a ZeRO-3 parameter (DeepSpeed gave it a partition)."""
    return getattr(param, "ds_tensor", None) is not None


def param_shape(param: torch.Tensor) -> torch.Size:
    """The full shape of a parameter, partitioned (ZeRO-3) or not."""
    return param.ds_shape if is_partitioned(param) else param.shape


def param_numel(param: torch.Tensor) -> int:
    return param.ds_numel if is_partitioned(param) else param.numel()


def any_partitioned(params: Mapping[str, torch.Tensor] | Sequence[torch.Tensor]) -> bool:
    values = params.values() if isinstance(params, Mapping) else params
    return any(is_partitioned(p) for p in values)


def partition_summary(module: torch.nn.Module) -> str:
    """One line for the worker's log: how much of the model this rank holds at rest."""
    params = list(module.parameters())
    held = sum(p.ds_tensor.numel() if is_partitioned(p) else p.numel() for p in params)
    total = sum(param_numel(p) for p in params)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return f"rank {rank} holds {held:,} of the model's {total:,} parameter elements"


class Lockstep:
    """Agreement among a ZeRO-3 worker's ranks on how many passes of each kind to run (see the
    module docstring). Every rank must make the same calls in the same order."""

    def __init__(self, device: torch.device, pad_id: int, max_positions: int | None) -> None:
        self.device = device
        self.dummy = [dummy_unit(pad_id, max_positions)]
        """The units of a dummy pass (:func:`dummy_unit`), as a ``prepared`` list."""

    def most(self, counts: Sequence[int]) -> list[int]:
        """The largest of each count over the ranks (one all-reduce)."""
        tensor = torch.tensor(list(counts), dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
        return [int(v) for v in tensor.tolist()]

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (one all-reduce)."""
        return bool(self.most([int(flag)])[0])


def dummy_unit(pad_id: int, max_positions: int | None) -> PreparedUnit:
    """A two-token unit for the passes a rank runs only to keep its ranks in step; what it
    computes is never added to a result."""
    return prepare_units([Unit("", [np.array([pad_id, pad_id], dtype=np.int64)])], max_positions)[0]


def _partition_rank(param: torch.Tensor) -> int:
    group = getattr(param, "ds_process_group", None)
    return torch.distributed.get_rank(group=group)


def load_partitioned(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy the whole tensor ``value`` into a ZeRO-3 parameter: this rank's slice into its
    partition, and the whole of it into the gathered tensor when DeepSpeed holds one."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    if tuple(value.shape) != tuple(param.ds_shape):
        raise ValueError(
            f"a tensor of shape {list(value.shape)} for a parameter of shape {list(param.ds_shape)}"
        )
    if getattr(param, "ds_secondary_tensor", None) is not None:
        raise EngineError(
            "ZeRO++ hierarchical partitions (zero_hpz_partition_size > 1) are not supported: a "
            "model version would have to reach the secondary copies too; remove that key"
        )
    partition = param.ds_tensor
    size = partition.ds_numel
    start = size * _partition_rank(param)
    flat = value.reshape(-1)
    with torch.no_grad():
        held = max(0, min(size, flat.numel() - start))
        if held:
            partition.narrow(0, 0, held).copy_(flat.narrow(0, start, held))
        if held < size:
            partition.narrow(0, held, size - held).zero_()
        if param.ds_status == ZeroParamStatus.AVAILABLE and param.numel() == flat.numel():
            param.data.copy_(value.to(dtype=param.dtype, device=param.device).view(param.shape))
