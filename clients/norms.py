"""Squared Frobenius norms of sums of rank-one terms: the per-unit, per-weight arithmetic of the
vectorized engines (derivation in :mod:`userdp.clients.ghost` and docs/worker.md).

A weight's per-unit gradient is M = Σ_c L_cᵀ R_c over the unit's token rows, for every use c of the
weight (two for a tied embedding / LM head). L is dense [n, d0] or onehot (token ids into d0 rows).

- :func:`materialize`: M itself (d0 × d1), cost n·d0·d1 (onehot: n·d1).
- :func:`ghost_squared_norm`: ‖M‖² = Σ_{c,c'} ⟨L_c L_c'ᵀ, R_c R_c'ᵀ⟩, cost n²·(d0 + d1), no d0×d1
  buffer (Li et al. 2021's ghost norm, summed over ALL the unit's tokens: cross-token terms).
- :func:`batched_exact_squared_norms`: the cheaper of the two per micro-batch (Bu et al. 2023's
  mixed ghost clipping).
- :func:`padded_unit_gradients`: every unit's M at once from padded factors (for its norm, or
  retained for the clipped sum by :mod:`userdp.clients.unit_gradients`).
- :func:`sketch_squared_norm`: n̂ = ‖Mᵀ P‖², the Hutchinson estimate for probes P [d0, k];
  :func:`batched_hutchpp_squared_norms`: n̂ = ‖MᵀQ‖² + ‖Mᵀ(I − QQᵀ)P‖², Hutch++ (Q: an
  orthonormal basis of M Mᵀ S for a second probe matrix S).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from userdp.clients.matmul_precision import (
    add_scattered,
    bf16_rows,
    left_times_scaled,
    mm32,
    scatter_rows,
)


@dataclass
class Factor:
    """The L side of a use: dense rows [n, d0], or onehot indices [n] into d0 rows."""

    dense: torch.Tensor | None
    index: torch.Tensor | None
    dim: int

    def select(self, rows: torch.Tensor | slice) -> Factor:
        if self.dense is not None:
            return Factor(self.dense[rows], None, self.dim)
        return Factor(None, self.index[rows], self.dim)

    def times(self, probes: torch.Tensor) -> torch.Tensor:
        """L P: [n, k]."""
        if self.dense is not None:  # float32: bf16-rounded probes would not be Gaussian
            return self.dense.to(torch.float32) @ probes.to(torch.float32)
        return probes[self.index]


def gram(a: Factor, b: Factor) -> torch.Tensor:
    """[n_a, n_b] of L_a,t · L_b,s."""
    if a.dense is not None and b.dense is not None:
        return mm32(a.dense, b.dense.T)
    if a.dense is None and b.dense is None:
        return (a.index[:, None] == b.index[None, :]).to(torch.float32)
    if a.dense is None:
        return b.dense.T[a.index]
    return a.dense[:, b.index]


def materialize(
    uses: Sequence[tuple[Factor, torch.Tensor]],
    shape: torch.Size,
    factor: torch.Tensor | None = None,
) -> torch.Tensor:
    """Σ_c L_cᵀ (R_c ⊙ c) as a [d0, d1] float32 matrix, c = ``factor`` [n, 1] per row when given
    (the book-keeping's clip factors; R·c is formed in float32), else 1 (the first term is the
    sum's buffer: no zero start)."""
    total = None
    for left, right in uses:
        if left.dense is not None:
            if factor is not None or right.dtype == torch.float32:
                term = left_times_scaled(left.dense, right, factor)
            else:
                term = mm32(left.dense.T, right)
        else:
            rows = right.to(torch.float32) if factor is None else right * factor
            term = scatter_rows(left.index, rows, shape[0])
        if total is None:  # a float64 term (the tests' references) is rounded as 0 + term was
            total = term.to(torch.float32)
        else:
            total += term
    if total is None:
        raise ValueError("materialize needs at least one use")
    return total


def ghost_squared_norm(uses: Sequence[tuple[Factor, torch.Tensor]]) -> float:
    """‖Σ_c L_cᵀ R_c‖²_F = Σ_{c,c'} ⟨L_c L_c'ᵀ, R_c R_c'ᵀ⟩ (float64 accumulation)."""
    total = 0.0
    for i, (left_i, right_i) in enumerate(uses):
        for j, (left_j, right_j) in enumerate(uses[: i + 1]):
            term = (gram(left_i, left_j).double() * (right_i.double() @ right_j.double().T)).sum()
            total += float(term) * (1 if i == j else 2)
    return total


def sketch_squared_norms(
    uses: Sequence[tuple[Factor, torch.Tensor]], probes: torch.Tensor, spans: Sequence[slice]
) -> list[float]:
    """n̂ per span of rows: ‖Σ_c R_cᵀ (L_c P)‖²_F with P [d0, k] (Hutchinson; exact when P = I).

    L_c P is computed once for all rows; each span (a unit's rows) then costs one [d1, k] product."""
    projected = [(left.times(probes).to(torch.float32), right) for left, right in uses]
    out = []
    for span in spans:
        total = None
        for lp, right in projected:
            part = right[span].to(torch.float32).T @ lp[span]
            total = part if total is None else total + part
        out.append(float(total.double().pow(2).sum()))
    return out


def sketch_squared_norm(uses: Sequence[tuple[Factor, torch.Tensor]], probes: torch.Tensor) -> float:
    """n̂ of all rows as one unit (see :func:`sketch_squared_norms`)."""
    return sketch_squared_norms(uses, probes, [slice(None)])[0]


# ---- batched over the units of a micro-batch ---------------------------------------------------

MAX_BUFFER_ELEMENTS = 1 << 25  # per-chunk [units, T, T] or [units, d0, d1] buffers (128 MB fp32)


@dataclass(frozen=True)
class Padded:
    """Units' rows gathered into [U, T_max] slots; slot (u, t) -> row ``index[u, t]``, or the
    sentinel ``n`` past the unit's length (such a slot reads as zero)."""

    index: torch.Tensor
    n: int
    uniform: bool  # equal lengths, rows in order: every gather is a reshape
    gather: torch.Tensor  # ``index`` with the sentinel replaced by a real row (overwritten)
    pad_slots: torch.Tensor  # flat [U·T_max] positions of the sentinel slots

    @classmethod
    def of(cls, spans: Sequence[slice], n: int, device: torch.device) -> Padded:
        lengths = [s.stop - s.start for s in spans]
        width = max(lengths) if lengths else 0
        uniform = len(set(lengths)) <= 1 and width * len(spans) == n
        starts = torch.tensor([s.start for s in spans])
        offsets = torch.arange(width)
        limit = torch.tensor(lengths)[:, None]
        index = torch.where(offsets < limit, starts[:, None] + offsets, n)
        gather = index.clamp(max=max(n - 1, 0))
        pad_slots = torch.nonzero(index.reshape(-1) == n).squeeze(1)
        # built on the host, one copy each
        return cls(index.to(device), n, uniform, gather.to(device), pad_slots.to(device))

    def _gathered(self, x: torch.Tensor) -> torch.Tensor:
        """[U, T_max, ...] of rows ``x``: one gather, then the sentinel slots are SET to zero
        (``index_fill_`` overwrites whatever the gather put there, NaN included)."""
        if self.n == 0:
            return x.new_zeros((*self.index.shape, *x.shape[1:]))
        out = x[self.gather]
        if len(self.pad_slots):
            out.view(-1, *x.shape[1:]).index_fill_(0, self.pad_slots, 0)
        return out

    def rows(self, x: torch.Tensor, keep_bf16: bool = False) -> torch.Tensor:
        """[U, T_max, d] float32 (bf16 kept as is with ``keep_bf16``), zero past each unit's
        length."""
        if not (keep_bf16 and x.dtype == torch.bfloat16):
            x = x.to(torch.float32)
        if self.uniform:
            return x.reshape(*self.index.shape, x.shape[1])
        return self._gathered(x)

    def ids(self, ids: torch.Tensor) -> torch.Tensor:
        """[U, T_max] token ids, 0 past the length (harmless: the R rows there are zero)."""
        if self.uniform:
            return ids.reshape(self.index.shape)
        return self._gathered(ids)


class Workspace:
    """One float32 buffer reused for the per-unit gradients that
    :func:`batched_exact_squared_norms` materializes ([units, d0, d1] chunks, up to
    ``MAX_BUFFER_ELEMENTS``), across the weights and micro-batches of one call. A fresh chunk
    per weight is a fresh mapping on CPU (the allocator returns blocks of this size to the OS),
    which the kernel zero-fills page by page. Every user writes all the elements it is given
    (a product with ``out=``) before reading them."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(self, shape: Sequence[int], device: torch.device) -> torch.Tensor:
        """An uninitialized contiguous float32 tensor of ``shape``, a view of the buffer."""
        size = math.prod(shape)
        buffer = self._buffer
        if buffer is None or buffer.numel() < size or buffer.device != device:
            buffer = self._buffer = torch.empty(size, dtype=torch.float32, device=device)
        return buffer[:size].view(*shape)


def _batched_gram(a: tuple, b: tuple) -> torch.Tensor:
    """[u, T, T] of L_a,t · L_b,s for padded factors ('dense', [u,T,d0]) / ('ids', [u,T])."""
    (kind_a, xa), (kind_b, xb) = a, b
    if kind_a == "dense" and kind_b == "dense":
        return mm32(xa, xb.transpose(1, 2))
    if kind_a == "ids" and kind_b == "ids":
        return (xa[:, :, None] == xb[:, None, :]).to(torch.float32)
    if kind_a == "ids":  # onehot(x_t) · g_s = g_s[x_t]
        return _batched_gram(b, a).transpose(1, 2)
    # dense a [u, T, d0] against ids b [u, T]: out[u, t, s] = a[u, t, ids_b[u, s]]
    index = xb[:, None, :].expand(xa.shape[0], xa.shape[1], xb.shape[1])
    return torch.gather(xa, 2, index).to(torch.float32)


def padded_factors(
    uses: Sequence[tuple[Factor, torch.Tensor]], padded: Padded
) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
    """Per use, L as ('ids', [U, T_max]) or ('dense', [U, T_max, d0]) and R [U, T_max, d1];
    float32, or bf16 where the tensor-core GEMMs take them as they are (:func:`bf16_rows`)."""
    keep = bf16_rows(uses)
    lefts = [
        ("ids", padded.ids(f.index))
        if f.dense is None
        else ("dense", padded.rows(f.dense, keep_bf16=keep))
        for f, _ in uses
    ]
    return lefts, [padded.rows(r, keep_bf16=keep) for _, r in uses]


def padded_unit_gradients(
    lefts: Sequence[tuple[str, torch.Tensor]],
    rights: Sequence[torch.Tensor],
    shape: torch.Size,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """[u, d0, d1] float32 of Σ_c L_cᵀ R_c per unit from padded factors, dense uses first; the
    first use's product goes into a buffer of ``workspace`` when given and that use is float32."""
    d0, d1 = shape
    matrix = None
    dense_first = sorted(zip(lefts, rights, strict=True), key=lambda use: use[0][0] != "dense")
    for (kind, left), right in dense_first:
        count = right.shape[0]
        float32 = left.dtype == right.dtype == torch.float32
        if kind == "dense" and matrix is None and workspace is not None and float32:
            # the mm32 product (IEEE float32 under exact_matmul), written into the reused buffer
            out = workspace.take((count, d0, d1), left.device)
            part = torch.bmm(left.transpose(1, 2), right, out=out)
        elif kind == "dense":
            part = mm32(left.transpose(1, 2), right)
        else:
            unit = torch.arange(count, device=left.device)[:, None].expand_as(left).reshape(-1)
            ids, source = left.reshape(-1), right.flatten(0, 1)
            if matrix is not None:  # dense uses came first: added into the gradients
                add_scattered(matrix, unit, ids, source)
                continue
            part = scatter_rows(ids + unit * d0, source, count * d0).view(count, d0, d1)
        matrix = part if matrix is None else matrix.add_(part)  # in place: this loop's own buffer
    if matrix is None:
        raise ValueError("a weight needs at least one use")
    return matrix


def unit_squared_norms(unit_gradients: torch.Tensor, float64: bool = False) -> torch.Tensor:
    """[U] float64 of ‖M_u‖² for per-unit gradients [U, ...] (float32 accumulation, or float64
    with ``float64``: a bound on it then needs no margin for the reduction's order)."""
    flat = unit_gradients.reshape(unit_gradients.shape[0], -1)
    dtype = torch.float64 if float64 else None
    return torch.linalg.vector_norm(flat, dim=1, dtype=dtype).double().square()


def exact_norm_plan(
    uses: Sequence[tuple[Factor, torch.Tensor]], padded: Padded, shape: torch.Size
) -> tuple[bool, int]:
    """(ghost, units per chunk): ghost or materialized norms, the cheaper for the micro-batch's
    longest unit, in chunks of units bounded by ``MAX_BUFFER_ELEMENTS``."""
    width = padded.index.shape[1]
    d0, d1 = shape
    onehot = [f.dense is None for f, _ in uses]
    ghost_cost = sum(width * width * ((1 if a and b else d0) + d1) for a in onehot for b in onehot)
    dense_cost = d0 * d1 + sum(width * (d1 if o else d0 * d1) for o in onehot)
    ghost = ghost_cost < dense_cost
    per_unit = width * width if ghost else d0 * d1
    return ghost, max(1, MAX_BUFFER_ELEMENTS // max(per_unit, 1))


def ghost_pairs(
    lefts: Sequence[tuple[str, torch.Tensor]], rights: Sequence[torch.Tensor]
) -> Iterator[tuple[int, int, int, torch.Tensor, torch.Tensor]]:
    """(multiplicity, c, c', L_c L_c'ᵀ, R_c R_c'ᵀ) per unordered pair of uses, [u, T, T] each:
    ‖M_u‖² = Σ multiplicity·⟨L_c L_c'ᵀ, R_c R_c'ᵀ⟩."""
    for i in range(len(lefts)):
        for j in range(i + 1):
            right = mm32(rights[i], rights[j].transpose(1, 2))
            yield (1 if i == j else 2), i, j, _batched_gram(lefts[i], lefts[j]), right


def batched_exact_squared_norms(
    uses: Sequence[tuple[Factor, torch.Tensor]],
    padded: Padded,
    shape: torch.Size,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    """[U] float64 of ‖Σ_c L_cᵀ R_c‖² per unit, ghost or materialized (:func:`exact_norm_plan`);
    materialized chunks of dense float32 uses go into ``workspace`` when given."""
    n_units = padded.index.shape[0]
    ghost, chunk = exact_norm_plan(uses, padded, shape)
    all_lefts, all_rights = padded_factors(uses, padded)
    out = []
    for start in range(0, n_units, chunk):
        units = slice(start, min(start + chunk, n_units))
        lefts = [(kind, x[units]) for kind, x in all_lefts]
        rights = [r[units] for r in all_rights]
        if ghost:
            total = sum_terms(
                (gram_left * gram_right).sum((1, 2)).double() * times
                for times, _, _, gram_left, gram_right in ghost_pairs(lefts, rights)
            )
        else:
            total = unit_squared_norms(padded_unit_gradients(lefts, rights, shape, workspace))
        out.append(total)
    return torch.cat(out)


def batched_sketch_squared_norms(
    uses: Sequence[tuple[Factor, torch.Tensor]], probes: torch.Tensor, padded: Padded
) -> torch.Tensor:
    """[U] float64 of n̂ = ‖Σ_c R_cᵀ (L_c P)‖² per unit (L_c P once for all rows)."""
    n_units = padded.index.shape[0]
    total = None
    for left, right in uses:
        lp = padded.rows(left.times(probes))  # [U, T, k]
        part = torch.bmm(padded.rows(right).transpose(1, 2), lp)  # [U, d1, k]
        total = part if total is None else total + part
    if total is None:
        return torch.zeros(n_units, dtype=torch.float64)
    return total.pow(2).sum((1, 2)).double()


def _unit_rows(padded: Padded, x: torch.Tensor, units: slice) -> torch.Tensor:
    """[u, T_max, ...] of ``units``' slots of per-row ``x`` (float32 unless integer), zero past
    each unit's length (selected by ``where``: a NaN row cannot leak into another unit's
    padding)."""
    if x.is_floating_point():
        x = x.to(torch.float32)
    index = padded.index[units]
    if padded.uniform:
        return x.reshape(*padded.index.shape, *x.shape[1:])[units]
    inside = index < padded.n
    rows = x[index.clamp(max=max(padded.n - 1, 0))]
    mask = inside.view(*inside.shape, *([1] * (rows.dim() - 2)))
    return torch.where(mask, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def _left_rows(left: Factor, padded: Padded, units: slice) -> tuple:
    """A use's L side for ``units``: ('dense', [u, T, d0] float32) or ('ids', [u, T])."""
    if left.dense is None:
        return ("ids", _unit_rows(padded, left.index, units))
    return ("dense", _unit_rows(padded, left.dense, units))


def _left_times(left: tuple, basis: torch.Tensor) -> torch.Tensor:
    """L B per unit: [u, T, k] for a per-unit basis B [u, d0, k] (onehot: gathered rows)."""
    kind, x = left
    if kind == "dense":
        return torch.bmm(x, basis)
    index = x[:, :, None].expand(-1, -1, basis.shape[2])
    return torch.gather(basis, 1, index)


def _left_transpose_times(left: tuple, rows: torch.Tensor, d0: int) -> torch.Tensor:
    """Lᵀ Y per unit: [u, d0, k] for rows Y [u, T, k] (onehot: rows scattered into d0 slots)."""
    kind, x = left
    if kind == "dense":
        return torch.bmm(x.transpose(1, 2), rows)
    count, _, k = rows.shape
    slots = x + torch.arange(count, device=x.device)[:, None] * d0
    return scatter_rows(slots.reshape(-1), rows.flatten(0, 1), count * d0).view(count, d0, k)


def sum_terms(terms: Iterator[torch.Tensor]) -> torch.Tensor:
    """Σ of a non-empty iterable of tensors (no zero start: one buffer fewer than ``sum``)."""
    terms = iter(terms)
    total = next(terms)
    for term in terms:
        total = total + term
    return total


def batched_hutchpp_squared_norms(
    uses: Sequence[tuple[Factor, torch.Tensor]],
    head_probes: torch.Tensor,
    tail_probes: torch.Tensor,
    padded: Padded,
) -> torch.Tensor:
    """[U] float64 of the Hutch++ estimate per unit (Meyer, Musco, Musco, Woodruff, "Hutch++:
    Optimal Stochastic Trace Estimation", applied to ‖M‖² = tr(M Mᵀ) as in the randomized-
    clipping paper), for independent probes S = ``head_probes`` and P = ``tail_probes`` [d0, k],
    P_ij ~ N(0, 1/k):

        X = Mᵀ S,  Y = M X,  Q = orth(Y)  (reduced QR, per unit),
        n̂ = ‖MᵀQ‖² + ‖MᵀP − (MᵀQ)(QᵀP)‖²  =  head + ‖Mᵀ(I − QQᵀ)P‖².

    The head is exact on span Q; the tail is a Hutchinson estimate of the residual with probes
    independent of Q, so E n̂ = ‖M‖², and n̂ = ‖M‖² whenever rank M ≤ k (Q spans M's column
    space). Four k-wide passes over the unit's rows and one QR per unit, against Hutchinson's
    one pass. float32 (IEEE under :func:`~userdp.clients.matmul_precision.exact_matmul`); units
    in chunks whose per-unit buffers ([d0, k] bases, [T, d0] / [T, d1] rows) stay under
    ``MAX_BUFFER_ELEMENTS``."""
    n_units, width = padded.index.shape
    if not uses:
        return torch.zeros(n_units, dtype=torch.float64)
    d0, k = tail_probes.shape
    # L_c S and L_c P use probes shared by every unit: computed once for all rows
    left_head = [f.times(head_probes) for f, _ in uses]
    left_tail = [f.times(tail_probes) for f, _ in uses]
    tail_probes = tail_probes.to(torch.float32)
    widest = max([d0 * k] + [width * r.shape[1] for _, r in uses])
    widest = max([widest] + [width * d0 for f, _ in uses if f.dense is not None])
    chunk = max(1, MAX_BUFFER_ELEMENTS // max(widest, 1))
    out = []
    for start in range(0, n_units, chunk):
        units = slice(start, min(start + chunk, n_units))
        rights = [_unit_rows(padded, r, units).transpose(1, 2) for _, r in uses]  # [u, d1, T]
        lefts = [_left_rows(f, padded, units) for f, _ in uses]
        # X = Mᵀ S [u, d1, k], scaled per unit (only the span of M X matters) so that M X stays
        # in float32 range for any gradient scale
        x = sum_terms(
            torch.bmm(rt, _unit_rows(padded, ls, units))
            for rt, ls in zip(rights, left_head, strict=True)
        )
        x = x / x.abs().amax((1, 2), keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        y = sum_terms(
            _left_transpose_times(left, torch.bmm(rt.transpose(1, 2), x), d0)
            for left, rt in zip(lefts, rights, strict=True)
        )
        q = torch.linalg.qr(y, mode="reduced").Q  # [u, d0, min(d0, k)]
        head = sum_terms(
            torch.bmm(rt, _left_times(left, q)) for left, rt in zip(lefts, rights, strict=True)
        )
        sketch = sum_terms(
            torch.bmm(rt, _unit_rows(padded, lp, units))
            for rt, lp in zip(rights, left_tail, strict=True)
        )
        residual = sketch - torch.bmm(head, torch.matmul(q.transpose(1, 2), tail_probes))
        out.append(head.pow(2).sum((1, 2)).double() + residual.pow(2).sum((1, 2)).double())
    return torch.cat(out)
