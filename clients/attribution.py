"""The vectorized engines' per-unit attribution, checked against autograd before it is trusted.

The hooks of :mod:`userdp.clients.vectorized` attribute every parameter's gradient to units from
captured factors. A parameter used outside the module that owns it, or a layer that mixes units'
tokens, would make a unit's clipped update carry another unit's gradient. On the first all-finite
micro-batch the engine therefore compares the attribution with plain autograd: the SUM over units
with the batch gradient (:func:`verify_attribution`), and single units' squared norms with their
own gradients (:func:`verify_unit_norms`, from :func:`direct_unit_squared_norms`). A mismatch
raises :class:`~userdp.clients.batching.EngineError` (use the ``loop`` engine).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from userdp.clients.batching import EngineError, MicroBatch
from userdp.clients.capture import Layout
from userdp.clients.norms import Factor, materialize
from userdp.clients.unit_gradients import UnitGradients
from userdp.clients.zero3 import param_shape

__all__ = ["direct_unit_squared_norms", "verify_attribution", "verify_unit_norms"]


def direct_unit_squared_norms(
    losses_of: Callable[[], torch.Tensor],
    batch: MicroBatch,
    layout: Layout,
    params: dict[str, torch.Tensor],
) -> dict[int, float]:
    """‖∇ loss_u‖² by autograd, for the first and the last unit of the micro-batch alone;
    ``losses_of()`` gives the batch's token losses (the same graph each time, or a fresh
    forward where a graph cannot be differentiated twice, as under ZeRO-3)."""
    out = {}
    # both ends even when they are the same unit: as many backwards whatever the batch, which
    # ZeRO-3's ranks need to stay in step (clients/zero3.py)
    for j in (0, len(layout.unit_rows) - 1):
        losses = losses_of()
        rows = layout.unit_rows[j].to(losses.device)
        loss = (losses[rows] * batch.weights[rows]).sum()
        parts = torch.autograd.grad(
            loss, list(params.values()), retain_graph=True, allow_unused=True
        )
        out[j] = float(sum(p.double().pow(2).sum() for p in parts if p is not None))
    return out


def verify_attribution(
    params: dict[str, torch.Tensor],
    direct: Sequence[torch.Tensor | None],
    weights: dict[str, list[tuple[Factor, torch.Tensor]]],
    per_unit: dict[str, UnitGradients],
) -> None:
    """Σ_u (per-unit gradient as attributed by the hooks) must equal autograd's batch gradient
    for every parameter; otherwise some use of a parameter escaped the hooks (e.g. a weight used
    functionally outside its module) and per-unit norms would be wrong: refuse. ``per_unit``:
    the per-unit gradients the clipped sum is formed from, where it has them."""
    bad = []
    for (name, param), expected in zip(params.items(), direct, strict=True):
        shape = param_shape(param)
        want = torch.zeros(shape) if expected is None else expected.float().cpu()
        if name in per_unit:
            got = per_unit[name].total().reshape(shape).cpu()
        elif name in weights:
            got = materialize(weights[name], shape).cpu()
        else:
            got = torch.zeros(shape)
        tol = 5e-2 if param.dtype in (torch.bfloat16, torch.float16) else 1e-3
        if float((got - want).norm()) > tol * float(want.norm()) + 1e-6:
            bad.append(name)
    if bad:
        raise EngineError(
            f"the vectorized engines cannot attribute the gradients of {bad[:3]} per unit (a "
            "parameter is used outside the module that owns it, or by an unsupported layer): "
            "use strategy.engine = 'loop'"
        )


def verify_unit_norms(
    params: dict[str, torch.Tensor],
    direct: dict[int, float],
    attributed: torch.Tensor,
) -> None:
    """A single unit's squared norm as attributed (ghost/book-keeping, re-runs) must equal
    autograd's for that unit alone. :func:`verify_attribution` checks only the SUM over units,
    which a layer that mixes units' tokens (e.g. a reshape the hooks misread) leaves intact while
    moving one user's gradient into another's clipped vector: refuse that too."""
    low_precision = any(p.dtype in (torch.bfloat16, torch.float16) for p in params.values())
    tol = 5e-2 if low_precision else 1e-3
    for j, want in direct.items():
        got = float(attributed[j])
        if abs(got - want) > tol * max(got, want) + 1e-12:
            raise EngineError(
                f"the vectorized engines attribute a squared norm of {got:.6g} to one unit whose "
                f"own gradient has {want:.6g}: some layer mixes units' tokens in a way the hooks "
                "cannot follow; use strategy.engine = 'loop'"
            )
