"""Worst-case rounding bounds for the vectorized engines' GEMMs in tensor-core mode
(``workers.tensor_core_matmul``), so that every unit's clipped contribution has norm at most C
whatever the tensor cores' accumulation does within the model below. The derivation, with its
references, is in docs/worker.md ("Tensor cores: a proven norm bound").

The model of one entry of a GEMM, a dot product Σ_{i≤n} x_i y_i:

- (A1) each product x_i y_i of two bf16 numbers is exact (16 significant bits fit float32's 24);
- (A2) products are added to a float32 accumulator c in block fused multiply-adds
  d = c + Σ_{i∈block} p_i of any block size b ≥ 1: the b + 1 addends are aligned to the largest
  and kept to at least ``ALIGN_BITS`` = p significant bits of it (the rest truncated), and d is
  normalised to float32 (rounded to nearest or toward zero);
- (A3) the partial sums of a split inner dimension are added in IEEE float32 (reduced-precision
  reductions are switched off by :func:`~userdp.clients.matmul_precision.exact_matmul`).

Under (A2) a block of b_j products errs by less than ((b_j + 1)·2^{1−p} + 2^{−23}) times the sum
of its addends' magnitudes, which is at most b_j·(2^{2−p} + 2^{−23}). Along any path from a product
to the result the relative errors compound, so

    |fl(Σ x_i y_i) − Σ x_i y_i| ≤ γ(n)·Σ |x_i y_i|,  γ(n) = exp(n·(2^{2−p} + 2^{−23} + 2^{−24})) − 1

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
    return math.expm1(max(n, 0) * (2.0 ** (2 - p) + 2 * F32 + F32))


def ieee_error(n: int, unit: float = F32) -> float:
    """γ_n = n·u/(1 − n·u): any IEEE summation of n + 1 terms, in any order (Higham, *Accuracy and
    Stability of Numerical Algorithms*, 2nd ed., Lemma 3.1 and §4.2)."""
    nu = max(n, 0) * unit
    if nu >= 1:
        return math.inf
    return nu / (1 - nu)


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """‖x_t‖ per row of ``x`` [..., d], in float64 (exact to float64 rounding for bf16 or float32
    rows: a margin of ``ieee_error(d, F64)`` covers it)."""
    return torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64)


def inflate(norm: torch.Tensor, terms: int) -> torch.Tensor:
    """``norm`` raised by the float64 rounding of a sum of ``terms`` float64 values (row norms,
    their products and sums): upper bounds stay upper bounds."""
    return norm * (1 + ieee_error(terms + 4, F64))


def release_error(rows: int, uses: int) -> float:
    """ε_bk: the book-keeping product Σ_c L_cᵀ (c_t ⊙ R_c) over ``rows`` token rows releases, for
    each unit u, its clipped gradient c_u·M_u plus an error of norm at most ε_bk·c_u·S_u, where
    S_u = Σ_c Σ_{t∈u} ‖L_c,t‖·‖R_c,t‖ (docs/worker.md). The terms: the GEMM (γ(rows), on a
    factor whose three bf16 parts sum to at most (1 + 2⁻⁷) times its magnitude), the scaling
    c_t·R_t and the three-part split (2⁻²⁴ each), the two float32 adds of the parts and one add
    per further use (2⁻²⁴ each)."""
    gamma = dot_error(rows)
    return (gamma * (1 + 2.0**-7) + (4 + uses) * F32) * (1 + gamma)


def unit_magnitudes(uses: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """S_u per unit for padded per-use row norms ([U, T] of ‖L_c,t‖, [U, T] of ‖R_c,t‖): Σ over
    the uses and the unit's slots of ‖L_c,t‖·‖R_c,t‖ (padded slots have R = 0), float64."""
    total = None
    for left, right in uses:
        part = (left * right).sum(1)
        total = part if total is None else total + part
    if total is None:
        raise ValueError("a weight needs at least one use")
    return total


def _slot_norms(uses: Sequence[tuple[Factor, torch.Tensor]], padded: Padded) -> list[tuple]:
    """Per use, ([U, T] ‖L_c,t‖, [U, T] ‖R_c,t‖) in float64 by slot, 0 past each unit's length
    (a onehot row has norm 1)."""
    out = []
    for left, right in uses:
        norm_right = row_norms(right)
        norm_left = torch.ones_like(norm_right) if left.dense is None else row_norms(left.dense)
        out.append((padded.ids(norm_left), padded.ids(norm_right)))
    return out


def release_terms(uses: Sequence[tuple[Factor, torch.Tensor]], padded: Padded) -> torch.Tensor:
    """[U] float64 of ε_bk·S_u (:func:`release_error`): the most the book-keeping product adds to
    a unit's released gradient, per unit of its clip factor."""
    rows = max(right.shape[0] for _, right in uses)
    return release_error(rows, len(uses)) * unit_magnitudes(_slot_norms(uses, padded))


def _quadratic(vector: torch.Tensor, matrix: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """[u] of vᵀ |A| w for nonnegative v, w [u, T] and A [u, T, T], raised past the float32
    rounding of the product (a nonnegative sum of T terms is low by at most γ_T relative)."""
    inner = torch.bmm(matrix.abs().to(torch.float32), other.to(torch.float32)[:, :, None])
    total = (vector * inner[:, :, 0].double()).sum(1)
    return total / (1 - ieee_error(matrix.shape[-1] + 2))


def bounded_exact_squared_norms(
    uses: Sequence[tuple[Factor, torch.Tensor]],
    padded: Padded,
    shape: torch.Size,
) -> tuple[torch.Tensor, torch.Tensor]:
    """([U] computed ‖M_u‖², [U] B_u²) in float64 for one weight whose clipped gradient the
    book-keeping releases: the norms as :func:`~userdp.clients.norms.batched_exact_squared_norms`
    computes them (with float64 sums), and bounds B_u ≥ ‖M_u‖ + ε_bk·S_u on the norm of what the
    book-keeping releases for u per unit of its clip factor, whatever the rounding under
    (A1)-(A3) (docs/worker.md):

    - ghost: |ĝL·ĝR − gL·gR| ≤ γ_L·α|ĝR| + γ_R·|ĝL|β + γ_L·γ_R·αβ per Gram entry, with
      α_st = ‖L_s‖‖L_t‖, β_st = ‖R_s‖‖R_t‖, γ_L = γ(d0) (0 for a onehot side, whose Gram is
      exact) and γ_R = γ(d1); plus the float32 product and the float64 sum of the entries;
    - materialized: ‖M_u − M̂_u‖ ≤ γ(T·uses)·S_u (each entry errs by at most γ·Σ_t |L_t,i||R_t,j|)."""
    n_units, width = padded.index.shape
    d0, d1 = shape
    ghost, chunk = exact_norm_plan(uses, padded, shape)
    all_lefts, all_rights = padded_factors(uses, padded)
    all_norms = _slot_norms(uses, padded)
    gamma_right = dot_error(d1)
    computed, upper = [], []
    for start in range(0, n_units, chunk):
        units = slice(start, min(start + chunk, n_units))
        lefts = [(kind, x[units]) for kind, x in all_lefts]
        rights = [r[units] for r in all_rights]
        norms = [(left[units], right[units]) for left, right in all_norms]
        magnitudes = [(left * right).sum(1) for left, right in norms]
        if ghost:
            total = error = None
            for times, i, j, gram_left, gram_right in ghost_pairs(lefts, rights):
                gamma_left = dot_error(d0) if lefts[i][0] == lefts[j][0] == "dense" else 0.0
                both = magnitudes[i] * magnitudes[j]
                entry = (
                    gamma_left * _quadratic(norms[i][0], gram_right, norms[j][0])
                    + gamma_right * _quadratic(norms[i][1], gram_left, norms[j][1])
                    + gamma_left * gamma_right * both
                    + (F32 + ieee_error(width * width, F64))
                    * (1 + gamma_left)
                    * (1 + gamma_right)
                    * both
                )
                term = (gram_left * gram_right).sum((1, 2), dtype=torch.float64) * times
                total = term if total is None else total + term
                error = entry * times if error is None else error + entry * times
            norm = (total + error).clamp_min(0).sqrt()
        else:
            matrix = padded_unit_gradients(lefts, rights, shape)  # bf16: never a workspace
            total = unit_squared_norms(matrix, float64=True)
            norm = total.sqrt() + dot_error(width * len(uses)) * sum(magnitudes)
        computed.append(total)
        upper.append(norm)
    release = release_terms(uses, padded)
    bound = inflate(torch.cat(upper) + release, width * width * len(uses) ** 2).square()
    return torch.cat(computed), inflate(bound, 4)
