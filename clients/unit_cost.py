"""What a weight's exact per-unit norms and clipped sum cost on the device in use, so that the
vectorized engine chooses between RETAINED per-unit gradients and BOOK-KEEPING by cost.

For a weight of shape [d0, d1] with uses (L_c, R_c) over a micro-batch of U units padded to T
slots each (N = U·T rows), the two exact paths (:mod:`userdp.clients.ghost`, steps 3-5) do:

- **retained**: M_u = Σ_c L_cᵀ R_c formed per unit (a dense use: T·d0·d1 multiply-adds per unit,
  a onehot use: T·d1 added rows), ‖M_u‖² read from it and Σ_u c_u M_u formed from it: U·d0·d1
  float32 written once and read twice (12 bytes per element).
- **book-kept**: the norms as :func:`userdp.clients.norms.exact_norm_plan` takes them, ghost
  (per unit, the Grams L_c L_c'ᵀ and R_c R_c'ᵀ of every pair of uses: T²·(d0 + d1)
  multiply-adds, T² float32 written and read) or materialized and discarded (the retained
  path's product, U·d0·d1 written and read once), then the book-keeping product
  Σ_c L_cᵀ (c_t ⊙ R_c) over the N rows: one GEMM per part of c_t ⊙ R_c (two bf16 parts on the
  tensor cores, ``split_bf16``; one float32 GEMM otherwise), after passes over the N·d1 rows
  that scale and split them.

Seconds = GEMM FLOPs / the device's GEMM rate + bytes / its memory rate (:class:`DeviceRates`,
measured once per device by :func:`device_rates`). A first-order model: it leaves out launches
(the same few per weight on both paths) and what both paths share (the rows' capture and the
clip factors). Retaining is also capped by memory (:func:`userdp.clients.unit_gradients.retains_unit_gradients`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from userdp.clients.matmul_precision import bf16_rows, exact_matmul
from userdp.clients.norms import Factor, Padded, exact_norm_plan


@dataclass(frozen=True)
class DeviceRates:
    """A device's rates for the cost model: FLOP/s of bf16 GEMMs with float32 accumulation (the
    tensor cores on a GPU), of IEEE float32 GEMMs, and bytes/s of elementwise kernels."""

    bf16_flops: float
    float32_flops: float
    memory_bytes: float


def _seconds(run, repeats: int) -> float:
    """GPU seconds per call of ``run``, the median of ``repeats`` single calls (CUDA events)
    after two warm-ups: a busy or still-clocking-up device moves it less than a mean."""
    run()
    run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


@functools.cache
def _measured(device_index: int) -> DeviceRates:
    device = torch.device("cuda", device_index)
    side, repeats = 4096, 9
    flops = 2.0 * side**3
    with torch.cuda.device(device):
        # filled without the global generator: measuring must not move the caller's draws
        generator = torch.Generator(device).manual_seed(0)
        a = torch.empty(side, side, device=device).normal_(generator=generator)
        a16 = a.to(torch.bfloat16)
        # as the engine runs its GEMMs: IEEE float32, and bf16 without reduced-precision sums
        with exact_matmul(tensor_cores=True):
            bf16 = flops / _seconds(lambda: torch.mm(a16, a16), repeats)
        with exact_matmul():
            float32 = flops / _seconds(lambda: torch.mm(a, a), repeats)
        source = torch.zeros(32 << 20, device=device)  # 128 MiB, past the caches
        target = torch.empty_like(source)
        moved = 2.0 * source.numel() * 4
        memory = moved / _seconds(lambda: target.copy_(source), repeats)
    return DeviceRates(bf16, float32, memory)


def device_rates(device: torch.device) -> DeviceRates | None:
    """The rates of a CUDA device, measured the first time it is asked for (medians of a few
    large GEMMs and copies, milliseconds, with about 0.4 GB of temporary buffers: the engine
    asks when it is built, before any activation); None on a CPU, where the memory cap alone decides (the retained
    path was measured faster there wherever the cap allows it: docs/worker.md)."""
    if device.type != "cuda":
        return None
    return _measured(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class PathCosts:
    """Seconds of one weight's two exact paths in one micro-batch (module docstring)."""

    retained: float
    book_kept: float


def path_costs(
    uses: Sequence[tuple[Factor, torch.Tensor]],
    padded: Padded,
    shape: tuple[int, int],
    rates: DeviceRates,
    bf16_parts: bool | None = None,
) -> PathCosts:
    """The two paths' seconds for a weight of ``shape`` whose ``uses`` are captured over the
    units of ``padded``: on the tensor cores where every factor is bf16 in tensor-core mode
    (book-keeping in two parts), else as IEEE float32 GEMMs; the book-kept path's norms ghost
    or materialized as :func:`userdp.clients.norms.exact_norm_plan` chooses. ``bf16_parts``
    says which GEMMs run instead of the factors (for pricing a GPU's choice on a CPU)."""
    d0, d1 = shape
    n_units, width = padded.index.shape
    slots, rows = n_units * width, padded.n
    if bf16_parts is None:
        bf16_parts = bf16_rows(uses)
    ghost = exact_norm_plan(uses, padded, shape)[0]
    gemm = rates.bf16_flops if bf16_parts else rates.float32_flops
    onehot = [left.dense is None for left, _ in uses]
    # per-unit products: dense uses are GEMMs, onehot uses add rows (float32 read and written)
    product_flops = sum(0 if o else 2.0 * slots * d0 * d1 for o in onehot)
    product_bytes = sum(8.0 * slots * d1 if o else 0.0 for o in onehot)
    per_unit_bytes = 4.0 * n_units * d0 * d1
    retained = product_flops / gemm + (product_bytes + 3 * per_unit_bytes) / rates.memory_bytes
    if ghost:
        pairs = [(a, b) for i, a in enumerate(onehot) for b in onehot[: i + 1]]
        gram = sum(2.0 * n_units * width**2 * ((1 if a and b else d0) + d1) for a, b in pairs)
        norm = gram / gemm + 16.0 * n_units * width**2 * len(pairs) / rates.memory_bytes
    else:
        norm = product_flops / gemm + (product_bytes + 2 * per_unit_bytes) / rates.memory_bytes
    parts = 2 if bf16_parts else 1
    # book-keeping over the N rows: scale (and split) them, then one GEMM per part for a dense
    # use; a onehot use adds its scaled rows into d0 rows. Bytes per row element: the scaled
    # rows read and written in float32, or the bf16 rows read twice, both parts written and the
    # first read (split_bf16)
    share = rows / max(slots, 1)
    book_flops = parts * product_flops * share
    per_element = 10.0 if bf16_parts else 8.0
    book_bytes = per_element * rows * d1 * len(uses) + product_bytes * share
    book_kept = norm + book_flops / gemm + book_bytes / rates.memory_bytes
    return PathCosts(retained, book_kept)
