"""Clipping arithmetic shared by every engine, and the ``loop`` reference engine.

One definition of the clip factor and one accumulator, so the engines cannot drift:

    c_u = min(1, C / ‖g_u‖)   (exact engines)      c_u = min(1, C / √n̂_u)   (randomized)

The sum returned is Σ_u c_u·g_u over the finite units, with no normalization and no noise (the
coordinator's). A unit whose loss or squared gradient norm is not finite (NaN/Inf, including a
float overflow of ‖g‖²) contributes exactly zero and is counted in ``nonfinite``.

``loop``: one forward/backward per unit with ``torch.autograd.grad`` into our own float32 buffers
(never ``.grad``, so no DeepSpeed reduction hook ever sees an unclipped gradient). A unit larger
than the token budget is split into example chunks whose gradients are accumulated; the unit's
loss weights make the sum over chunks exactly the unit's gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch
from userdp.clients.batching import (
    PreparedUnit,
    chunk_examples,
    make_batch,
    token_losses,
)
from userdp.clients.zero3 import Lockstep, param_numel, param_shape
from userdp.proto.layout import TensorLayout
from userdp.proto.results import TaskSum
from userdp.strategies.unit_stats import UnitStats

if TYPE_CHECKING:
    from userdp.clients.unit_gradients import ParameterBlock, UnitGradients


def clip_factor(norm: float, clip_norm: float) -> float:
    """min(1, C / norm); 1 for a zero gradient."""
    return 1.0 if norm <= clip_norm else clip_norm / norm


@dataclass
class Accumulator:
    """Running Σ c_u·g_u (float32, on the compute device) and the unit statistics."""

    params: dict[str, torch.Tensor]
    clip_norm: float
    sums: dict[str, torch.Tensor] = field(init=False)
    stats: UnitStats = field(default_factory=UnitStats)
    skipped_examples: int = 0
    device: torch.device | None = None
    """Where the sums live; default: the parameters' device. A single-rank ZeRO-3 worker whose
    parameters are offloaded to host memory keeps them there too (the engine decides)."""
    early_copy: bool = False
    """Copy the sums to host memory range by range during the last pass (:meth:`last_pass`)
    while the device goes on, instead of all at once when they are read: a single-process
    CUDA worker's engine sets it. On CPU it adds a copy (the accumulator's own buffer is the
    result otherwise); tests set it there to check the ranges."""
    defers_block_sums: ClassVar[bool] = True
    """:meth:`add_block` may hold the small parameters' sums until they are read (a sharded
    accumulator adds every parameter in order, pass by pass, instead)."""
    COPY_ELEMENTS: ClassVar[int] = 8 << 20
    """During the last pass, a range of final sums is copied once it holds this many float32
    elements (32 MiB: a few hundred microseconds of copy each, and a few dozen copies for a
    billion parameters); the rest when the sums are read."""

    def __post_init__(self) -> None:
        # one flat float32 buffer with a view per parameter: the result leaves the device in
        # one copy (into page-locked host memory on CUDA, see :meth:`result`). Uninitialized:
        # a parameter's first :meth:`add` writes its whole view, and :meth:`host_sums` zeroes
        # the views no unit added to, so the buffer is written once instead of zeroed first.
        size = sum(param_numel(p) for p in self.params.values())
        device = self.device
        if device is None:
            device = next(iter(self.params.values())).device if self.params else torch.device("cpu")
        self.flat = torch.empty(size, dtype=torch.float32, device=device)
        shapes = {name: param_shape(p) for name, p in self.params.items()}
        self.sums = TensorLayout.of_shapes(shapes).views(self.flat)
        self._unwritten = set(self.sums)
        self._blocks: dict[tuple, torch.Tensor] = {}
        self._copy: HostCopy | None = None  # from :meth:`last_pass` on, with early_copy
        self._final: set[str] = set()  # written in the last pass
        self._order = list(self.sums)  # the views' order in ``flat``
        self._starts = [0]  # each view's offset in ``flat``, then its end
        for view in self.sums.values():
            self._starts.append(self._starts[-1] + view.numel())
        self._position = {name: i for i, name in enumerate(self._order)}
        self._next = 0  # the first parameter, in order, that is not final yet
        self._copied = 0  # ``flat[:_copied]`` is on its way to host memory

    def last_pass(self) -> None:
        """The next pass is the last one that adds to the sums (the engine knows: its last
        micro-batch, no oversized unit after it). With ``early_copy``, from here on a parameter's
        sum is final once that pass writes it: the copy to host memory starts as soon as the
        parameters written so far, in order, form a range of :attr:`COPY_ELEMENTS` (on a side
        stream on CUDA, so that it overlaps the book-keeping of the parameters after them), and
        only what is left is copied when the sums are read. A sum written again after its copy
        started is copied again (the copies run in order), so the result is the same."""
        if self.early_copy and self._copy is None:
            self._copy = HostCopy(self.flat)

    def _written(self, name: str) -> None:
        """``name``'s view was just written: in the last pass, copy what has become final."""
        if self._copy is None:
            return
        position = self._position[name]
        start, stop = self._starts[position], self._starts[position + 1]
        if start < self._copied:  # its copy started already: copy it again, after this write
            self._copy.copy(start, stop)
            return
        self._final.add(name)
        while self._next < len(self._order) and self._order[self._next] in self._final:
            self._next += 1
        end = self._starts[self._next]
        if end - self._copied >= self.COPY_ELEMENTS:
            self._copy.copy(self._copied, end)
            self._copied = end

    def record(self, norm: float, loss_sum: float, tokens: int) -> float | None:
        """Count one unit; return its clip factor, or None (contributes zero) if not finite."""
        if not (math.isfinite(norm) and math.isfinite(loss_sum)):
            self.stats += UnitStats(nonfinite=1)
            return None
        self.stats += UnitStats.finite_unit(norm, self.clip_norm, loss_sum, tokens)
        return clip_factor(norm, self.clip_norm)

    def add(self, name: str, value: torch.Tensor, scale: float = 1.0) -> None:
        view = self.sums[name]
        value = value.to(device=view.device, dtype=torch.float32)
        if name not in self._unwritten:
            view.add_(value, alpha=scale)
        elif value.shape == view.shape:  # the first add sets every element (0 + s·v = s·v)
            torch.mul(value, scale, out=view)
        else:  # a broadcast add: start from zero
            view.zero_().add_(value, alpha=scale)
        self._unwritten.discard(name)
        self._written(name)

    def add_unit_sum(
        self, name: str, gradients: UnitGradients, factors: torch.Tensor, finite: Sequence[int]
    ) -> None:
        """Add Σ_u c_u M_u of one parameter's retained per-unit gradients over the ``finite``
        units (c = ``factors`` [U] float32): written or accumulated into the parameter's view by
        the GEMMs themselves where the gradients are on the sums' device; else their clipped
        sum, added."""
        view = self.sums[name]
        if gradients.chunks[0].device != view.device:
            self.add(name, gradients.clipped_sum(factors, finite).reshape(view.shape))
            return
        first = name in self._unwritten
        gradients.clipped_sum(factors, finite, out=view.view(-1), accumulate=not first)
        self._unwritten.discard(name)
        self._written(name)

    def add_block(
        self, block: ParameterBlock, factors: torch.Tensor, finite: Sequence[int]
    ) -> None:
        """Add the small parameters' Σ_u c_u M_u (:class:`ParameterBlock`): kept in a running
        [Σ numel] sum of the block's own across micro-batches (the GEMMs accumulate into it) and
        added to the parameters' views once, when the sums are read (or in the last pass with
        ``early_copy``, so that their copy can start), instead of one add per parameter and
        micro-batch."""
        key = tuple((name, part.start, part.stop) for name, part in block.slices.items())
        running = self._blocks.get(key)
        if running is None:  # the clipped sum's own buffer
            self._blocks[key] = block.gradients.clipped_sum(factors, finite).to(self.flat.device)
        elif block.gradients.chunks[0].device == running.device:
            block.gradients.clipped_sum(factors, finite, out=running, accumulate=True)
        else:
            running.add_(block.gradients.clipped_sum(factors, finite).to(running.device))
        if self._copy is not None:
            self._flush_blocks()

    def _flush_blocks(self) -> None:
        """The running block sums, added to their parameters' views."""
        for key, running in self._blocks.items():
            for name, start, stop in key:
                self.add(name, running[start:stop].view(self.sums[name].shape))
        self._blocks.clear()

    def end_round(self) -> None:
        """The end of one pass of the ZeRO-3 lockstep: nothing to do for a whole buffer (see
        :class:`userdp.clients.sharded_sums.ShardedAccumulator`)."""

    def host_sums(self) -> dict[str, torch.Tensor]:
        """The sums as CPU float32 tensors (views of one host buffer). On CPU, the accumulator's
        own buffer (no copy; an accumulator is done once its result is taken). From CUDA: copies
        into page-locked memory (torch's caching host allocator reuses the block once the
        previous result is freed), several times faster than per-tensor copies into pageable
        memory: all of it here, or what :meth:`last_pass` has not copied yet."""
        self.finish()
        if self._copy is None and self.flat.device.type == "cpu":
            host = self.flat.detach()
        else:
            copy = self._copy or HostCopy(self.flat)
            if self._copied < self.flat.numel():
                copy.copy(self._copied, self.flat.numel())
            host = copy.wait()
        return TensorLayout.of_tensors(self.sums).views(host)

    def finish(self) -> None:
        """Make the device buffer ``flat`` hold every sum: the held block sums added, the
        views no unit added to zeroed."""
        self._flush_blocks()
        for name in self._unwritten:  # no unit added to these: their sum is zero
            self.sums[name].zero_()
        self._unwritten.clear()

    def result(self) -> TaskSum:
        return TaskSum(self.host_sums(), self.stats, self.skipped_examples)


class HostCopy:
    """Copies of ranges of a flat float32 buffer into one host buffer (page-locked from CUDA),
    in order: on CUDA on a side stream that waits for what the compute stream has queued, so
    that a copy overlaps the kernels queued after it."""

    def __init__(self, flat: torch.Tensor) -> None:
        self.flat = flat.detach()
        cuda = flat.device.type == "cuda"
        self.host = torch.empty(flat.shape, dtype=torch.float32, pin_memory=cuda)
        self.stream = torch.cuda.Stream(flat.device) if cuda else None

    def copy(self, start: int, stop: int) -> None:
        """Copy ``flat[start:stop]`` as it stands once the kernels queued so far have run."""
        if self.stream is None:
            self.host[start:stop].copy_(self.flat[start:stop])
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.flat.device))
        with torch.cuda.stream(self.stream):
            self.host[start:stop].copy_(self.flat[start:stop], non_blocking=True)

    def wait(self) -> torch.Tensor:
        """The host buffer, once every copy has landed."""
        if self.stream is not None:
            self.stream.synchronize()
        return self.host


class Discard(Accumulator):
    """An accumulator that counts and computes clip factors but keeps no sums: for the dummy
    passes of ZeRO-3's lockstep (:mod:`userdp.clients.zero3`), whose result is thrown away, so
    that they allocate no model-sized buffer."""

    def __post_init__(self) -> None:
        self.sums = {}

    def add(self, name: str, value: torch.Tensor, scale: float = 1.0) -> None:
        return None

    def add_unit_sum(self, name, gradients, factors, finite) -> None:
        return None

    def add_block(self, block, factors, finite) -> None:
        return None


def squared_norm(tensors: Sequence[torch.Tensor]) -> float:
    """Σ ‖t‖² in float64 (inf on overflow, NaN if any entry is NaN)."""
    total = 0.0
    for t in tensors:
        total += float(t.double().pow(2).sum())
    return total


def unit_gradient(
    module: torch.nn.Module,
    params: dict[str, torch.Tensor],
    prepared: Sequence[PreparedUnit],
    index: int,
    token_budget: int,
    pad_id: int,
    between_chunks: Callable[[], None] | None = None,
) -> tuple[dict[str, torch.Tensor], float, int]:
    """One unit's gradient (float32, by parameter name), its summed token loss and its tokens.

    The unit's examples are processed in chunks of padded cost ≤ ``token_budget``;
    ``between_chunks`` runs after each chunk but the last (ZeRO-3 ends a round there)."""
    device = next(iter(params.values())).device
    names, tensors = list(params), list(params.values())
    grads = {
        n: torch.zeros(param_shape(p), dtype=torch.float32, device=device)
        for n, p in params.items()
    }
    loss_sum, tokens = 0.0, 0
    chunks = chunk_examples(prepared[index].examples, token_budget)
    for number, chunk in enumerate(chunks, start=1):
        if number > 1 and between_chunks is not None:
            between_chunks()
        batch = make_batch(prepared, [index], device, pad_id, example_indices=chunk)
        losses = token_losses(module, batch)
        weighted = (losses * batch.weights).sum()
        parts = torch.autograd.grad(weighted, tensors, allow_unused=True)
        for name, part in zip(names, parts, strict=True):
            if part is not None:
                grads[name].add_(part.to(torch.float32))
        loss_sum += float(losses.detach().double().sum())
        tokens += int(batch.mask.sum())
    return grads, loss_sum, tokens


@dataclass(frozen=True)
class UnitWork:
    """This rank's share of one task, as every engine function takes it
    (:data:`userdp.clients.engine.CLIPPED_SUMS`): add the clipped gradients (or deltas) of
    ``prepared[indices]`` to ``acc``, with micro-batches of at most ``token_budget`` padded
    tokens, ``pad_id`` in padded positions, and ``lockstep`` under ZeRO-3 over ranks
    (:mod:`userdp.clients.zero3`; None otherwise)."""

    module: torch.nn.Module
    params: dict[str, torch.Tensor]
    prepared: Sequence[PreparedUnit]
    indices: Sequence[int]
    acc: Accumulator
    token_budget: int
    pad_id: int
    lockstep: Lockstep | None = None


def loop_clipped_sum(work: UnitWork) -> None:
    """The reference engine: per unit, exact gradient, exact norm, clip, add.

    ``work.lockstep`` (ZeRO-3, :mod:`userdp.clients.zero3`): every rank runs as many chunk passes
    as the rank with the most, the extra ones on the lockstep's dummy unit."""
    module, params, prepared, acc = work.module, work.params, work.prepared, work.acc
    token_budget, pad_id, lockstep = work.token_budget, work.pad_id, work.lockstep
    extra = 0
    if lockstep is not None:  # agreed before any pass
        mine = sum(chunk_passes(prepared[i], token_budget) for i in work.indices)
        extra = lockstep.most([mine])[0] - mine
    for index in work.indices:
        if not prepared[index].examples:
            acc.record(0.0, 0.0, 0)
            continue
        grads, loss_sum, tokens = unit_gradient(
            module, params, prepared, index, token_budget, pad_id, acc.end_round
        )
        add_clipped_unit(acc, grads, loss_sum, tokens)
        acc.end_round()
    if lockstep is not None:
        run_dummy_chunk_passes(module, params, lockstep, extra, token_budget, pad_id, acc)


def chunk_passes(unit: PreparedUnit, token_budget: int) -> int:
    """How many forward/backward passes :func:`unit_gradient` runs for ``unit``."""
    return len(chunk_examples(unit.examples, token_budget)) if unit.examples else 0


def run_dummy_chunk_passes(
    module: torch.nn.Module,
    params: dict[str, torch.Tensor],
    lockstep: Lockstep,
    count: int,
    token_budget: int,
    pad_id: int,
    acc: Accumulator,
) -> None:
    """``count`` chunk passes on the lockstep's dummy unit, their gradients thrown away; each
    ends an (empty) round of ``acc``."""
    for _ in range(count):
        unit_gradient(module, params, lockstep.dummy, 0, token_budget, pad_id)
        acc.end_round()


def add_clipped_unit(
    acc: Accumulator,
    grads: dict[str, torch.Tensor],
    loss_sum: float,
    tokens: int,
    norm: float | None = None,
) -> None:
    """Clip one materialized unit gradient by ``norm`` (default: its exact norm) and add it."""
    if norm is None:
        norm = math.sqrt(squared_norm(list(grads.values())))
    factor = acc.record(norm, loss_sum, tokens)
    if factor is None:
        return
    for name, grad in grads.items():
        acc.add(name, grad, factor)
