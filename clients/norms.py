"""Squared Frobenius norms of sums of rank-one terms: the per-unit, per-weight arithmetic of the
vectorized engines (derivation in :mod:`userdp.clients.ghost` and docs/worker.md).

A weight's per-unit gradient is M = Σ_c L_cᵀ R_c over the unit's token rows, for every use c of the
weight (two for a tied embedding / LM head). L is dense [n, d0] or onehot (token ids into d0 rows).

- :func:`materialize`: M itself (d0 × d1), cost n·d0·d1 (onehot: n·d1).
- :func:`ghost_squared_norm`: ‖M‖² = Σ_{c,c'} ⟨L_c L_c'ᵀ, R_c R_c'ᵀ⟩, cost n²·(d0 + d1), no d0×d1
  buffer (Li et al. 2021's ghost norm, summed over ALL the unit's tokens: cross-token terms).
- :func:`exact_squared_norm`: the cheaper of the two (Bu et al. 2023's mixed ghost clipping).
- :func:`sketch_squared_norm`: n̂ = ‖Mᵀ P‖², the Hutchinson estimate for probes P [d0, k].
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


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
        if self.dense is not None:
            return self.dense @ probes.to(self.dense.dtype)
        return probes[self.index]


def gram(a: Factor, b: Factor) -> torch.Tensor:
    """[n_a, n_b] of L_a,t · L_b,s."""
    if a.dense is not None and b.dense is not None:
        return a.dense @ b.dense.T
    if a.dense is None and b.dense is None:
        return (a.index[:, None] == b.index[None, :]).to(torch.float32)
    if a.dense is None:
        return b.dense.T[a.index]
    return a.dense[:, b.index]


def materialize(uses: Sequence[tuple[Factor, torch.Tensor]], shape: torch.Size) -> torch.Tensor:
    """Σ_c L_cᵀ R_c as a [d0, d1] float32 matrix."""
    total = torch.zeros(shape, dtype=torch.float32, device=uses[0][1].device)
    for left, right in uses:
        right = right.to(torch.float32)
        if left.dense is not None:
            total.addmm_(left.dense.to(torch.float32).T, right)
        else:
            total.index_add_(0, left.index, right)
    return total


def ghost_squared_norm(uses: Sequence[tuple[Factor, torch.Tensor]]) -> float:
    """‖Σ_c L_cᵀ R_c‖²_F = Σ_{c,c'} ⟨L_c L_c'ᵀ, R_c R_c'ᵀ⟩ (float64 accumulation)."""
    total = 0.0
    for i, (left_i, right_i) in enumerate(uses):
        for j, (left_j, right_j) in enumerate(uses[: i + 1]):
            term = (gram(left_i, left_j).double() * (right_i.double() @ right_j.double().T)).sum()
            total += float(term) * (1 if i == j else 2)
    return total


def exact_squared_norm(uses: Sequence[tuple[Factor, torch.Tensor]], shape: torch.Size) -> float:
    """‖Σ_c L_cᵀ R_c‖² by whichever of ghost / materialization costs less."""
    tokens = sum(len(right) for _, right in uses)
    d0, d1 = shape
    ghost_cost = tokens * tokens * (d0 + d1)
    dense_cost = d0 * d1 + sum(len(r) * (d1 if f.dense is None else d0 * d1) for f, r in uses)
    if ghost_cost < dense_cost:
        return ghost_squared_norm(uses)
    return float(materialize(uses, shape).double().pow(2).sum())


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
