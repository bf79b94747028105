"""Per-unit gradients RETAINED for the clipped sum: where a weight's U per-unit gradients M_u are
small next to its captured rows (long users), the exact engine materializes them once, takes each
unit's norm from them and forms Σ_u c_u M_u from the same tensors, instead of a norm pass plus the
book-keeping product (derivation in :mod:`userdp.clients.ghost`, step 3)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from userdp.clients.norms import (
    Factor,
    Padded,
    padded_factors,
    padded_unit_gradients,
    sum_terms,
    unit_squared_norms,
)
from userdp.clients.unit_cost import DeviceRates, path_costs

RETAIN_RATIO = 2.0
"""A weight's per-unit gradients [U, d0, d1] (float32) are retained for the clipped sum when they
take at most this many times the bytes of its captured rows (:func:`retains_unit_gradients`)."""


def retains_unit_gradients(
    uses: Sequence[tuple[Factor, torch.Tensor]],
    padded: Padded,
    shape: torch.Size,
    rates: DeviceRates | None = None,
) -> bool:
    """Whether the exact engine materializes this weight's per-unit gradients M_u and RETAINS
    them: the clipped sum is then Σ_u c_u M_u (U·d0·d1 multiply-adds) instead of the book-keeping
    product Σ_c L_cᵀ (c_t ⊙ R_c) (N·d0·d1, a weight-gradient pass), so the norm costs the one
    product the clipped sum needs anyway (N·d0·d1), where the ghost norm adds T_u²(d0 + d1) per
    unit to the book-keeping and a discarded materialization adds N·d0·d1. The price is memory:
    the U gradients live until every weight's norm is known.

    Two conditions. Memory, everywhere: their float32 bytes are at most ``RETAIN_RATIO`` times
    those of the weight's captured rows (N rows of L and R; an onehot L is one index per row),
    i.e. in a float32 model for units of d0·d1 / (RETAIN_RATIO·(d0 + d1)) tokens or more (GPT-2
    small's 768×3072 MLP weight: 307), in a bf16 model from twice that. That memory is thus
    bounded by the token budget like the rows, and the engine frees a weight's rows once its
    gradients are materialized. Cost, on a device whose ``rates`` are given (a GPU,
    :func:`userdp.clients.unit_cost.device_rates`): the retained path is not the dearer of the
    two there (:func:`userdp.clients.unit_cost.path_costs`), where reading and writing U·d0·d1
    float32 three times can cost more than the tensor cores' book-keeping."""
    n_units = padded.index.shape[0]
    d0, d1 = shape
    row_bytes = 0
    for left, right in uses:
        row_bytes += d1 * right.element_size()
        row_bytes += (
            left.index.element_size() if left.dense is None else d0 * left.dense.element_size()
        )
    if n_units * d0 * d1 * 4 > RETAIN_RATIO * padded.n * row_bytes:
        return False
    if rates is None:
        return True
    costs = path_costs(uses, padded, (d0, d1), rates)
    return costs.retained <= costs.book_kept


RETAINED_CHUNK_ELEMENTS = (16 << 20) // 4
"""On CPU, float32 elements per chunk of retained per-unit gradients (one unit at least): 16 MiB,
half glibc's largest mmap threshold, so that glibc can serve a chunk from heap memory the
backward and the used-up factors freed rather than from a fresh mapping, which the kernel
zero-fills page by page (0.5 s per GB on a 2-core VM). On a GPU the units of a weight form one
chunk."""


@dataclass(frozen=True)
class UnitGradients:
    """Per-unit gradients of one parameter, as [u, numel] float32 chunks of consecutive units."""

    chunks: tuple[torch.Tensor, ...]

    def squared_norms(self, float64: bool = False) -> torch.Tensor:
        """[U] float64 of ‖M_u‖² (float32 accumulation, or float64 with ``float64``)."""
        norms = [unit_squared_norms(c, float64) for c in self.chunks]
        return norms[0] if len(norms) == 1 else torch.cat(norms)

    def total(self) -> torch.Tensor:
        """[numel]: Σ_u M_u over all units."""
        return sum_terms(c.sum(0) for c in self.chunks)

    def clipped_sum(
        self,
        factors: torch.Tensor,
        finite: Sequence[int],
        out: torch.Tensor | None = None,
        accumulate: bool = False,
    ) -> torch.Tensor:
        """[numel]: Σ_u c_u M_u over the units in ``finite``, c = ``factors`` [U] float32; the
        other units are left out, not multiplied by 0 (0·NaN = NaN). With ``out`` (a contiguous
        float32 tensor of numel elements on the chunks' device) the GEMMs write the sum into it,
        or add it to what it holds with ``accumulate``: no separate add pass."""
        total = None if out is None else out.view(1, -1)
        written, start = accumulate, 0
        for chunk in self.chunks:
            stop = start + chunk.shape[0]
            rows = [j - start for j in finite if start <= j < stop]
            if rows:
                weights = factors[start:stop]
                if len(rows) < chunk.shape[0]:
                    index = torch.tensor(rows, device=chunk.device)
                    chunk, weights = chunk[index], weights[index]
                if written:
                    total.addmm_(weights[None], chunk)
                elif total is None:
                    total = torch.mm(weights[None], chunk)
                else:
                    torch.mm(weights[None], chunk, out=total)
                written = True
            start = stop
        if not written:
            raise ValueError("no unit to sum")
        return total.view(-1)


@dataclass(frozen=True)
class ParameterBlock:
    """Small parameters' per-unit gradients side by side, [U, Σ numel] float32 (biases, norms'
    weights, generic parameters): one norm and one weighted sum over units for all of them
    instead of a few kernels per parameter."""

    gradients: UnitGradients
    slices: dict[str, slice]

    @classmethod
    def of(cls, per_unit: dict[str, torch.Tensor]) -> ParameterBlock | None:
        """The block of ``per_unit`` ([U, numel] each, in order), or None when it is empty."""
        if not per_unit:
            return None
        slices, start = {}, 0
        for name, gradients in per_unit.items():
            slices[name] = slice(start, start + gradients.shape[1])
            start += gradients.shape[1]
        return cls(UnitGradients((torch.cat(list(per_unit.values()), dim=1),)), slices)

    def views(self) -> dict[str, UnitGradients]:
        """Each parameter's per-unit gradients, as views of the block."""
        (block,) = self.gradients.chunks
        return {name: UnitGradients((block[:, part],)) for name, part in self.slices.items()}


def batched_unit_gradients(
    uses: Sequence[tuple[Factor, torch.Tensor]], padded: Padded, shape: torch.Size
) -> UnitGradients:
    """Every unit's Σ_c L_cᵀ R_c (a unit's padded slots add zero), on CPU in chunks of units of
    at most ``RETAINED_CHUNK_ELEMENTS`` elements."""
    lefts, rights = padded_factors(uses, padded)
    n_units = padded.index.shape[0]
    per_chunk = max(n_units, 1)
    if padded.index.device.type == "cpu":
        per_chunk = max(1, RETAINED_CHUNK_ELEMENTS // max(math.prod(shape), 1))
    chunks = []
    for start in range(0, n_units, per_chunk):
        units = slice(start, min(start + per_chunk, n_units))
        part = padded_unit_gradients(
            [(k, x[units]) for k, x in lefts], [r[units] for r in rights], shape
        )
        chunks.append(part.view(part.shape[0], -1))
    return UnitGradients(tuple(chunks))
