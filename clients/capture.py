"""Forward hooks that record, per micro-batch, every call of a module owning a trainable
parameter (its input, and its output whose gradient is requested later), and the token layout
that maps flat positions to units. Used by the vectorized engines (:mod:`userdp.clients.vectorized`).

Kinds: ``linear`` (nn.Linear, incl. peft LoRA factors and untied LM heads), ``conv1d``
(transformers' GPT-2 Conv1D), ``embedding`` (incl. subclasses that scale their output, e.g.
Gemma's ``embed_scale``), ``ln`` (nn.LayerNorm), ``rms`` (the RMSNorm classes of Llama, Mistral,
Qwen2, Gemma, Phi-3, ...: ``y = x̂ ⊙ w`` or ``x̂ ⊙ (1 + w)`` with ``x̂ = x / rms(x)``) and
``generic`` (anything else, re-run per unit on its recorded arguments). A call of the first five
kinds must take exactly one tensor argument laid out [rows, length, …] and return a tensor; a
generic call may take any arguments (tensors whose first dimension is the batch's rows are split
per unit when it is re-run, e.g. OPT's learned position embedding). A call on flattened
[rows·length, …] tokens (OPT's MLP) is recorded as [rows, length, …]. A [1, length, …] call
broadcast over rows (GPT-2's position embedding) is expanded in the hook so that every row gets
its own output gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from userdp.clients.batching import EngineError, MicroBatch

try:
    from transformers.pytorch_utils import Conv1D
except ImportError:  # pragma: no cover - transformers is a dependency of the worker
    Conv1D = ()

LINEAR, CONV1D, EMBEDDING, LAYERNORM, RMSNORM, GENERIC = (
    "linear",
    "conv1d",
    "embedding",
    "ln",
    "rms",
    "generic",
)


def rms_epsilon(module: torch.nn.Module) -> float | None:
    """The epsilon of an RMSNorm layer (``variance_epsilon`` in Llama-style classes, ``eps`` in
    Gemma-style and torch's own), or None when ``module`` is not one with a single weight."""
    if not type(module).__name__.endswith("RMSNorm"):
        return None
    names = [name for name, _ in module.named_parameters(recurse=False)]
    if names != ["weight"] or module.weight.dim() != 1:
        return None
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if eps is None:  # torch.nn.RMSNorm(eps=None) uses the dtype's machine epsilon
        eps = torch.finfo(module.weight.dtype).eps if isinstance(module, torch.nn.RMSNorm) else None
    return None if eps is None else float(eps)


def _kind(module: torch.nn.Module) -> str:
    if isinstance(module, torch.nn.Linear):
        return LINEAR
    if Conv1D and isinstance(module, Conv1D):
        return CONV1D
    if isinstance(module, torch.nn.Embedding):
        overridden = type(module).forward is not torch.nn.Embedding.forward
        if overridden and getattr(module, "embed_scale", None) is None:
            return GENERIC  # e.g. OPT's learned positions: ids computed inside forward
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise EngineError(
                f"{type(module).__name__} with max_norm/scale_grad_by_freq/sparse is not "
                "supported by the vectorized engines; use strategy.engine = 'loop'"
            )
        return EMBEDDING
    if isinstance(module, torch.nn.LayerNorm):
        return LAYERNORM
    if rms_epsilon(module) is not None:
        return RMSNORM
    return GENERIC


@dataclass
class Call:
    """One recorded call of a hooked module."""

    module: torch.nn.Module
    kind: str
    inputs: torch.Tensor | None
    """The call's tensor argument (None for a generic call: see ``args``/``kwargs``)."""
    output: GradientEdge
    """The autograd edge of the call's output: its gradient is requested through the edge, so
    the output itself is not kept alive (autograd frees it once nothing needs it, as in a plain
    backward)."""
    output_like: torch.Tensor
    """The output's shape and dtype (a tensor on the meta device)."""
    grad: torch.Tensor | None = None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    """A generic call's arguments, detached, for re-running it per unit."""


def _call(
    module: torch.nn.Module, kind: str, inputs: torch.Tensor | None, output: torch.Tensor, **kwargs
) -> Call:
    """A :class:`Call` that refers to ``output`` by its autograd edge only."""
    like = torch.empty(output.shape, dtype=output.dtype, device="meta")
    return Call(module, kind, inputs, get_gradient_edge(output), like, **kwargs)


@dataclass
class Capture:
    """Forward hooks on every module that directly owns a trainable parameter."""

    params: dict[str, torch.Tensor]
    rows: int
    length: int = 0
    """Tokens per row; lets a call on flattened [rows·length, …] tokens (OPT's MLP and final
    LayerNorm) be recorded as [rows, length, …]."""
    calls: list[Call] = field(default_factory=list)
    enabled: bool = True
    owners: dict[int, list[tuple[torch.nn.Module, str]]] = field(default_factory=dict)

    def attach(self, root: torch.nn.Module) -> list[torch.utils.hooks.RemovableHandle]:
        names = {id(p): n for n, p in self.params.items()}
        handles = []
        for module in root.modules():
            owned = [
                (local, names[id(p)])
                for local, p in module.named_parameters(recurse=False)
                if id(p) in names
            ]
            if not owned:
                continue
            kind = _kind(module)
            self.owners[id(module)] = owned
            handles.append(module.register_forward_hook(self._hook(kind), with_kwargs=True))
        covered = {name for owned in self.owners.values() for _, name in owned}
        missing = sorted(set(self.params) - covered)
        if missing:  # pragma: no cover - nn.Module parameters always have an owner
            raise EngineError(f"trainable parameters without an owning module: {missing[:3]}")
        return handles

    def _hook(self, kind: str):
        def hook(module, args, kwargs, output):
            if not self.enabled:
                return None
            if not isinstance(output, torch.Tensor):
                raise EngineError(
                    f"{type(module).__name__} returns {type(output).__name__}, not a tensor; "
                    "the vectorized engines need tensor outputs: use engine 'loop'"
                )
            if kind == GENERIC:
                return self._record_generic(module, args, kwargs, output)
            if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
                raise EngineError(
                    f"{type(module).__name__} owns a trainable parameter but is not called with "
                    "exactly one tensor argument; the vectorized engines cannot attribute its "
                    "gradient per unit: use engine 'loop'"
                )
            x = args[0]
            tokens = self.rows * self.length
            if self.length > 1 and x.shape[:1] == (tokens,) and output.shape[:1] == (tokens,):
                # flattened tokens: record [rows, length, ...] views; the caller gets the
                # output back through them, so their gradients are the output's
                x = x.reshape(self.rows, self.length, *x.shape[1:])
                shaped = output.reshape(self.rows, self.length, *output.shape[1:])
                self.calls.append(_call(module, kind, x.detach(), shaped))
                return shaped.reshape(output.shape)
            if x.shape[:1] == (1,) and output.shape[:1] == (1,) and self.rows > 1:
                # broadcast over rows (e.g. GPT-2's position embedding of [1, length] position
                # ids): expand so that each row gets its own output gradient
                x = x.expand(self.rows, *x.shape[1:])
                output = output.expand(self.rows, *output.shape[1:])
            self.calls.append(_call(module, kind, x.detach(), output))
            return output

        return hook

    def _record_generic(self, module, args, kwargs, output):
        if output.shape[:1] == (1,) and self.rows > 1:
            output = output.expand(self.rows, *output.shape[1:])
        if output.shape[:1] != (self.rows,):
            raise EngineError(
                f"{type(module).__name__} output has shape {tuple(output.shape)}, not "
                f"[rows={self.rows}, ...]; the vectorized engines cannot attribute its "
                "gradient per unit: use engine 'loop'"
            )

        def detach(value):
            return value.detach() if isinstance(value, torch.Tensor) else value

        call = _call(
            module,
            GENERIC,
            None,
            output,
            args=tuple(detach(a) for a in args),
            kwargs={k: detach(v) for k, v in kwargs.items()},
        )
        self.calls.append(call)
        return output


@dataclass
class Layout:
    """Token bookkeeping of one micro-batch: flat position -> local unit, per-unit spans."""

    rows: int
    length: int
    unit_rows: list[torch.Tensor]  # per local unit: its row indices (host)
    positions: torch.Tensor  # all real positions, unit by unit
    position_unit: torch.Tensor  # the local unit of each entry of ``positions``
    spans: list[slice]  # per local unit: its entries in ``positions``
    dense: bool = False  # no padding and units in row order: positions = all flat positions

    @classmethod
    def of(cls, batch: MicroBatch) -> Layout:
        """Built on the host from one copy of the batch's row map and mask (no per-unit device
        round trips); the index tensors used on the device are copied there once."""
        rows, length = batch.inputs.shape
        device = batch.inputs.device
        row_unit = batch.row_unit.cpu()
        mask = batch.mask.cpu().reshape(-1)
        flat_unit = row_unit[:, None].expand(rows, length).reshape(-1)
        positions, unit_rows = [], []
        for unit in batch.units:
            positions.append(torch.nonzero((flat_unit == unit) & mask).squeeze(1))
            unit_rows.append(torch.nonzero(row_unit == unit).squeeze(1))
        owner = torch.cat([torch.full((len(p),), j) for j, p in enumerate(positions)])
        spans, start = [], 0
        for p in positions:
            spans.append(slice(start, start + len(p)))
            start += len(p)
        every = torch.cat(positions)
        dense = len(every) == rows * length and torch.equal(every, torch.arange(rows * length))
        return cls(
            rows,
            length,
            unit_rows,
            every.to(device),
            owner.to(device),
            spans,
            dense,
        )

    def real(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        """[real positions (unit by unit), features] of a [rows, length, ...] tensor."""
        flat = self.flat(tensor, what)
        return flat if self.dense else flat[self.positions]

    def flat(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        if tuple(tensor.shape[:2]) != (self.rows, self.length):
            raise EngineError(
                f"{what} has shape {tuple(tensor.shape)}, not [rows={self.rows}, "
                f"length={self.length}, ...]; the vectorized engines need batch-first token "
                "tensors at every layer that owns a trainable parameter: use engine 'loop'"
            )
        return tensor.reshape(self.rows * self.length, -1)
