"""DP-FedAvg local training (McMahan et al. 2018; strategies/builtins.py ``DpFedAvg``): each unit
runs ``local_steps`` SGD steps from the broadcast model on its own examples, and the quantity
clipped and summed is the model delta Δ_u = θ_broadcast − θ_local (gradient orientation: the
server treats Σ clip(Δ_u, C) exactly like a sum of clipped gradients). One unit still contributes
one vector of norm ≤ C, so the ULS accountant applies unchanged.

Local step s uses the examples batch_s = the next ``local_batch_size`` examples of the unit in
order, cycling (0 = all of them every step); its gradient is that of the MEAN of the batch's
example losses (same loss as :mod:`userdp.clients.batching`), computed in token-budget chunks.
The local parameters are separate tensors bound with ``torch.func.functional_call`` (tied weights
stay tied), so the shared model is never modified and ``.grad`` is never touched.
Norms are exact (no randomized estimate for deltas).
"""

from __future__ import annotations

from typing import Any

import torch
from userdp.clients.batching import EngineError, PreparedUnit
from userdp.clients.clipping import UnitWork, add_clipped_unit, unit_gradient


class _Bound:
    """``module`` called with ``params`` substituted for its trainable parameters."""

    def __init__(self, module: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
        self.module, self.params = module, params

    def __call__(self, **kwargs: Any) -> Any:
        return torch.func.functional_call(self.module, self.params, args=(), kwargs=kwargs)


def local_delta(
    module: torch.nn.Module,
    params: dict[str, torch.Tensor],
    unit: PreparedUnit,
    local_steps: int,
    local_lr: float,
    local_batch_size: int,
    token_budget: int,
    pad_id: int,
) -> tuple[dict[str, torch.Tensor], float, int]:
    """(Δ_u = θ_start − θ_local in float32, token loss sum and tokens of the first local step)."""
    local = {n: p.detach().clone().requires_grad_(True) for n, p in params.items()}
    bound = _Bound(module, local)
    n = len(unit.examples)
    size = n if local_batch_size <= 0 else min(local_batch_size, n)
    first_loss, first_tokens = 0.0, 0
    for step in range(local_steps):
        start = (step * size) % n
        chosen = [unit.examples[(start + i) % n] for i in range(size)]
        batch_unit = PreparedUnit(unit.unit_id, tuple(chosen), 0)
        grads, loss_sum, tokens = unit_gradient(bound, local, [batch_unit], 0, token_budget, pad_id)
        if step == 0:
            first_loss, first_tokens = loss_sum, tokens
        with torch.no_grad():
            for name, tensor in local.items():
                tensor.sub_(grads[name].to(tensor.dtype), alpha=local_lr)
    delta = {
        name: (params[name].detach().float() - local[name].detach().float()) for name in params
    }
    return delta, first_loss, first_tokens


def fedavg_clipped_sum(
    work: UnitWork, *, local_steps: int, local_lr: float, local_batch_size: int
) -> None:
    """Σ_u clip(Δ_u, C) over ``work.prepared[work.indices]`` into ``work.acc`` (non-finite Δ_u →
    zero). ``work.lockstep`` is unused: the engine refuses DP-FedAvg under ZeRO-3."""
    if local_steps < 1 or not local_lr > 0:
        raise EngineError(
            f"local_steps={local_steps}, local_lr={local_lr}: DP-FedAvg needs local_steps >= 1 "
            "and local_lr > 0"
        )
    for index in work.indices:
        unit = work.prepared[index]
        if not unit.examples:
            work.acc.record(0.0, 0.0, 0)
            continue
        delta, loss_sum, tokens = local_delta(
            work.module,
            work.params,
            unit,
            local_steps,
            local_lr,
            local_batch_size,
            work.token_budget,
            work.pad_id,
        )
        add_clipped_unit(work.acc, delta, loss_sum, tokens)
