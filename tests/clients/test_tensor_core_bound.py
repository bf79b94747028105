"""The tensor-core rounding bound (clients/tensor_core_bound.py) against exact arithmetic, on
worst cases of its error model:

- a bit-level emulation of (A2), block FMAs that align their addends to the largest and truncate
  them to p bits, then normalise to float32 by truncation, on inputs built to lose the most
  (stagnation: an accumulator of 1 and products just under its last kept bit, every one of them
  truncated away), up to GPT-2's 50257-term vocabulary and for several block sizes;
- the model's own worst case, every step moving the sum by the most (A2) allows, for which the
  closed form must still hold;
- the per-unit bounds of a weight (ghost Gram products, materialized gradients, book-keeping
  release) for units whose tokens cancel (‖M‖ far below Σ‖L_t‖‖R_t‖), under adversarial GEMMs.

Exact references: ``math.fsum`` (the exact sum correctly rounded to float64: 1e-16 relative, far
below every bound here) and float64 products of float32 factors (exact: 48 significant bits).
"""

from __future__ import annotations

import math

import pytest
import torch
from userdp.clients import norms, tensor_core_bound
from userdp.clients.norms import Factor, Padded
from userdp.clients.tensor_core_bound import Bounds

from tests.privacy.checks_tensor_cores import ALIGN_BITS, adversarial_matmul


def _truncate(value: int, bits: int) -> int:
    """``value`` with all but its top ``bits`` significant bits cleared (toward zero)."""
    extra = abs(value).bit_length() - bits
    if extra <= 0:
        return value
    magnitude = (abs(value) >> extra) << extra
    return magnitude if value >= 0 else -magnitude


def block_fma_dot(products: list[float], block: int, align_bits: int) -> float:
    """Σ products as tensor cores compute it under (A2): per block, the accumulator and the
    block's products are aligned to the largest of them, truncated to ``align_bits`` bits of it,
    added exactly, and the sum is normalised to float32 by truncation."""
    total = 0.0
    for start in range(0, len(products), block):
        addends = [total, *products[start : start + block]]
        largest = max(addends, key=abs)
        if largest == 0:
            continue
        exponent = math.frexp(largest)[1]  # |largest| < 2^exponent
        scale = align_bits - exponent  # the kept bits are multiples of 2^-scale
        exact = sum(math.trunc(math.ldexp(x, scale)) for x in addends)
        total = math.ldexp(_truncate(exact, 24), -scale)
    return total


def _stagnation(n: int, align_bits: int) -> list[float]:
    """1, then n − 1 products (255/128)·2^-align_bits: each is below the last bit an accumulator
    near 1 keeps, so all of them are truncated away; bf16 factors (8 significant bits each)."""
    return [1.0] + [math.ldexp(255 / 128, -align_bits)] * (n - 1)


@pytest.mark.parametrize("block", [1, 4, 16])
@pytest.mark.parametrize("n", [768, 3072, 50257])
def test_stagnation_loses_a_fixed_share_of_the_bound_and_never_more(n, block):
    products = _stagnation(n, tensor_core_bound.ALIGN_BITS)
    exact = math.fsum(products)
    error = abs(block_fma_dot(products, block, tensor_core_bound.ALIGN_BITS) - exact)
    magnitude = math.fsum(abs(p) for p in products)
    bound = tensor_core_bound.dot_error(n) * magnitude
    assert error <= bound
    # a worst case: about 2^-23 per product is lost, n·2^-23 against the bound's 3.5·n·2^-23
    assert error >= 0.25 * bound


@pytest.mark.parametrize("align_bits", [12, 24, 27])
def test_more_aligned_bits_lose_less_and_stay_under_their_bound(align_bits):
    n = min(4096, 2 ** (align_bits - 6))  # n·2^(2-p) ≤ 1/16: where the bound is informative
    products = _stagnation(n, align_bits)
    error = abs(block_fma_dot(products, 8, align_bits) - math.fsum(products))
    bound = tensor_core_bound.dot_error(n, align_bits) * math.fsum(products)
    assert error <= bound
    # every product after the first is truncated away: the most alignment alone can lose
    assert error == pytest.approx((n - 1) * math.ldexp(255 / 128, -align_bits), rel=1e-12)


def test_mixed_signs_cancel_in_the_sum_but_not_in_the_bound():
    """Large terms of both signs that cancel, then small ones: the error is measured against
    Σ|p|, not against the (small) sum, and stays under γ(n)·Σ|p|."""
    n = 8192
    big = [math.ldexp(1 + k / 128, 4) * (-1) ** k for k in range(n // 2)]
    small = [math.ldexp(255 / 128, -22 + 4)] * (n // 2)
    products = [x for pair in zip(big, small, strict=True) for x in pair]
    error = abs(block_fma_dot(products, 16, 24) - math.fsum(products))
    assert error <= tensor_core_bound.dot_error(n) * math.fsum(abs(p) for p in products)
    assert error > 0


@pytest.mark.parametrize("direction", [-1, 1])
@pytest.mark.parametrize("n", [1, 16, 768, 50257])
def test_the_models_own_worst_case_is_inside_the_closed_form(n, direction):
    """Every step moving the running sum by the most (A2) allows (one product per block, the
    worst block size): the recursion compounds to at most γ(n)·Σ|p|."""
    products = torch.full((1, n), 0.75, dtype=torch.float64)
    ones = torch.ones((n, 1), dtype=torch.float64)
    computed = float(adversarial_matmul(products, ones, direction)[0, 0])
    exact = 0.75 * n
    rate = 2.0 ** (2 - ALIGN_BITS)
    error = abs(computed - exact)
    assert error <= tensor_core_bound.dot_error(n, ALIGN_BITS) * exact
    if n > 1:  # and the recursion really uses most of it
        assert error >= 0.5 * (math.expm1(n * rate) if direction > 0 else -math.expm1(-n * rate))


def test_dot_error_is_the_closed_form():
    assert tensor_core_bound.dot_error(0) == 0.0
    assert tensor_core_bound.dot_error(50257) == pytest.approx(math.expm1(50257 * 7 * 2.0**-24))
    assert tensor_core_bound.dot_error(768) < tensor_core_bound.dot_error(769)
    # IEEE float32's bound is the smaller one: an IEEE GEMM is covered too
    assert tensor_core_bound.ieee_error(50257) < tensor_core_bound.dot_error(50257)


def _cancelling_uses(tokens: int, d0: int, d1: int, onehot: bool) -> list[tuple[Factor, torch]]:
    """One use whose rows cancel: consecutive tokens carry (a, g) and (a, −g + small), so the
    unit's gradient Σ_t L_tᵀ R_t is small next to Σ_t ‖L_t‖‖R_t‖ (the Gram bound's hard case)."""
    gen = torch.Generator().manual_seed(tokens + d0)
    right = torch.randn(tokens // 2, d1, generator=gen).repeat_interleave(2, 0)
    right[1::2] = -right[1::2] + 1e-2 * torch.randn(tokens // 2, d1, generator=gen)
    if onehot:
        return [(Factor(None, torch.arange(tokens) // 2 % d0, d0), right)]
    left = torch.randn(tokens // 2, d0, generator=gen).repeat_interleave(2, 0)
    return [(Factor(left, None, d0), right)]


def _exact_unit_gradients(uses, spans, shape) -> list[torch.Tensor]:
    out = []
    for span in spans:
        total = torch.zeros(shape, dtype=torch.float64)
        for left, right in uses:
            r = right[span].double()
            if left.dense is None:
                total.index_add_(0, left.index[span], r)
            else:
                total += left.dense[span].double().T @ r
        out.append(total)
    return out


def _padded_norms(kind_and_rows) -> torch.Tensor:
    kind, rows = kind_and_rows
    if kind == "ids":
        return torch.ones(rows.shape, dtype=torch.float64)
    return rows.double().norm(dim=-1)


def adversarial_ghost_pairs(lefts, rights):
    """The exact Gram products with every entry moved by (just under) the most the model allows,
    each in the direction that lowers ĝL·ĝR: γ(d0)·‖L_s‖‖L_t‖ against the sign of the R entry
    and γ(d1)·‖R_s‖‖R_t‖ against the sign of the L entry; a pair with a onehot side keeps its
    exact L Gram."""
    gamma_right = 0.999 * tensor_core_bound.dot_error(rights[0].shape[-1])
    for times, i, j, gram_left, _ in norms.ghost_pairs(lefts, rights):
        right = rights[i].double() @ rights[j].double().transpose(1, 2)
        beta = (
            _padded_norms(("dense", rights[i]))[:, :, None]
            * _padded_norms(("dense", rights[j]))[:, None, :]
        )
        left = gram_left.double()
        if lefts[i][0] == lefts[j][0] == "dense":
            left = lefts[i][1].double() @ lefts[j][1].double().transpose(1, 2)
            alpha = _padded_norms(lefts[i])[:, :, None] * _padded_norms(lefts[j])[:, None, :]
            gamma_left = 0.999 * tensor_core_bound.dot_error(lefts[i][1].shape[-1])
            moved_left = left - gamma_left * alpha * right.sign()
        else:
            moved_left = left
        moved_right = right - gamma_right * beta * left.sign()
        yield times, i, j, moved_left.float(), moved_right.float()


@pytest.mark.parametrize("ghost", [True, False])
@pytest.mark.parametrize("onehot", [False, True])
def test_unit_bounds_cover_adversarial_gemms_on_cancelling_units(ghost, onehot, monkeypatch):
    """Each unit's upper bound on ‖M_u‖ holds under the model's worst rounding of the path's
    GEMMs (ghost: the Gram entries moved jointly against their product; materialized: every
    accumulation step toward zero), on units whose tokens cancel; S_u is Σ‖L_t‖‖R_t‖."""
    d0, d1, lengths = 24, 16, [8, 16, 12]
    spans, start = [], 0
    for length in lengths:
        spans.append(slice(start, start + length))
        start += length
    uses = _cancelling_uses(start, d0, d1, onehot)
    padded = Padded.of(spans, start, torch.device("cpu"))
    monkeypatch.setattr(tensor_core_bound, "ALIGN_BITS", ALIGN_BITS)
    monkeypatch.setattr(norms, "mm32", lambda a, b: adversarial_matmul(a, b, -1))
    monkeypatch.setattr(tensor_core_bound, "ghost_pairs", adversarial_ghost_pairs)
    monkeypatch.setattr(tensor_core_bound, "exact_norm_plan", lambda *args: (ghost, 1 << 30))
    computed, upper, magnitude = tensor_core_bound.bounded_exact_squared_norms(
        uses, padded, (d0, d1)
    )
    for j, exact in enumerate(_exact_unit_gradients(uses, spans, (d0, d1))):
        norm = float(exact.norm())
        want = 0.0
        for left, right in uses:
            rows = torch.ones(len(right)) if left.dense is None else left.dense.double().norm(dim=1)
            want += float((rows[spans[j]].double() * right[spans[j]].double().norm(dim=1)).sum())
        # S_u, raised past the float32 row norms' rounding (a few 1e-6 at these widths) and
        # float64's (FLOAT64_MARGIN, 7.6e-6)
        assert want <= float(magnitude[j]) <= want * (1 + 3e-5)
        assert want > 5 * norm  # the tokens do cancel
        # the adversary moved the dense GEMMs' norms (a onehot side is a scatter, or an exact
        # Gram of 0s and 1s)
        assert onehot or abs(float(computed[j]) - norm**2) > 1e-2 * norm**2
        assert float(upper[j]) >= norm


def test_clip_norms_add_each_weights_release_and_combine_sketched_errors_as_one_vector():
    """Exact weights: B² = Σ (bound_w + ε_w·S_w)² plus the retained parameters' squared norms;
    sketched weights: B = √(n̂ + retained) + ‖(ε_w·S_w)_w‖ (their errors are orthogonal
    components of one release); both raised by the named margins only."""
    retained = torch.tensor([4.0, 0.0], dtype=torch.float64)
    upper = torch.tensor([[1.0, 2.0], [3.0, 0.5]], dtype=torch.float64)
    magnitude = torch.tensor([[10.0, 20.0], [5.0, 1.0]], dtype=torch.float64)
    error = torch.tensor([0.01, 0.1], dtype=torch.float64)
    none = torch.zeros(0, 2, dtype=torch.float64)
    margin = (
        tensor_core_bound.FLOAT64_MARGIN
        * (1 + tensor_core_bound.ieee_error(2))
        * tensor_core_bound.CLIP_FACTOR_ROUNDING
    )
    exact = Bounds(retained, magnitude, upper, error, none, error[:0])
    got = tensor_core_bound.clip_squared_norms(retained, exact, 2)
    want = retained + ((upper + error[:, None] * magnitude) ** 2).sum(0)
    torch.testing.assert_close(got, want * margin**2, rtol=1e-12, atol=0)
    sketched = Bounds(retained, none, none, error[:0], magnitude, error)
    got = tensor_core_bound.clip_squared_norms(retained, sketched, 2)
    errors = (error[:, None] * magnitude).square().sum(0).sqrt()
    torch.testing.assert_close(got, ((retained.sqrt() + errors) * margin) ** 2, rtol=1e-12, atol=0)


def _reference_upper(uses, spans, width, ghost: bool) -> torch.Tensor:
    """docs/worker.md's upper bound on ‖M_u‖ per unit, written out in float64 one unit and one
    pair of uses at a time (no margins for the bound's own float32/float64 arithmetic, which move
    it by well under 1e-6 relative here)."""
    out = []
    for span in spans:
        rows = []
        for left, right in uses:
            r = right[span].double()
            if left.dense is None:
                idx = left.index[span]
                rows.append((None, idx, torch.ones(len(r), dtype=torch.float64), r))
            else:
                x = left.dense[span].double()
                rows.append((x, None, x.norm(dim=1), r))
        magnitudes = [(nl * r.norm(dim=1)).sum() for _, _, nl, r in rows]
        if not ghost:
            total = sum(
                (
                    x.T @ r
                    if x is not None
                    else torch.zeros(9, r.shape[1]).double().index_add(0, i, r)
                )
                for x, i, _, r in rows
            )
            gamma = tensor_core_bound.dot_error(width * len(uses))
            out.append(float(total.norm()) + gamma * float(sum(magnitudes)))
            continue
        squared = 0.0
        for i in range(len(rows)):
            for j in range(i + 1):
                times = 1 if i == j else 2
                (xi, ii, nli, ri), (xj, ij, nlj, rj) = rows[i], rows[j]
                if xi is not None and xj is not None:
                    gram_left = xi @ xj.T
                elif xi is None and xj is None:
                    gram_left = (ii[:, None] == ij[None, :]).double()
                elif xi is None:
                    gram_left = xj[:, ii].T
                else:
                    gram_left = xi[:, ij]
                gram_right = ri @ rj.T
                gamma_left = (
                    tensor_core_bound.dot_error(xi.shape[1])
                    if xi is not None and xj is not None
                    else 0.0
                )
                gamma_right = tensor_core_bound.dot_error(ri.shape[1])
                squared += times * float((gram_left * gram_right).sum())
                beta = ri.norm(dim=1) @ gram_left.abs() @ rj.norm(dim=1)
                squared += times * gamma_right * float(beta)
                squared += times * gamma_left * float(nli @ gram_right.abs() @ nlj)
                squared += times * gamma_left * gamma_right * float(magnitudes[i] * magnitudes[j])
        out.append(max(squared, 0.0) ** 0.5)
    return torch.tensor(out, dtype=torch.float64)


def test_bound_terms_of_many_weights_equal_each_weights_own_bound(monkeypatch):
    """The engine collects every weight's bound terms and combines them at once: the result is
    each weight's own bound, written out unit by unit (ghost in chunks of two units, a tied
    onehot + dense weight, a materialized one), and a sketched weight's S_u. At p = 12 the
    bound's terms are large enough (γ ≈ 0.5 %) that a term counted twice, or a quadratic form
    taken with the wrong norms, moves the bound by far more than the tolerance."""
    monkeypatch.setattr(tensor_core_bound, "ALIGN_BITS", ALIGN_BITS)
    lengths = [5, 7, 4]
    spans, start = [], 0
    for length in lengths:
        spans.append(slice(start, start + length))
        start += length
    padded = Padded.of(spans, start, torch.device("cpu"))
    gen = torch.Generator().manual_seed(5)

    def dense(d0, d1):
        return (Factor(torch.randn(start, d0, generator=gen), None, d0), torch.randn(start, d1))

    tied = [
        (Factor(None, torch.randint(0, 9, (start,), generator=gen), 9), torch.randn(start, 3)),
        (Factor(torch.randn(start, 9, generator=gen), None, 9), torch.randn(start, 3)),
    ]
    weights = [([dense(6, 5)], (6, 5)), (tied, (9, 3)), ([dense(4, 3)], (4, 3))]
    sketched = [dense(7, 2)]
    plans = {(6, 5): (True, 2), (9, 3): (True, 1 << 30), (4, 3): (False, 1 << 30)}
    monkeypatch.setattr(tensor_core_bound, "exact_norm_plan", lambda u, p, s: plans[tuple(s)])
    terms = tensor_core_bound.BoundTerms(padded)
    terms.add_exact(*weights[0])
    terms.add_sketched(sketched)
    for uses, shape in weights[1:]:
        terms.add_exact(uses, shape)
    got = terms.finish()
    booked = torch.zeros(len(lengths), dtype=torch.float64)
    for w, (uses, shape) in enumerate(weights):
        ghost = plans[tuple(shape)][0]
        want = _reference_upper(uses, spans, max(lengths), ghost)
        torch.testing.assert_close(got.upper[w], want, rtol=1e-6, atol=0)
        for j, span in enumerate(spans):
            unit = [(f.select(span), r[span]) for f, r in uses]
            booked[j] += norms.ghost_squared_norm(unit)
            want = sum(
                float(
                    (f.times(torch.eye(f.dim)).norm(dim=1).double() * r.double().norm(dim=1)).sum()
                )
                for f, r in unit
            )
            assert want <= float(got.magnitude[w, j]) <= want * (1 + 3e-5)
        assert float(got.error[w]) == tensor_core_bound.uses_release_error(uses)
    torch.testing.assert_close(got.booked, booked, rtol=1e-6, atol=0)
    ((left, right),) = sketched
    rows = left.dense.norm(dim=1).double() * right.norm(dim=1).double()
    want = torch.stack([rows[span].sum() for span in spans])
    assert (got.sketched_magnitude[0] >= want).all()
    assert (got.sketched_magnitude[0] <= want * (1 + 3e-5)).all()
    assert float(got.sketched_error[0]) == tensor_core_bound.uses_release_error(sketched)
    assert got.upper.shape == (3, 3) and got.sketched_magnitude.shape == (1, 3)
