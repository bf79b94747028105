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
from dataclasses import dataclass

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


class BoundTerms:
    """The bound's per-weight terms of one micro-batch, combined for every weight at once.

    Per weight only what needs the weight's factors runs as it comes (:meth:`add_exact`,
    :meth:`add_sketched`): the row norms, the Gram products, the sums of their entrywise
    products and the matrix-vector halves |G|·w of the quadratic forms. Everything that is
    arithmetic on [U] vectors (the magnitudes S_u, the quadratic forms' second halves, the
    coefficients, the square roots) waits for :meth:`finish`, which does it for all weights in a
    fixed number of stacked kernels: on a GPU these are launch-bound, and a few per weight would
    be a few hundred per micro-batch. The arithmetic, and so the bound, is the same as per
    weight (:func:`bounded_exact_squared_norms` is one weight's :meth:`finish`)."""

    def __init__(self, padded: Padded) -> None:
        self.padded = padded
        self.weights = 0
        self.exact: list[int] = []  # weight index of each exact weight, in order
        self.errors: list[float] = []  # ε_bk per weight
        self.additive: list[float] = []  # per exact weight: γ of a materialized norm, else 0
        self.norms: list[torch.Tensor] = []  # [U, T] float32 row norms: each use's L, then R
        self.uses: list[tuple[int, int | None, int, float]] = []  # (weight, L, R, margin)
        self.terms: list[tuple[int, float, torch.Tensor]] = []  # (exact weight, times, [U])
        self.halves: list[tuple[int, float, int, torch.Tensor]] = []  # (.., partner norm, |G|w)
        self.pairs: list[tuple[int, float, int, int]] = []  # (exact weight, coef, use i, use j)

    def _add_uses(self, uses: Sequence[tuple[Factor, torch.Tensor]]) -> tuple[list, list]:
        """Records one weight's uses and their row norms (:func:`slot_norms`); returns the uses'
        indices and, per use, (table row of L's norms or None, of R's, L's norms, R's)."""
        first, out = len(self.uses), []
        for (left, right), (norm_left, norm_right) in zip(
            uses, slot_norms(uses, self.padded), strict=True
        ):
            margin = norm_margin(right.shape[-1]) * FLOAT64_MARGIN
            index_left = None
            if norm_left is not None:
                margin *= norm_margin(left.dense.shape[-1])
                index_left = len(self.norms)
                self.norms.append(norm_left)
            self.norms.append(norm_right)
            self.uses.append((self.weights, index_left, len(self.norms) - 1, margin))
            out.append((index_left, len(self.norms) - 1, norm_left, norm_right))
        self.weights += 1
        return [first + k for k in range(len(uses))], out

    def add_sketched(self, uses: Sequence[tuple[Factor, torch.Tensor]]) -> None:
        """A sketched weight: only its release error, ε_bk·S_u, is bounded."""
        self._add_uses(uses)
        self.errors.append(uses_release_error(uses))

    def add_exact(self, uses: Sequence[tuple[Factor, torch.Tensor]], shape: torch.Size) -> None:
        """A book-kept weight with exact norms, ghost or materialized (module docstring of
        :func:`bounded_exact_squared_norms`)."""
        n_units, width = self.padded.index.shape
        d0, d1 = shape
        ghost, chunk = exact_norm_plan(uses, self.padded, shape)
        use_ids, norms = self._add_uses(uses)
        weight = len(self.exact)
        self.exact.append(self.weights - 1)
        self.errors.append(uses_release_error(uses))
        self.additive.append(0.0 if ghost else dot_error(width * len(uses)))
        all_lefts, all_rights = padded_factors(uses, self.padded)
        # the quadratic forms' first halves: float32 products of float32 norms, raised past both
        # roundings (with the second halves' in finish)
        low = FLOAT64_MARGIN / (1 - ieee_error(2 * width + 4))
        low_left, low_right = low * norm_margin(d0) ** 2, low * norm_margin(d1) ** 2
        gamma_right = dot_error(d1)
        parts: dict[tuple, list[torch.Tensor]] = {}
        coefficients: dict[tuple, tuple[float, int]] = {}
        pairs: dict[tuple[int, int], float] = {}  # (use i, use j) -> coefficient of S_i·S_j
        for start in range(0, n_units, chunk):
            units = slice(start, min(start + chunk, n_units))
            lefts = [(kind, x[units]) for kind, x in all_lefts]
            rights = [r[units] for r in all_rights]
            if not ghost:
                matrix = padded_unit_gradients(lefts, rights, shape)  # bf16: no workspace
                parts.setdefault(("term",), []).append(unit_squared_norms(matrix, float64=True))
                coefficients[("term",)] = (1.0, -1)
                continue
            for times, i, j, gram_left, gram_right in ghost_pairs(lefts, rights):
                gamma_left = dot_error(d0) if lefts[i][0] == lefts[j][0] == "dense" else 0.0
                key = ("term", i, j)
                term = (gram_left * gram_right).sum((1, 2), dtype=torch.float64)
                parts.setdefault(key, []).append(term)
                coefficients[key] = (float(times), -1)
                left_i, right_i = norms[i][:2]  # table rows of use i's norms
                norm_left_j, norm_right_j = norms[j][2:]
                key = ("half", i, j, "right")
                parts.setdefault(key, []).append(_half(gram_left, norm_right_j[units]))
                coefficients[key] = (times * gamma_right * low_right, right_i)
                if gamma_left:
                    key = ("half", i, j, "left")
                    parts.setdefault(key, []).append(_half(gram_right, norm_left_j[units]))
                    coefficients[key] = (times * gamma_left * low_left, left_i)
                rounding = (F32 + ieee_error(width * width, F64)) * (1 + gamma_left)
                rounding *= 1 + gamma_right
                pairs[use_ids[i], use_ids[j]] = times * (gamma_left * gamma_right + rounding)
        self.pairs += [(weight, c, i, j) for (i, j), c in pairs.items()]
        for key, chunks in parts.items():
            vector = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
            coefficient, partner = coefficients[key]
            if key[0] == "term":
                self.terms.append((weight, coefficient, vector))
            else:
                self.halves.append((weight, coefficient, partner, vector))

    def finish(self) -> Bounds:
        """Every weight's bound terms combined (:class:`Bounds`), in a fixed number of kernels
        (the index and coefficient lists reach the device in two copies)."""
        n_units, width = self.padded.index.shape
        device = self.padded.index.device
        f64 = {"dtype": torch.float64, "device": device}
        exact = set(self.exact)
        sketched = [w for w in range(self.weights) if w not in exact]
        ones = len(self.norms)  # the table's row of ones: a onehot side's rows have norm 1
        lists = {  # name -> (indices, coefficients)
            "use": ([w for w, *_ in self.uses], [m for *_, m in self.uses]),
            "left": ([ones if i is None else i for _, i, _, _ in self.uses], []),
            "right": ([r for _, _, r, _ in self.uses], []),
            "exact": (self.exact, [self.errors[w] for w in self.exact]),
            "sketched": (sketched, [self.errors[w] for w in sketched]),
            "additive": ([], self.additive),
            "term": ([w for w, *_ in self.terms], [c for _, c, _ in self.terms]),
            "half": ([w for w, *_ in self.halves], [c for _, c, _, _ in self.halves]),
            "partner": ([p for _, _, p, _ in self.halves], []),
            "pair": ([w for w, *_ in self.pairs], [c for _, c, _, _ in self.pairs]),
            "first": ([i for *_, i, _ in self.pairs], []),
            "second": ([j for *_, j in self.pairs], []),
        }
        index, coefficient = _to_device(lists, device)
        table = torch.cat(
            [*(n[None] for n in self.norms), torch.ones(1, n_units, width, device=device)]
        )
        # S_u per use: Σ_t ‖L_t‖·‖R_t‖ in float64, raised past the norms' rounding
        sides = table.index_select(0, torch.cat([index["left"], index["right"]]))
        use_magnitude = sides.view(2, len(self.uses), n_units, width).prod(0)
        use_magnitude = use_magnitude.sum(-1, dtype=torch.float64).mul_(coefficient["use"][:, None])
        magnitude = torch.zeros(self.weights, n_units, **f64)
        magnitude.index_add_(0, index["use"], use_magnitude)
        bounds = Bounds(
            torch.zeros(n_units, **f64),
            magnitude.index_select(0, index["exact"]),
            torch.zeros(0, n_units, **f64),
            coefficient["exact"],
            magnitude.index_select(0, index["sketched"]),
            coefficient["sketched"],
        )
        if not self.exact:
            return bounds
        total = torch.zeros(len(self.exact), n_units, **f64)
        if self.terms:
            values = torch.stack([v for *_, v in self.terms])
            total.index_add_(0, index["term"], values * coefficient["term"][:, None])
        bound = torch.zeros_like(total)
        if self.halves:  # the quadratic forms' second halves: vᵀ(|G|w), float32
            halves = torch.stack([v for *_, v in self.halves])
            forms = (halves * table.index_select(0, index["partner"])).sum(-1).double()
            bound.index_add_(0, index["half"], forms * coefficient["half"][:, None])
        if self.pairs:  # (γ_Lγ_R + rounding)·S_i·S_j
            products = use_magnitude.index_select(0, index["first"])
            products *= use_magnitude.index_select(0, index["second"])
            bound.index_add_(0, index["pair"], products * coefficient["pair"][:, None])
        bounds.booked = total.sum(0)
        bounds.upper = bound.add_(total).clamp_min_(0).sqrt_()
        bounds.upper.addcmul_(coefficient["additive"][:, None], bounds.magnitude)
        return bounds


def _to_device(
    lists: dict[str, tuple[list[int], list[float]]], device: torch.device
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Named index (int64) and coefficient (float64) lists as views of one device tensor each."""
    indices = torch.tensor([i for ids, _ in lists.values() for i in ids], dtype=torch.long)
    values = torch.tensor([c for _, cs in lists.values() for c in cs], dtype=torch.float64)
    indices, values = indices.to(device), values.to(device)
    out_i, out_c, at_i, at_c = {}, {}, 0, 0
    for name, (ids, cs) in lists.items():
        out_i[name], out_c[name] = indices[at_i : at_i + len(ids)], values[at_c : at_c + len(cs)]
        at_i, at_c = at_i + len(ids), at_c + len(cs)
    return out_i, out_c


def _half(matrix: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """[u, T] float32 of |A|·w for A [u, T, T] and nonnegative w [u, T]: the first half of the
    quadratic form vᵀ|A|w (:meth:`BoundTerms.finish` takes the second; together low by at most
    γ_32(2T + 2) relative)."""
    return torch.bmm(matrix.abs(), right[:, :, None]).view(right.shape)


@dataclass
class Bounds:
    """One micro-batch's bound terms, [W, U] per exact (or sketched) weight: Σ of the exact
    weights' computed ‖M_u‖² (``booked``), S_u and an upper bound on ‖M_u‖ per exact weight, ε_bk
    per weight, S_u and ε_bk per sketched weight."""

    booked: torch.Tensor
    magnitude: torch.Tensor
    upper: torch.Tensor | None
    error: torch.Tensor
    sketched_magnitude: torch.Tensor
    sketched_error: torch.Tensor


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

    The engine collects these terms for all its weights in one :class:`BoundTerms`.
    """
    terms = BoundTerms(padded)
    terms.add_exact(uses, shape)
    bounds = terms.finish()
    return bounds.booked, bounds.upper[0], bounds.magnitude[0]


def uses_release_error(uses: Sequence[tuple[Factor, torch.Tensor]]) -> float:
    """ε_bk of a weight's book-keeping product (over its uses' token rows)."""
    return release_error(max(len(r) for _, r in uses), len(uses))


def clip_squared_norms(exact_bound: torch.Tensor, bounds: Bounds, n_units: int) -> torch.Tensor:
    """[U] B_u² for tensor-core mode. ``exact_bound``: Σ of the squared norms of what the
    retained and small parameters release (and of sketched weights' estimates); ``bounds``: the
    book-kept weights' terms (:meth:`BoundTerms.finish`). An exact weight adds
    (bound + ε_bk·S_u)²; the sketched weights' release errors, of norm at most ‖(ε_bk·S_u)_w‖
    together, are added to the norm: B = √(n̂ + …) + ‖(ε_bk·S_u)_w‖, so a unit releases at most
    C·max(1, ‖g_u‖/√n̂_u). The result is raised past float64's rounding, the float32 weighted sum
    of retained gradients over units and the clip factor's rounding to float32. One stacked
    computation for all weights (a few kernels, not a few per weight)."""
    total = exact_bound
    if len(bounds.upper):
        released = torch.addcmul(bounds.upper, bounds.error[:, None], bounds.magnitude)
        total = total + released.square().sum(0)
    norm = total.sqrt()
    if len(bounds.sketched_magnitude):
        errors = bounds.sketched_error[:, None] * bounds.sketched_magnitude
        norm = norm + errors.square().sum(0).sqrt()
    margin = FLOAT64_MARGIN * (1 + ieee_error(n_units)) * CLIP_FACTOR_ROUNDING
    return (norm * margin).square()
