"""From a micro-batch's recorded layer calls to what the vectorized engines compute with: per
weight, its uses as (L factor, R rows) pairs; per small parameter (bias, LayerNorm, RMSNorm), its
per-position gradient rows; per generic module, its per-unit gradients by re-running it
(:mod:`userdp.clients.ghost` explains the algebra)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from userdp.clients.capture import (
    EMBEDDING,
    GENERIC,
    LAYERNORM,
    LINEAR,
    RMSNORM,
    Call,
    Capture,
    Layout,
    rms_epsilon,
)
from userdp.clients.norms import Factor


def weight_uses(calls: Sequence[Call], layout: Layout, params: dict[str, torch.Tensor]):
    """Per weight name: [(L factor, R rows)]; per small parameter (bias, LayerNorm): gradient
    rows [positions, numel]; rows are the real positions, unit by unit (``layout.positions``).
    Generic calls: [(call, owned names)]."""
    weights: dict[str, list[tuple[Factor, torch.Tensor]]] = {}
    token_rows: dict[str, list[torch.Tensor]] = {}
    generic: list[tuple[Call, list[tuple[str, str]]]] = []
    names = {id(p): n for n, p in params.items()}
    for call in calls:
        module = call.module
        grad = call.grad
        owned = [
            (local, names[id(p)])
            for local, p in module.named_parameters(recurse=False)
            if id(p) in names
        ]
        if call.kind == GENERIC:
            generic.append((call, owned))
            continue
        g = layout.real(grad, f"{type(module).__name__} output")
        if call.kind == LAYERNORM:  # y = x̂ ⊙ w + b: ∂w = g ⊙ x̂, ∂b = g per position
            normalized = torch.nn.functional.layer_norm(
                call.inputs, module.normalized_shape, eps=module.eps
            )
            per_position = {"weight": g * layout.real(normalized, "LayerNorm input"), "bias": g}
            for local, name in owned:
                token_rows.setdefault(name, []).append(per_position[local])
            continue
        if call.kind == RMSNORM:  # y = x̂ ⊙ w (or x̂ ⊙ (1 + w)): ∂w = g ⊙ x̂ per position
            for _, name in owned:
                token_rows.setdefault(name, []).append(rms_weight_rows(call, layout))
            continue
        for local, name in owned:
            if local == "bias":
                token_rows.setdefault(name, []).append(g)
                continue
            if call.kind == EMBEDDING:
                ids = call.inputs
                if tuple(ids.shape) != (layout.rows, layout.length):
                    layout.flat(ids, "Embedding input")
                index = ids.reshape(-1)[layout.positions]
                g_used = g
                scale = getattr(module, "embed_scale", None)
                if scale is not None:  # y = E[ids] · scale (Gemma): ∂E = g · scale
                    g_used = g * torch.as_tensor(scale, dtype=g.dtype, device=g.device)
                if module.padding_idx is not None:  # no gradient flows to the padding row
                    g_used = g_used * (index != module.padding_idx)[:, None].to(g.dtype)
                use = (Factor(None, index, module.num_embeddings), g_used)
            else:
                a = layout.real(call.inputs, f"{type(module).__name__} input")
                if call.kind == LINEAR:
                    use = (Factor(g, None, g.shape[1]), a)
                else:  # Conv1D
                    use = (Factor(a, None, a.shape[1]), g)
            weights.setdefault(name, []).append(use)
    return weights, token_rows, generic


def rms_weight_rows(call: Call, layout: Layout) -> torch.Tensor:
    """Per real position, ∂w = g ⊙ x̂ of an RMSNorm call, x̂ = x · rsqrt(mean(x²) + ε) computed
    in float32 and cast back to the input's dtype as transformers' RMSNorms do; dimensions
    between [rows, length] and the normalized one (per-head norms) are summed."""
    x = call.inputs
    x32 = x.to(torch.float32)
    scale = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + rms_epsilon(call.module))
    normalized = torch.mul(x32, scale, out=torch.empty_like(x))  # rounded to x's dtype
    # promoted: the product in float32 (float64 inputs, the tests' references, cast back)
    per_element = (call.grad.to(torch.float32) * normalized).to(torch.float32)
    if per_element.dim() > 3:
        per_element = per_element.sum(dim=tuple(range(2, per_element.dim() - 1)))
    return layout.real(per_element, f"{type(call.module).__name__} input")


def generic_unit_grads(
    call: Call, owned: list[tuple[str, str]], layout: Layout, capture: Capture
) -> dict[str, torch.Tensor]:
    """Per-unit gradients [U, numel] of a generic module's own parameters: the module is re-run
    on each unit's rows of its recorded input and differentiated against those rows of G."""
    local = dict(call.module.named_parameters(recurse=False))
    tensors = [local[name] for name, _ in owned]
    out: dict[str, list[torch.Tensor]] = {global_name: [] for _, global_name in owned}

    def unit_part(value, rows):  # a unit's rows of a batch-first tensor argument
        batch_first = (
            isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == layout.rows
        )
        return value[rows] if batch_first else value

    capture.enabled = False
    try:
        for rows in layout.unit_rows:
            args = [unit_part(a, rows) for a in call.args]
            kwargs = {k: unit_part(v, rows) for k, v in call.kwargs.items()}
            with torch.enable_grad():
                y = call.module(*args, **kwargs)
                g = call.grad[rows]
                if y.shape[:1] == (1,) and g.shape[:1] != (1,):  # shared over the unit's rows
                    g = g.sum(0, keepdim=True)
                parts = torch.autograd.grad(
                    y, tensors, grad_outputs=g.to(y.dtype), allow_unused=True
                )
            for (_, global_name), part, tensor in zip(owned, parts, tensors, strict=True):
                zero = torch.zeros(tensor.numel(), dtype=torch.float32, device=tensor.device)
                out[global_name].append(zero if part is None else part.reshape(-1).float())
    finally:
        capture.enabled = True
    return {name: torch.stack(rows) for name, rows in out.items()}
