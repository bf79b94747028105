"""The ``vectorized`` (exact) and ``randomized`` (Hutchinson) engines: per-unit norms of many units
from ONE forward and ONE activation backward, then the clipped sum from retained per-unit
gradients or by book-keeping.

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

import torch
from torch.profiler import record_function
from userdp.clients import tensor_core_bound
from userdp.clients.attribution import (
    direct_unit_squared_norms,
    verify_attribution,
    verify_unit_norms,
)
from userdp.clients.batching import (
    EngineError,
    MicroBatch,
    PreparedUnit,
    make_batch,
    pack_units,
    token_losses,
)
from userdp.clients.capture import GENERIC, Capture, Layout
from userdp.clients.clipping import (
    Accumulator,
    Discard,
    add_clipped_unit,
    chunk_passes,
    run_dummy_chunk_passes,
    unit_gradient,
)
from userdp.clients.layer_uses import generic_unit_grads, weight_uses
from userdp.clients.matmul_precision import exact_matmul, tensor_cores_active
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
from userdp.clients.zero3 import (
    Lockstep,
    any_partitioned,
    is_partitioned,
    param_shape,
)


def _micro_batch(
    module: torch.nn.Module,
    params: dict[str, torch.Tensor],
    batch: MicroBatch,
    acc: Accumulator,
    probes: ProbeSource | None,
    verify: bool = False,
    tensor_cores: bool = False,
    workspace: Workspace | None = None,
) -> bool:
    """Process one micro-batch into ``acc``; with ``verify``, first check the attribution (see
    :func:`verify_attribution`). Returns whether a verification ran and passed.
    ``tensor_cores``: bf16 GEMMs for the norms and book-keeping
    (:mod:`userdp.clients.matmul_precision`), each unit clipped by a proven bound on what it
    releases (:mod:`userdp.clients.tensor_core_bound`). ``workspace``: the buffer for
    materialized per-unit gradients whose only use is their norm, reused across micro-batches."""
    # the token layout first: its host work and index copies then wait for nothing on the device
    layout = Layout.of(batch)
    padded = Padded.of(layout.spans, len(layout.positions), layout.positions.device)
    direct = None
    unit_checks: dict[int, float] = {}
    fresh = verify and any_partitioned(params)
    if fresh:  # ZeRO-3 releases gathered weights after a backward: one forward per backward
        direct = torch.autograd.grad(
            (token_losses(module, batch) * batch.weights).sum(),
            list(params.values()),
            allow_unused=True,
        )
        if probes is None:
            unit_checks = direct_unit_squared_norms(
                lambda: token_losses(module, batch), batch, layout, params
            )
    capture = Capture(params, *map(int, batch.inputs.shape[:2]))
    handles = capture.attach(module)
    try:
        with record_function("userdp.forward"):
            losses = token_losses(module, batch)
    finally:
        for handle in handles:
            handle.remove()
    weighted = (losses * batch.weights).sum()
    outputs = [call.output for call in capture.calls]
    if verify and not fresh:
        direct = torch.autograd.grad(
            weighted, list(params.values()), retain_graph=True, allow_unused=True
        )
        if probes is None:  # exact norms: check single units too (see verify_attribution)
            unit_checks = direct_unit_squared_norms(lambda: losses, batch, layout, params)
    with record_function("userdp.output_backward"):
        grads = torch.autograd.grad(weighted, outputs, allow_unused=True)
    for call, grad in zip(capture.calls, grads, strict=True):
        if grad is None:  # the loss does not depend on this output
            like = call.output_like
            grad = torch.zeros(like.shape, dtype=like.dtype, device=layout.positions.device)
        call.grad = grad
    del grads
    weights, token_rows, generic = weight_uses(capture.calls, layout, params)
    partitioned = [
        name for _, owned in generic for _, name in owned if is_partitioned(params[name])
    ]
    if partitioned:  # a re-run per unit would gather its parameters a data-dependent number of
        # times, and ZeRO-3's gathers must be the same on every rank (clients/zero3.py)
        raise EngineError(
            f"the vectorized engines re-run {partitioned[0]!r}'s module once per unit, which "
            "ZeRO-3 cannot do in step across ranks: use strategy.engine = 'loop' or "
            "model.zero_stage <= 2 for this model"
        )
    # from here on the factors live in ``weights`` and ``token_rows`` only (generic calls are
    # re-run from their own records), so a weight's factors are freed once they are used up
    for call in capture.calls:
        if call.kind != GENERIC:
            call.inputs = call.grad = None
    with exact_matmul(tensor_cores):
        return _clip_and_add(
            params,
            weights,
            token_rows,
            generic,
            layout,
            padded,
            capture,
            losses,
            acc,
            probes,
            direct,
            unit_checks,
            workspace,
        )


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


def _clip_and_add(
    params: dict[str, torch.Tensor],
    weights: dict[str, list[tuple[Factor, torch.Tensor]]],
    token_rows: dict[str, list[torch.Tensor]],
    generic: list,
    layout: Layout,
    padded: Padded,
    capture: Capture,
    losses: torch.Tensor,
    acc: Accumulator,
    probes: ProbeSource | None,
    direct: Sequence[torch.Tensor | None] | None,
    unit_checks: dict[int, float] | None = None,
    workspace: Workspace | None = None,
) -> bool:
    """Steps 3-5 of the module docstring for one micro-batch. Per-unit quantities stay on the
    device until one copy to the host (norms and losses), so the GPU is not stalled per weight
    or per unit. Consumes ``token_rows``, and the factors of every weight whose per-unit
    gradients it retains (they leave ``weights``), so that their memory is freed as it goes."""
    n_units = len(layout.spans)
    device = layout.positions.device
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
        small: dict[str, torch.Tensor] = {}
        for name, parts in token_rows.items():
            rows = parts[0]
            for part in parts[1:]:
                rows = rows.to(torch.float32) + part.to(torch.float32)
            # per-unit sums over each unit's own slots (not a matmul with an assignment matrix:
            # 0·NaN from a non-finite unit's rows would reach every other unit), in float32
            small[name] = padded.rows(rows, keep_bf16=True).sum(1, dtype=torch.float32)
        token_rows.clear()  # the rows (an output gradient, for a bias) are used up
        for call, owned in generic:
            for name, per_unit in generic_unit_grads(call, owned, layout, capture).items():
                small[name] = small[name] + per_unit if name in small else per_unit
        # side by side: one norm, and later one weighted sum over units, for all of them
        block = ParameterBlock.of(small)
        small.clear()  # the block holds them now
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
    # clip factors, statistics: one device-to-host copy of the per-unit norms and losses
    token_loss = losses.detach().reshape(-1)[layout.positions].double()
    unit_loss = torch.zeros(n_units, dtype=torch.float64, device=device)
    unit_loss.index_add_(0, layout.position_unit, token_loss)
    host = torch.stack([clip_sq, unit_loss, computed_sq]).cpu()
    factors: list[float | None] = []
    for j, span in enumerate(layout.spans):
        squared = float(host[0, j])
        norm = math.sqrt(squared) if math.isfinite(squared) else float("nan")
        factors.append(acc.record(norm, float(host[1, j]), span.stop - span.start))
    verified = False
    if direct is not None and all(f is not None for f in factors):
        verify_attribution(params, direct, weights, retained)
        verify_unit_norms(params, unit_checks or {}, host[2])
        verified = True
    kept = [j for j, f in enumerate(factors) if f is not None]
    if not kept:
        return verified
    unit_factor = torch.tensor(
        [f if f is not None else 0.0 for f in factors], dtype=torch.float32, device=device
    )
    keep: torch.Tensor | slice = slice(None)
    if len(kept) < n_units:  # drop the tokens of non-finite units before any product
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
        # in the parameters' order: under ZeRO-3 each add is a collective (clients/sharded_sums.py)
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
    return verified


def vectorized_clipped_sum(
    module: torch.nn.Module,
    params: dict[str, torch.Tensor],
    prepared: Sequence[PreparedUnit],
    indices: Sequence[int],
    acc: Accumulator,
    token_budget: int,
    pad_id: int,
    probes: ProbeSource | None = None,
    verify: bool = False,
    tensor_cores: bool = False,
    lockstep: Lockstep | None = None,
) -> bool:
    """Add clip(g_u)·… of ``prepared[indices]`` to ``acc``: exact norms, or sketched norms when
    ``probes`` is given. Units over the token budget run through the loop path (chunked, exact
    norm; for the randomized engine an exact norm means Z = 1, inside the accountant's law).

    ``verify``: check the hooks' attribution against one plain batch gradient on the first
    all-finite micro-batch (one extra backward); returns whether that check ran.
    ``lockstep`` (ZeRO-3, :mod:`userdp.clients.zero3`): every rank runs as many micro-batch
    passes and chunk passes as the rank with the most, the extra ones on the lockstep's dummy
    unit, and runs the attribution check's backwards on the same passes as the others."""
    local = [prepared[i] for i in indices]
    batches, oversized = pack_units(local, token_budget)
    verified = False
    device = next(iter(params.values())).device
    workspace = Workspace()  # per-unit gradient chunks, reused by every weight and micro-batch
    for unit in local:
        if not unit.examples:
            acc.record(0.0, 0.0, 0)
    chunks = sum(chunk_passes(local[j], token_budget) for j in oversized)
    passes, all_chunks = len(batches), chunks
    if lockstep is not None:
        passes, all_chunks = lockstep.most([len(batches), chunks])
    check = verify
    for i in range(passes):
        if lockstep is not None and check:  # while any rank still has to check, all do
            check = lockstep.any(verify)
        real = i < len(batches)
        if real:
            batch, target = make_batch(local, batches[i], device, pad_id), acc
        else:  # lockstep only: a dummy pass, its sums thrown away
            batch = make_batch(lockstep.dummy, [0], device, pad_id)
            target = Discard(params, 1.0)
        if real and i == len(batches) - 1 and not oversized:
            acc.last_pass()  # nothing is added after this micro-batch
        run_check = check if lockstep is not None else verify
        passed = _micro_batch(
            module, params, batch, target, probes, run_check, tensor_cores, workspace
        )
        acc.end_round()
        if passed and real:  # a one-unit dummy cannot show units' tokens mixing
            verify = False
            verified = True
    for j in oversized:
        grads, loss_sum, tokens = unit_gradient(
            module, params, local, j, token_budget, pad_id, acc.end_round
        )
        add_clipped_unit(acc, grads, loss_sum, tokens)
        acc.end_round()
    if lockstep is not None:
        extra = all_chunks - chunks
        run_dummy_chunk_passes(module, params, lockstep, extra, token_budget, pad_id, acc)
    return verified
