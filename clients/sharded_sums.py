"""ZeRO-3: clipped sums reduce-scattered to the ranks that own each parameter's partition.

At stages 0-2 every rank keeps a whole float32 buffer of the clipped sums
(:class:`~userdp.clients.clipping.Accumulator`) and the ranks all-reduce it once per task. At
stage 3 that buffer alone would be as large as the model on every rank, so
:class:`ShardedAccumulator` keeps only this rank's shard of each parameter's sum, laid out as
DeepSpeed lays out the parameter's partition (``ds_tensor``: the flattened tensor, zero-padded
to N equal slices, slice r on rank r). What a rank adds is already clipped (the engines add
c_u·g_u, never g_u), and it is reduce-scattered as soon as it is formed, as ZeRO reduce-scatters
ordinary gradients:

- A **round** is one pass of the engines' lockstep (:mod:`userdp.clients.zero3`): a micro-batch
  pass or a chunk pass, real or dummy. Ranks run the same passes, so they run the same rounds,
  each right after its pass and before the next pass's gathers.
- Within a round every parameter is reduce-scattered exactly once, in the model's
  ``named_parameters`` order: what the pass added (:meth:`ShardedAccumulator.add`, in that
  order), else zeros (a dummy pass, a non-finite unit, the non-final chunks of an oversized unit,
  a parameter no unit touched). So the collectives are the same on every rank whatever the data.

At the end of a task :func:`gather_to_first_rank` gathers the shards into rank 0's host memory
(one parameter at a time on the device), because rank 0 streams the task's sum to the
coordinator; the other ranks return their statistics and no sums.
"""

from __future__ import annotations

import math

import torch
from userdp.clients.batching import EngineError
from userdp.clients.clipping import Accumulator
from userdp.clients.zero3 import is_partitioned, param_shape
from userdp.proto.layout import TensorLayout


def _group(params: dict[str, torch.Tensor]) -> torch.distributed.ProcessGroup | None:
    """The process group the parameters are partitioned over; it must be the whole worker."""
    groups = {id(getattr(p, "ds_process_group", None)): p for p in params.values()}
    if len(groups) > 1:
        raise EngineError("ZeRO-3 partitioned the model's parameters over different groups")
    group = getattr(next(iter(params.values())), "ds_process_group", None)
    size = torch.distributed.get_world_size(group)
    if size != torch.distributed.get_world_size():
        raise EngineError(
            f"ZeRO-3 partitioned the model over {size} of the worker's "
            f"{torch.distributed.get_world_size()} ranks; userdp needs all of them"
        )
    return group


def shard_size(param: torch.Tensor, ranks: int) -> int:
    """Elements of one rank's shard: DeepSpeed's partition size, or ceil(numel / N) for a
    parameter it did not partition."""
    if is_partitioned(param):
        return int(param.ds_tensor.ds_numel)
    return math.ceil(param.numel() / ranks)


class ShardedAccumulator(Accumulator):
    """Σ c_u·g_u kept as this rank's shard of each parameter (see the module docstring).

    ``add`` is a collective: every rank adds in ``named_parameters`` order within a round and
    ends every round with :meth:`end_round`."""

    def __post_init__(self) -> None:
        self.group = _group(self.params)
        self.ranks = torch.distributed.get_world_size(self.group)
        self.rank = torch.distributed.get_rank(self.group)
        self.order = list(self.params)
        self.index = {name: i for i, name in enumerate(self.order)}
        device = next(iter(self.params.values())).device
        self.sums = {
            name: torch.zeros(shard_size(p, self.ranks), dtype=torch.float32, device=device)
            for name, p in self.params.items()
        }
        self.cursor = 0
        """Index of the next parameter to reduce-scatter in this round."""
        self.rounds = 0
        self.reduce_scatters = 0

    def add(self, name: str, value: torch.Tensor, scale: float = 1.0) -> None:
        position = self.index[name]
        if position < self.cursor:
            raise EngineError(
                f"internal: {name!r} added out of order or twice in one ZeRO-3 round; the "
                "ranks' reduce-scatters would no longer match"
            )
        self._zeros_until(position)
        whole = value.to(torch.float32).expand(param_shape(self.params[name]))  # broadcast adds
        self._scatter(name, whole.reshape(-1), scale)
        self.cursor = position + 1

    defers_block_sums = False

    def add_unit_sum(self, name, gradients, factors, finite) -> None:
        """Σ_u c_u M_u of retained per-unit gradients, added (a collective, in order)."""
        shape = param_shape(self.params[name])
        self.add(name, gradients.clipped_sum(factors, finite).reshape(shape))

    def end_round(self) -> None:
        self._zeros_until(len(self.order))
        self.cursor = 0
        self.rounds += 1

    def _zeros_until(self, position: int) -> None:
        for name in self.order[self.cursor : position]:
            self._scatter(name, None, 1.0)
        self.cursor = max(self.cursor, position)

    def _scatter(self, name: str, flat: torch.Tensor | None, scale: float) -> None:
        shard = self.sums[name]
        whole = torch.zeros(shard.numel() * self.ranks, dtype=torch.float32, device=shard.device)
        if flat is not None:
            torch.mul(flat, scale, out=whole[: flat.numel()])
        mine = torch.empty_like(shard)
        torch.distributed.reduce_scatter_tensor(mine, whole, group=self.group)
        shard.add_(mine)
        self.reduce_scatters += 1

    def host_sums(self) -> dict[str, torch.Tensor]:
        return gather_to_first_rank(self)


def gather_to_first_rank(acc: ShardedAccumulator) -> dict[str, torch.Tensor]:
    """The whole sums on rank 0 (host float32, views of one buffer), ``{}`` on the other ranks:
    one gather per parameter, in ``named_parameters`` order, on every rank."""
    if acc.cursor:
        raise EngineError("internal: a ZeRO-3 round was left open before the sums were taken")
    layout = TensorLayout.of_shapes({name: param_shape(acc.params[name]) for name in acc.order})
    first = acc.rank == 0
    host = None
    if first:
        pinned = next(iter(acc.sums.values())).device.type == "cuda"
        host = torch.empty(layout.numel, dtype=torch.float32, pin_memory=pinned)
    views = layout.views(host) if host is not None else {}
    destination = torch.distributed.get_global_rank(acc.group, 0) if acc.group else 0
    for name in acc.order:
        shard = acc.sums[name]
        parts = [torch.empty_like(shard) for _ in range(acc.ranks)] if first else None
        torch.distributed.gather(shard, parts, dst=destination, group=acc.group)
        if first:
            whole = torch.cat(parts)[: views[name].numel()]
            views[name].copy_(whole.view(views[name].shape))
    return views
