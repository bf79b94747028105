"""The ``vectorized`` (exact) and ``randomized`` (Hutchinson) engines: per-unit norms of many units
from ONE forward and ONE activation backward, then the clipped sum from retained per-unit
gradients or by book-keeping. :mod:`userdp.clients.vectorized` runs the micro-batches and steps
1-2; this module does steps 3-5 of one micro-batch (:func:`clip_and_add`).

Per micro-batch (rows = examples of whole units, see :mod:`userdp.clients.batching`):

1. Forward with hooks on every module that owns a trainable parameter; each call records its
   input and its output's autograd edge (not the output: autograd frees it when done with it).
2. ``torch.autograd.grad(Σ_u loss_u, output edges)``: the gradient G of every recorded output.
   Weight gradients are NOT computed (they are not requested), nothing touches ``.grad``.
3. Per unit u and parameter, the gradient is a sum over the unit's (real) tokens t of rank-one
   terms. Writing a weight as [dim0, dim1] in its storage layout, every use c of it contributes
   L_c,t R_c,tᵀ:

   =============  ===========================  =====================  ==================
   layer          storage                      L_t (dim0)             R_t (dim1)
   =============  ===========================  =====================  ==================
   Linear         W [out, in], y = x Wᵀ + b    g_t (output grad)      a_t (input)
   Conv1D         W [in, out], y = x W + b     a_t                    g_t
   Embedding      W [V, d],    y = W[x]        onehot(x_t)            g_t
   =============  ===========================  =====================  ==================

   so the unit's gradient is M_u = Σ_c L_cᵀ R_c over the unit's token rows. A TIED weight (GPT-2's
   ``lm_head.weight`` is ``transformer.wte.weight``) is one parameter with two uses; its gradient
   is the SUM of both, so the norm has cross terms and both uses are handled together.

   User-level norm (docs/design.md, "User-level norms"): over ALL the unit's tokens,
       ‖M_u‖²_F = Σ_{c,c'} Σ_{t,s} (L_c,t·L_c',s)(R_c,t·R_c',s)          ("ghost", T_u² terms)
   (onehot·onehot = [x_t = x_s], onehot(x_t)·g_s = g_s[x_t]), or materialize M_u (d0×d1) and
   square it. Per micro-batch and weight:
   - RETAIN: when the units' M_u (U·d0·d1 float32) take at most ``RETAIN_RATIO`` times the
     bytes of the weight's captured rows, materialize them and keep them for step 5, which then
     needs no product of its own: the norm costs the T_u·d0·d1 per unit the clipped sum costs
     anyway. Long users (float32 GPT-2 small: T_u ≥ 307 tokens for the MLP weights) take this
     way (:func:`userdp.clients.unit_gradients.retains_unit_gradients`); on a GPU only where the
     device's measured rates price it no dearer than the book-keeping
     (:mod:`userdp.clients.unit_cost`).
   - otherwise the cheaper of ghost, ≈ T_u²(d0 + d1), and a materialized gradient that is
     squared and discarded, T_u·d0·d1 (onehot uses: T_u·d1). Short examples use the ghost
     identity.

   Biases (Σ_t g_t) and parameters of any other module (LayerNorm, RMSNorm, …: "generic") are
   small: their per-unit gradients are materialized, for generic modules by re-running the
   module on the unit's rows of its recorded input and a vjp with the unit's rows of G.

4. c_u = min(1, C/‖g_u‖) with ‖g_u‖² = Σ over parameters; non-finite → the unit is dropped.
5. The clipped sum over the finite units: Σ_u c_u M_u from the retained M_u (and the small
   parameters' per-unit gradients), and for the other weights by book-keeping (Bu et al. 2023):
   Σ_u c_u M_u = Σ_c L_cᵀ (c_t ⊙ R_c) over the tokens of the finite units (c_t = the token's
   unit factor) — one weight-gradient-sized matmul per use, no second backward. Dropped units
   (and their tokens) are left out, not multiplied by 0, so a NaN there cannot reach the sum.

Randomized (DP-SGD-RC: the Hutchinson estimator of "Efficient DP-SGD for LLMs with Randomized
Clipping"): step 3 for the L/R weights is replaced by a sketch. Per
micro-batch and weight a FRESH P ∈ ℝ^{d0×k}, P_ij ~ N(0, 1/k), is drawn (shared by the units of
the micro-batch, independent of the data); n̂ = ‖M_uᵀ P‖² = ‖Σ_c R_cᵀ (L_c P)‖²_F (tied uses are
summed as sketches before squaring). Its law is Σ_j λ_j χ²_j(k)/k over the squared singular values
λ_j of M_u, independently per weight, and biases/generic parameters add their exact squared
norms (a deterministic term: the limit of many small χ² components). The accountant
(accounting/randomized_clipping.py) bounds Z = ‖g‖/√n̂ by the rank-1 worst case √(k/χ²_k) —
which covers this law: the exact terms only concentrate it further. c_u = min(1, C/√n̂_u).
With the Hutch++ estimator (:mod:`userdp.clients.sketch`) a second fresh S per weight gives each
unit an exact head ‖M_uᵀQ_u‖², Q_u = orth(M_u M_uᵀ S), and P sketches only the residual
(:func:`userdp.clients.norms.batched_hutchpp_squared_norms`); the same accountant covers it.

Requirements on the model (checked; an unsupported model raises EngineError, use ``loop``): every
trainable parameter is used through a hooked module call, and every hooked call takes and
returns tensors laid out [rows, length, …] (batch-first tokens).

The attribution is checked against autograd on the first all-finite micro-batch
(:mod:`userdp.clients.attribution`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.profiler import record_function
from userdp.clients import tensor_core_bound
from userdp.clients.attribution import verify_attribution, verify_unit_norms
from userdp.clients.capture import Capture, Layout
from userdp.clients.clipping import Accumulator
from userdp.clients.layer_uses import generic_unit_grads
from userdp.clients.matmul_precision import tensor_cores_active
from userdp.clients.norms import (
    Factor,
    Padded,
    Workspace,
    batched_exact_squared_norms,
    materialize,
)
from userdp.clients.sketch import ProbeSource, sketched_squared_norms
from userdp.clients.unit_cost import device_rates
from userdp.clients.unit_gradients import (
    ParameterBlock,
    UnitGradients,
    batched_unit_gradients,
    retains_unit_gradients,
)
from userdp.clients.zero3 import param_shape


@dataclass
class CapturedBatch:
    """One micro-batch after its output backward (steps 1-2): the factors of every weight's uses
    (``weights``), the biases' token rows (``token_rows``), the generic calls with the
    parameters they own, the token layout and the token losses. Steps 3-5 consume
    ``token_rows`` and the factors of every weight whose per-unit gradients they retain."""

    params: dict[str, torch.Tensor]
    weights: dict[str, list[tuple[Factor, torch.Tensor]]]
    token_rows: dict[str, list[torch.Tensor]]
    generic: list
    layout: Layout
    padded: Padded
    capture: Capture
    losses: torch.Tensor


@dataclass
class _UnitNorms:
    """Step 3 of a micro-batch: the squared norms each unit is clipped by (``clip_sq``) and the
    ones computed for it (``computed_sq``; the same tensor outside tensor-core mode), [U]
    float64 on the device, and the per-unit gradients retained for step 5 (``retained``; the
    small parameters' also side by side in ``block``)."""

    clip_sq: torch.Tensor
    computed_sq: torch.Tensor
    retained: dict[str, UnitGradients]
    block: ParameterBlock | None


def bound_applies(
    weights: dict[str, list[tuple[Factor, torch.Tensor]]], device: torch.device
) -> bool:
    """Tensor-core mode on a GPU with a bf16 factor (a bf16 model's rows, or autocast's): some
    norm or book-keeping GEMM runs on the tensor cores, and each unit is clipped by the rounding
    bound of :mod:`userdp.clients.tensor_core_bound`. All-float32 factors keep IEEE GEMMs."""
    if not tensor_cores_active(device):
        return False
    return any(
        t is not None and t.dtype == torch.bfloat16
        for uses in weights.values()
        for left, right in uses
        for t in (left.dense, right)
    )


def clip_and_add(
    captured: CapturedBatch,
    acc: Accumulator,
    probes: ProbeSource | None,
    direct: Sequence[torch.Tensor | None] | None,
    unit_checks: dict[int, float] | None = None,
    workspace: Workspace | None = None,
) -> bool:
    """Steps 3-5 of the module docstring for one micro-batch. Per-unit quantities stay on the
    device until one copy to the host (norms and losses), so the GPU is not stalled per weight
    or per unit. Consumes ``token_rows``, and the factors of every weight whose per-unit
    gradients it retains (they leave ``weights``), so that their memory is freed as it goes.
    With ``direct`` (the plain batch gradient), checks the attribution first on an all-finite
    micro-batch and returns whether it did."""
    norms = _unit_norms(captured, probes, workspace)
    factors, computed_sq = _record_units(captured, norms, acc)
    verified = False
    if direct is not None and all(f is not None for f in factors):
        verify_attribution(captured.params, direct, captured.weights, norms.retained)
        verify_unit_norms(captured.params, unit_checks or {}, computed_sq)
        verified = True
    _add_clipped(captured, norms, factors, acc)
    return verified


def _unit_norms(
    captured: CapturedBatch, probes: ProbeSource | None, workspace: Workspace | None
) -> _UnitNorms:
    """Step 3: every unit's squared norm, batched over the units, on the device."""
    params, weights, padded = captured.params, captured.weights, captured.padded
    n_units = len(captured.layout.spans)
    device = captured.layout.positions.device
    # tensor-core mode: each unit is clipped by B_u, a bound on the norm of what it releases
    # (docs/worker.md, "Tensor cores: a proven norm bound")
    bounded = bound_applies(weights, device)
    # squared norms of what is released as computed (everything outside tensor-core mode) or
    # estimated; in tensor-core mode the book-kept weights' norms and bounds go to ``bound_terms``
    sq = torch.zeros(n_units, dtype=torch.float64, device=device)
    bound_terms = tensor_core_bound.BoundTerms(padded) if bounded else None
    # per-unit gradients retained for the clipped sum Σ_u c_u M_u: biases, LayerNorm and generic
    # parameters always, weights where retains_unit_gradients says so (exact norms only)
    retained: dict[str, UnitGradients] = {}
    rates = device_rates(device)  # a GPU's, to choose retained or book-kept by cost
    with record_function("userdp.norms"):
        block = _small_parameter_block(captured)
        if block is not None:
            sq += block.gradients.squared_norms(float64=True)
            retained.update(block.views())
        # weights: exact (retained, ghost or materialized) or sketched, batched over the units
        for name in list(weights):
            shape = param_shape(params[name])
            if probes is not None:  # fresh probes per weight (Hutchinson or Hutch++)
                estimate = sketched_squared_norms(
                    weights[name], probes, padded, shape[0], params[name].device
                ).to(device)
                sq += estimate
                if bounded:  # the release's rounding on top of the estimate
                    bound_terms.add_sketched(weights[name])
            elif retains_unit_gradients(weights[name], padded, shape, rates):
                # the weight's factors leave ``weights`` and are freed: from here on its
                # per-unit gradients stand for them
                retained[name] = batched_unit_gradients(weights.pop(name), padded, shape)
                sq += retained[name].squared_norms(float64=bounded).to(device)
            elif bounded:  # the bound's terms, combined for all weights below
                bound_terms.add_exact(weights[name], shape)
            else:
                sq += batched_exact_squared_norms(weights[name], padded, shape, workspace).to(
                    device
                )
        clip_sq, computed_sq = sq, sq
        if bounded:
            bounds = bound_terms.finish()
            clip_sq = tensor_core_bound.clip_squared_norms(sq, bounds, n_units)
            computed_sq = sq + bounds.booked
    return _UnitNorms(clip_sq, computed_sq, retained, block)


def _small_parameter_block(captured: CapturedBatch) -> ParameterBlock | None:
    """The per-unit gradients of the biases and the generic modules' parameters, side by side:
    one norm, and later one weighted sum over units, for all of them. Consumes ``token_rows``."""
    small: dict[str, torch.Tensor] = {}
    for name, parts in captured.token_rows.items():
        rows = parts[0]
        for part in parts[1:]:
            rows = rows.to(torch.float32) + part.to(torch.float32)
        # per-unit sums over each unit's own slots (not a matmul with an assignment matrix:
        # 0·NaN from a non-finite unit's rows would reach every other unit), in float32
        small[name] = captured.padded.rows(rows, keep_bf16=True).sum(1, dtype=torch.float32)
    captured.token_rows.clear()  # the rows (an output gradient, for a bias) are used up
    for call, owned in captured.generic:
        unit_grads = generic_unit_grads(call, owned, captured.layout, captured.capture)
        for name, per_unit in unit_grads.items():
            small[name] = small[name] + per_unit if name in small else per_unit
    block = ParameterBlock.of(small)
    small.clear()  # the block holds them now
    return block


def _record_units(
    captured: CapturedBatch, norms: _UnitNorms, acc: Accumulator
) -> tuple[list[float | None], torch.Tensor]:
    """Step 4: every unit's clip factor (None: not finite, dropped) and statistics into ``acc``,
    from ONE device-to-host copy of the per-unit norms and losses; also the computed squared
    norms, on the host."""
    layout = captured.layout
    n_units = len(layout.spans)
    device = layout.positions.device
    token_loss = captured.losses.detach().reshape(-1)[layout.positions].double()
    unit_loss = torch.zeros(n_units, dtype=torch.float64, device=device)
    unit_loss.index_add_(0, layout.position_unit, token_loss)
    host = torch.stack([norms.clip_sq, unit_loss, norms.computed_sq]).cpu()
    factors: list[float | None] = []
    for j, span in enumerate(layout.spans):
        squared = float(host[0, j])
        norm = math.sqrt(squared) if math.isfinite(squared) else float("nan")
        factors.append(acc.record(norm, float(host[1, j]), span.stop - span.start))
    return factors, host[2]


def _add_clipped(
    captured: CapturedBatch, norms: _UnitNorms, factors: list[float | None], acc: Accumulator
) -> None:
    """Step 5: Σ_u c_u M_u over the finite units into ``acc``, one add per parameter, in the
    parameters' order (under ZeRO-3 each add is a collective: clients/sharded_sums.py)."""
    params, weights, layout = captured.params, captured.weights, captured.layout
    block, retained = norms.block, norms.retained
    kept = [j for j, f in enumerate(factors) if f is not None]
    if not kept:
        return
    device = layout.positions.device
    unit_factor = torch.tensor(
        [f if f is not None else 0.0 for f in factors], dtype=torch.float32, device=device
    )
    keep: torch.Tensor | slice = slice(None)
    if len(kept) < len(layout.spans):  # drop the tokens of non-finite units before any product
        keep = torch.cat([torch.arange(layout.spans[j].start, layout.spans[j].stop) for j in kept])
        keep = keep.to(device)
    token_factor = unit_factor[layout.position_unit][keep][:, None]
    with record_function("userdp.bookkeeping"):
        # the small parameters: one weighted sum over units for all of them, held by the
        # accumulator until it is read, or added parameter by parameter below
        block_sum, in_block = None, set() if block is None else set(block.slices)
        if block is not None and acc.defers_block_sums:
            acc.add_block(block, unit_factor, kept)
        elif block is not None:
            block_sum = block.gradients.clipped_sum(unit_factor, kept)
        for name in params:
            shape, total = param_shape(params[name]), None
            if name in weights:
                # book-keeping: Σ_u c_u M_u = Σ_c L_cᵀ (c_t ⊙ R_c) over the finite units' tokens
                uses = weights[name]
                kept_uses = [(f.select(keep), r[keep]) for f, r in uses]
                total = materialize(kept_uses, shape, token_factor)  # R·c in float32
            if name in in_block:
                if block_sum is not None:
                    part = block_sum[block.slices[name]].reshape(shape)
                    total = part if total is None else total + part
            elif name in retained:  # retained per-unit gradients: Σ_u c_u M_u, finite units
                if total is None:  # written into the sums by one GEMM where it can be
                    acc.add_unit_sum(name, retained[name], unit_factor, kept)
                    continue
                total = total + retained[name].clipped_sum(unit_factor, kept).reshape(shape)
            if total is not None:  # one add per parameter and pass
                acc.add(name, total)
