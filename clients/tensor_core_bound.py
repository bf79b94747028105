"""Worst-case rounding bounds for the vectorized engines' GEMMs in tensor-core mode
(``workers.tensor_core_matmul``), so that every unit's clipped contribution has norm at most C
whatever the tensor cores' accumulation does within the model below. The derivation, with its
references, is in docs/worker.md ("Tensor cores: a proven norm bound").

The model of one entry of a GEMM, a dot product Σ_{i≤n} x_i y_i:

- (A1) each product x_i y_i of two bf16 numbers is exact (16 significant bits fit float32's 24)
  when it is in float32's normal range; a product below 2^{−126} may be lost, an absolute error
  under n·2^{−126} per entry that no clip norm in use comes near;
- (A2) products are added to a float32 accumulator c in block fused multiply-adds
  d = c + Σ_{i∈block} p_i of any block size b ≥ 1: the b + 1 addends are aligned to the largest
  and kept to at least ``ALIGN_BITS`` = p significant bits of it (the rest truncated), and d is
  normalised to float32 (rounded to nearest or toward zero);
- (A3) the partial sums of a split inner dimension are added in IEEE float32 (reduced-precision
  reductions are switched off by :func:`~userdp.clients.matmul_precision.exact_matmul`).

Under (A2) a block of b_j products errs by less than (b_j + 1)·2^{1−p}·(1 + 2^{−23}) + 2^{−23}
times the sum of its addends' magnitudes (alignment, then the normalisation of the aligned sum),
which is at most b_j·(2^{2−p}(1 + 2^{−23}) + 2^{−23}). Along any path from a product to the result
the relative errors compound (each split-K addition on the path is paid for by another product's
2^{−24}), so

    |fl(Σ x_i y_i) − Σ x_i y_i| ≤ γ(n)·Σ |x_i y_i|,
    γ(n) = exp(n·(2^{2−p}(1 + 2^{−23}) + 2^{−23} + 2^{−24})) − 1

for every block size and every split of the inner dimension (:func:`dot_error`). IEEE float32
GEMMs (operands that are not bf16) satisfy the smaller bound n·2^{−24}/(1 − n·2^{−24}), so
:func:`dot_error` covers every GEMM of the mode.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from userdp.clients.norms import (
    Factor,
    Padded,
    exact_norm_plan,
    ghost_pairs,
    padded_factors,
    padded_unit_gradients,
    unit_squared_norms,
)

ALIGN_BITS = 24
"""p of (A2): the fewest significant bits of the largest addend a block FMA keeps (the float32
significand; the tensor cores studied keep 24 or more for bf16 and fp16 inputs)."""

F32 = 2.0**-24
"""Unit roundoff of IEEE float32 (round to nearest)."""
F64 = 2.0**-53
"""Unit roundoff of IEEE float64."""


def dot_error(n: int, align_bits: int | None = None) -> float:
    """γ(n): a length-``n`` dot product computed under (A1)-(A3) is within γ(n)·Σ|x_i y_i| of its
    exact value (module docstring)."""
    p = ALIGN_BITS if align_bits is None else align_bits
    return math.expm1(max(n, 0) * (2.0 ** (2 - p) * (1 + 2 * F32) + 2 * F32 + F32))


def ieee_error(n: int, unit: float = F32) -> float:
    """γ_n = n·u/(1 − n·u): any IEEE summation of n + 1 terms, in any order (Higham, *Accuracy and
    Stability of Numerical Algorithms*, 2nd ed., Lemma 3.1 and §4.2)."""
    nu = max(n, 0) * unit
    if nu >= 1:
        return math.inf
    return nu / (1 - nu)


FLOAT64_MARGIN = 1 + 2**36 * F64 / (1 - 2**36 * F64)
"""A factor that raises any float64 sum of fewer than 2³⁶ nonnegative terms (a unit's gradient of
a weight has fewer entries than that), and any product of such sums, past its rounding: the
bounds' own arithmetic keeps them upper bounds (7.6e-6 relative)."""
CLIP_FACTOR_ROUNDING = 1 + 2.0**-23
"""The clip factor C/B_u is rounded to float32 (2⁻²⁴ relative, either way): raising B_u by this
keeps the rounded factor at most C/(true B_u)."""


def release_error(rows: int, uses: int) -> float:
    """ε_bk: the book-keeping product Σ_c L_cᵀ (c_t ⊙ R_c) over ``rows`` token rows releases, for
    each unit u, its clipped gradient c_u·M_u plus an error of norm at most ε_bk·c_u·S_u, where
    S_u = Σ_c Σ_{t∈u} ‖L_c,t‖·‖R_c,t‖ (docs/worker.md). The factors: c_t·R_t rounded to float32
    (2⁻²⁴) and split into two bf16 parts (2⁻¹⁶, :func:`~userdp.clients.matmul_precision.
    split_bf16`); the GEMM over ``rows`` (γ(rows)) on parts whose magnitudes sum to at most
    (1 + 2⁻⁷) times the factor's; the float32 add of the two parts and one add per further use
    (2⁻²⁴ each, on sums at most (1 + 2⁻⁷)(1 + γ) times the magnitudes)."""
    gamma = dot_error(rows)
    parts = 1 + 2.0**-7
    adds = (1 + F32 * parts * (1 + gamma)) ** max(uses, 1)
    return (1 + F32) * (1 + 2.0**-16) * (1 + gamma * parts) * adds - 1


def norm_margin(width: int) -> float:
    """A factor that raises a float32 row norm over ``width`` entries (a float32 sum of squares,
    then a square root) and a float32 product of two such norms past their rounding."""
    return (1 + 2 * F32) / (1 - ieee_error(width + 2))


def slot_norms(
    uses: Sequence[tuple[Factor, torch.Tensor]], padded: Padded
) -> list[tuple[torch.Tensor | None, torch.Tensor]]:
    """Per use, ([U, T] ‖L_c,t‖ or None for a onehot side, whose rows have norm 1; [U, T]
    ‖R_c,t‖), float32 by slot (each low by less than :func:`norm_margin`), 0 past each unit's
    length. Entries whose squares underflow float32 may give a norm of 0, an absolute error
    below 2⁻⁶³·√d, as negligible next to any clip norm as (A1)'s; a norm that overflows is
    infinite, and the unit is dropped as non-finite."""
    return [
        (
            None if left.dense is None else padded.ids(_norms(left.dense)),
            padded.ids(_norms(right)),
        )
        for left, right in uses
    ]


def _norms(rows: torch.Tensor) -> torch.Tensor:
    if rows.dtype == torch.float64:  # the tests' references: rounded first, within the margin
        rows = rows.to(torch.float32)
    return torch.linalg.vector_norm(rows, dim=-1, dtype=torch.float32)


def magnitudes(
    uses: Sequence[tuple[Factor, torch.Tensor]],
    norms: Sequence[tuple[torch.Tensor | None, torch.Tensor]],
) -> list[torch.Tensor]:
    """Per use, [U] float64 S_u = Σ_t ‖L_c,t‖·‖R_c,t‖ from :func:`slot_norms` (a padded slot has
    ‖R‖ = 0), raised past the rounding of the norms and their products."""
    out = []
    for (left, right), (norm_left, norm_right) in zip(uses, norms, strict=True):
        margin = norm_margin(right.shape[-1])
        if norm_left is None:
            part = norm_right.sum(1, dtype=torch.float64)
        else:
            margin *= norm_margin(left.dense.shape[-1])
            part = (norm_left * norm_right).sum(1, dtype=torch.float64)
        out.append(part.mul_(margin * FLOAT64_MARGIN))
    return out


def _quadratic(left: torch.Tensor | None, matrix: torch.Tensor, right: torch.Tensor | None):
    """[u] float32 of vᵀ|A|w for nonnegative float32 v, w [u, T] (None: all ones) and A
    [u, T, T]: a nonnegative sum, low by at most γ_32(2T + 2) relative (see the caller)."""
    magnitude = matrix.abs()
    if right is not None:
        magnitude = torch.bmm(magnitude, right[:, :, None])
    if left is not None:
        return torch.bmm(left[:, None, :], magnitude).view(-1)
    return magnitude.sum((1, 2))


def bounded_exact_squared_norms(
    uses: Sequence[tuple[Factor, torch.Tensor]], padded: Padded, shape: torch.Size
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([U] computed ‖M_u‖², [U] upper bounds on ‖M_u‖, [U] S_u), float64, for one weight whose
    clipped gradient the book-keeping releases; the computed norms are those of
    :func:`~userdp.clients.norms.batched_exact_squared_norms` (with float64 sums), and the
    upper bounds hold whatever the rounding under (A1)-(A3) (docs/worker.md):

    - ghost: |ĝL·ĝR − gL·gR| ≤ γ_L·α|ĝR| + γ_R·|ĝL|β + γ_L·γ_R·αβ per Gram entry, with
      α_st = ‖L_s‖‖L_t‖, β_st = ‖R_s‖‖R_t‖, γ_L = γ(d0) (0 for a pair with a onehot side,
      whose Gram is exact) and γ_R = γ(d1); plus the float32 product and the float64 sum of the
      entries;
    - materialized: ‖M_u − M̂_u‖ ≤ γ(T·uses)·S_u (each entry errs by at most
      γ·Σ_t |L_t,i||R_t,j|).
    """
    n_units, width = padded.index.shape
    d0, d1 = shape
    ghost, chunk = exact_norm_plan(uses, padded, shape)
    all_lefts, all_rights = padded_factors(uses, padded)
    norms = slot_norms(uses, padded)
    per_use = magnitudes(uses, norms)  # S_u of each use
    magnitude = per_use[0] if len(per_use) == 1 else sum(per_use)
    # the quadratic forms: float32 products of float32 norms, raised past both roundings
    low = FLOAT64_MARGIN / (1 - ieee_error(2 * width + 4))
    low_left, low_right = low * norm_margin(d0) ** 2, low * norm_margin(d1) ** 2
    gamma_right = dot_error(d1)
    computed, upper = [], []
    for start in range(0, n_units, chunk):
        units = slice(start, min(start + chunk, n_units))
        lefts = [(kind, x[units]) for kind, x in all_lefts]
        rights = [r[units] for r in all_rights]
        if not ghost:
            matrix = padded_unit_gradients(lefts, rights, shape)  # bf16 operands: no workspace
            total = unit_squared_norms(matrix, float64=True)
            computed.append(total)
            upper.append(total.sqrt() + dot_error(width * len(uses)) * magnitude[units])
            continue
        total = torch.zeros_like(magnitude[units])
        bound = torch.zeros_like(total)  # Σ of the error terms, then of the computed norm too
        for times, i, j, gram_left, gram_right in ghost_pairs(lefts, rights):
            gamma_left = dot_error(d0) if lefts[i][0] == lefts[j][0] == "dense" else 0.0
            term = (gram_left * gram_right).sum((1, 2), dtype=torch.float64)
            total.add_(term, alpha=times)
            (norm_left_i, norm_right_i), (norm_left_j, norm_right_j) = norms[i], norms[j]
            quadratic = _quadratic(norm_right_i[units], gram_left, norm_right_j[units])
            bound.add_(quadratic, alpha=times * gamma_right * low_right)
            if gamma_left:
                quadratic = _quadratic(norm_left_i[units], gram_right, norm_left_j[units])
                bound.add_(quadratic, alpha=times * gamma_left * low_left)
            rounding = (F32 + ieee_error(width * width, F64)) * (1 + gamma_left) * (1 + gamma_right)
            coefficient = times * (gamma_left * gamma_right + rounding)
            bound.addcmul_(per_use[i][units], per_use[j][units], value=coefficient)
        computed.append(total)
        upper.append(bound.add_(total).clamp_min_(0).sqrt_())
    if len(computed) == 1:
        return computed[0], upper[0], magnitude
    return torch.cat(computed), torch.cat(upper), magnitude


def uses_release_error(uses: Sequence[tuple[Factor, torch.Tensor]]) -> float:
    """ε_bk of a weight's book-keeping product (over its uses' token rows)."""
    return release_error(max(len(r) for _, r in uses), len(uses))


def clip_squared_norms(
    exact_bound: torch.Tensor,
    released: list[tuple[torch.Tensor | None, torch.Tensor, float]],
    n_units: int,
) -> torch.Tensor:
    """[U] B_u² for tensor-core mode. ``exact_bound``: Σ of the squared norms of what the
    retained and small parameters release (and of sketched weights' estimates); ``released``,
    per book-keeping weight: (an upper bound on ‖M_u‖, or None for a sketched weight, S_u, ε_bk).
    An exact weight adds (bound + ε_bk·S_u)²; the sketched weights' release errors, of norm at
    most ‖(ε_bk·S_u)_w‖ together, are added to the norm: B = √(n̂ + …) + ‖(ε_bk·S_u)_w‖, so a
    unit releases at most C·max(1, ‖g_u‖/√n̂_u). The result is raised past float64's rounding,
    the float32 weighted sum of retained gradients over units and the clip factor's rounding to
    float32. One stacked computation for all weights (a few kernels, not a few per weight)."""
    total = exact_bound
    exact = [(u, m, e) for u, m, e in released if u is not None]
    sketched = [(m, e) for u, m, e in released if u is None]
    if exact:
        coef = torch.tensor([e for _, _, e in exact], dtype=torch.float64)
        bounds = torch.addcmul(
            torch.stack([u for u, _, _ in exact]),
            coef.to(total.device)[:, None],
            torch.stack([m for _, m, _ in exact]),
        )
        total = total + bounds.square().sum(0)
    norm = total.sqrt()
    if sketched:
        coef = torch.tensor([e for _, e in sketched], dtype=torch.float64).to(total.device)
        errors = coef[:, None] * torch.stack([m for m, _ in sketched])
        norm = norm + errors.square().sum(0).sqrt()
    margin = FLOAT64_MARGIN * (1 + ieee_error(n_units)) * CLIP_FACTOR_ROUNDING
    return (norm * margin).square()
