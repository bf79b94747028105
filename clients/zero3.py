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
are reduce-scattered to the partition owners pass by pass and gathered to rank 0 at the end
(:mod:`userdp.clients.sharded_sums`).

The model is built partitioned (``deepspeed.zero.Init`` through transformers' DeepSpeed
integration: :func:`userdp.clients.distributed.partitioned_build`; with more than one rank, or
one rank with ``offload_param``), so no rank holds it whole at start-up either. A model version arrives at rank 0 as whole tensors (the coordinator's stream). Rank 0 sends each
of the other ranks only its slice of a partitioned parameter (:func:`slice_elements`,
:func:`rank_slice`; :mod:`userdp.clients.ranks`) and every rank writes its slice into its
partition (:func:`load_slice`, :func:`load_partitioned`); a parameter whose gathered tensor
DeepSpeed holds (small "persistent" parameters, once used) goes whole to every rank, which
writes the gathered tensor too. No rank gathers a parameter to write it.
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


def offload_device(params: Mapping[str, torch.Tensor]) -> torch.device | None:
    """The host device where ZeRO-3 keeps the partitions of parameters offloaded off the compute
    device (``offload_param``), or None: a single-rank worker keeps its whole clipped sums there
    too, so that a model larger than its device's memory is not undone by a model-sized sum on
    the device."""
    for param in params.values():
        if is_partitioned(param) and param.ds_tensor.device != param.device:
            return param.ds_tensor.device
    return None


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


def _gathered(param: torch.Tensor) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return param.ds_status == ZeroParamStatus.AVAILABLE


def _refuse_secondary(param: torch.Tensor) -> None:
    if getattr(param, "ds_secondary_tensor", None) is not None:
        raise EngineError(
            "ZeRO++ hierarchical partitions (zero_hpz_partition_size > 1) are not supported: a "
            "model version would have to reach the secondary copies too; remove that key"
        )


def slice_elements(param: torch.Tensor | None) -> int:
    """Elements of each rank's slice when a model version can reach ``param`` slice by slice
    (a ZeRO-3 parameter whose gathered tensor DeepSpeed does not hold now); 0 when it needs the
    whole tensor."""
    if param is None or not is_partitioned(param) or _gathered(param):
        return 0
    return int(param.ds_tensor.ds_numel)


def rank_slice(flat: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    """Elements ``[rank·size, (rank+1)·size)`` of the 1-D ``flat``, zero-padded to ``size``."""
    start = min(size * rank, flat.numel())
    part = flat.narrow(0, start, max(0, min(size, flat.numel() - start)))
    if part.numel() == size:
        return part
    return torch.cat([part, part.new_zeros(size - part.numel())])


def load_slice(param: torch.Tensor, part: torch.Tensor) -> None:
    """Copy this rank's slice ``part`` (1-D, the partition's length, zero padding included) of a
    model version into a ZeRO-3 parameter's partition."""
    _refuse_secondary(param)
    partition = param.ds_tensor
    if part.numel() != partition.ds_numel:
        raise ValueError(
            f"a slice of {part.numel()} elements for a partition of {partition.ds_numel}"
        )
    if _gathered(param):  # rank 0 saw it released: the ranks disagree about this parameter
        raise EngineError(
            "a model version came as a slice for a parameter this rank holds gathered"
        )
    with torch.no_grad():
        partition.narrow(0, 0, part.numel()).copy_(part)


def load_partitioned(param: torch.Tensor, value: torch.Tensor) -> None:
    """Copy the whole tensor ``value`` into a ZeRO-3 parameter: this rank's slice into its
    partition, and the whole of it into the gathered tensor when DeepSpeed holds one."""
    if tuple(value.shape) != tuple(param.ds_shape):
        raise ValueError(
            f"a tensor of shape {list(value.shape)} for a parameter of shape {list(param.ds_shape)}"
        )
    _refuse_secondary(param)
    partition = param.ds_tensor
    flat = value.reshape(-1)
    with torch.no_grad():
        partition.copy_(rank_slice(flat, partition.ds_numel, _partition_rank(param)))
        if _gathered(param) and param.numel() == flat.numel():
            param.data.copy_(value.to(dtype=param.dtype, device=param.device).view(param.shape))
