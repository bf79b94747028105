"""The ``vectorized`` and ``randomized`` engines' loop over a rank's units: whole units packed
into micro-batches of at most the token budget (:mod:`userdp.clients.batching`), each run as
ONE forward with capture hooks and ONE backward to the recorded layer outputs (steps 1-2 of
:mod:`userdp.clients.ghost`), then clipped and added by :func:`userdp.clients.ghost.clip_and_add`
(steps 3-5). Units over the token budget take the ``loop`` path; under ZeRO-3 the ranks run in
lockstep (:mod:`userdp.clients.zero3`); the first all-finite micro-batch checks the attribution
(:mod:`userdp.clients.attribution`).
"""

from __future__ import annotations

import torch
from torch.profiler import record_function
from userdp.clients.attribution import direct_unit_squared_norms
from userdp.clients.batching import EngineError, MicroBatch, make_batch, pack_units, token_losses
from userdp.clients.capture import GENERIC, Capture, Layout
from userdp.clients.clipping import (
    Accumulator,
    Discard,
    UnitWork,
    add_clipped_unit,
    chunk_passes,
    run_dummy_chunk_passes,
    unit_gradient,
)
from userdp.clients.ghost import CapturedBatch, clip_and_add
from userdp.clients.layer_uses import weight_uses
from userdp.clients.matmul_precision import exact_matmul
from userdp.clients.norms import Padded, Workspace
from userdp.clients.sketch import ProbeSource
from userdp.clients.zero3 import any_partitioned, is_partitioned


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
    :func:`userdp.clients.attribution.verify_attribution`). Returns whether a verification ran
    and passed.
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
    _output_backward(capture, weighted, outputs, layout.positions.device)
    captured = _captured(params, capture, layout, padded, losses)
    with exact_matmul(tensor_cores):
        return clip_and_add(captured, acc, probes, direct, unit_checks, workspace)


def _output_backward(
    capture: Capture, weighted: torch.Tensor, outputs: list, device: torch.device
) -> None:
    """Step 2: ``call.grad`` = the gradient of every recorded output (zeros where the loss does
    not depend on it); weight gradients are not computed."""
    with record_function("userdp.output_backward"):
        grads = torch.autograd.grad(weighted, outputs, allow_unused=True)
    for call, grad in zip(capture.calls, grads, strict=True):
        if grad is None:  # the loss does not depend on this output
            like = call.output_like
            grad = torch.zeros(like.shape, dtype=like.dtype, device=device)
        call.grad = grad
    del grads


def _captured(
    params: dict[str, torch.Tensor],
    capture: Capture,
    layout: Layout,
    padded: Padded,
    losses: torch.Tensor,
) -> CapturedBatch:
    """The captured calls' factors by parameter (:func:`weight_uses`); the calls' own records
    of them are dropped, so that a weight's factors are freed once they are used up."""
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
    return CapturedBatch(params, weights, token_rows, generic, layout, padded, capture, losses)


def vectorized_clipped_sum(
    work: UnitWork,
    probes: ProbeSource | None = None,
    verify: bool = False,
    tensor_cores: bool = False,
) -> bool:
    """Add clip(g_u)·… of ``work.prepared[work.indices]`` to ``work.acc``: exact norms, or
    sketched norms when ``probes`` is given. Units over the token budget run through the loop
    path (chunked, exact norm; for the randomized engine an exact norm means Z = 1, inside the
    accountant's law).

    ``verify``: check the hooks' attribution against one plain batch gradient on the first
    all-finite micro-batch (one extra backward); returns whether that check ran.
    ``tensor_cores``: bf16 GEMMs for the norms and book-keeping (see :func:`_micro_batch`).
    ``work.lockstep`` (ZeRO-3, :mod:`userdp.clients.zero3`): every rank runs as many micro-batch
    passes and chunk passes as the rank with the most, the extra ones on the lockstep's dummy
    unit, and runs the attribution check's backwards on the same passes as the others."""
    module, params, acc, lockstep = work.module, work.params, work.acc, work.lockstep
    token_budget, pad_id = work.token_budget, work.pad_id
    local = [work.prepared[i] for i in work.indices]
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
