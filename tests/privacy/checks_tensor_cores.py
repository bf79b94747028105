"""The tensor-core norm bound, on CPU: the vectorized engine's clipping stays within C whatever the
tensor cores' accumulation does within the error model of ``clients/tensor_core_bound.py``.

With ``workers.tensor_core_matmul`` (the default) the engine's norm and book-keeping GEMMs run on
bf16 tensor cores, whose float32 accumulation is not IEEE. A norm that comes out low by r makes
the clip factor C/n̂ high by r, and a book-keeping product that comes out high by r' adds r' to
what the unit releases: either puts more than the sensitivity the noise is calibrated to into
the sum. The engine therefore clips each unit by a bound B_u on the norm of what it releases.

The GPU tests cannot run here, so this check runs the engine's own tensor-core branch on CPU
with every GEMM of the norms replaced by an ADVERSARIAL accumulation that stays inside the model:
products exact, then added one at a time (block size 1, the worst block size for the bound),
each step moving the running sum by the most the model allows, 2^{2−p} times the magnitudes it
adds: toward zero in the norm GEMMs (Gram products, per-unit gradients), away from zero in the
book-keeping product that releases the clipped sum (formed from the two-part bf16 split of the
scaled rows, as on a GPU). With p = 12 aligned bits instead of the
hardware's 24 these errors are about 6 % over the tiny model's dimensions, four orders of
magnitude over float32 rounding, so a bound that does not cover them shows at once. The engine's
bound is computed for the same p. Each unit of a real tiny GPT-2 is then clipped alone, with C
below every unit's norm, once per way of computing a weight's norm (ghost Gram products, a
materialized gradient normed and then released by book-keeping, retained per-unit gradients):

- what the unit releases has norm at most C;
- where the book-keeping releases it, the norm the engine clipped by is not below the unit's true
  norm (float64 autograd oracle). Retained gradients are released as computed, so their norm is
  the one that matters and may sit below the true one.

Tolerance: without the adversary the engine's norms and contributions agree with the float64
oracle and with C to ~1e-7 relative (float32 products, float64 sums of squares); 1e-5 leaves two
orders of magnitude for that rounding and is over three orders below the adversary's errors.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from userdp.clients import ghost, matmul_precision, norms, tensor_core_bound
from userdp.clients.engine import ClippingEngine

from .checks_clipping import _clip_norm_below, _model, _norm, _unit_gradient, _units

ALIGN_BITS = 12
"""p for the emulated tensor cores (the hardware keeps 24 or more)."""
REL_TOL = 1e-5
PATHS = ("ghost", "materialized", "retained")


def adversarial_matmul(a: torch.Tensor, b: torch.Tensor, direction: int) -> torch.Tensor:
    """a @ b (2-D or batched) accumulated one product at a time, each step moving the running
    sum by 2^{2−p}·(|sum| + |product|) toward zero (``direction`` −1) or away from it (+1): the
    largest error a block of one product may make under the model's alignment bound, leaving
    float32's own rounding of the result to the normalisation term."""
    a, b = a.double(), b.double()
    rate = 2.0 ** (2 - ALIGN_BITS)
    total = torch.zeros(torch.broadcast_shapes(a.shape[:-1] + (1,), b.shape[-1:]), dtype=a.dtype)
    for i in range(a.shape[-1]):
        product = a[..., :, i : i + 1] * b[..., i : i + 1, :]
        exact = total + product
        slack = rate * (total.abs() + product.abs())
        if direction < 0:
            total = exact.sign() * (exact.abs() - slack).clamp_min(0)
        else:
            total = exact + torch.where(exact >= 0, slack, -slack)
    return total.to(torch.float32)


def adversarial_book_keeping(left, right, factor=None):
    """The tensor-core book-keeping product Lᵀ(R ⊙ c) as the engine forms it on a GPU (the
    two-part bf16 split of R·c, one GEMM, the parts subtracted), with the GEMM accumulating away
    from zero."""
    parts = adversarial_matmul(left.T, matmul_precision.split_bf16(right, factor), 1)
    return parts[:, : right.shape[1]] - parts[:, right.shape[1] :]


@contextlib.contextmanager
def emulated_tensor_cores(path: str):
    """The engine's tensor-core branch on CPU with adversarial GEMMs (module docstring), every
    weight's norm taken the way ``path`` names."""
    patches = [
        mock.patch.object(ghost, "bound_applies", lambda params, device: True),
        mock.patch.object(tensor_core_bound, "ALIGN_BITS", ALIGN_BITS),
        mock.patch.object(norms, "mm32", lambda a, b: adversarial_matmul(a, b, -1)),
        mock.patch.object(norms, "left_times_scaled", adversarial_book_keeping),
        mock.patch.object(ghost, "retains_unit_gradients", lambda *args: path == "retained"),
        mock.patch.object(
            tensor_core_bound, "exact_norm_plan", lambda *args: (path == "ghost", 1 << 30)
        ),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def check_tensor_core_margin_covers_accumulation_error() -> None:
    units = _units()
    true_norms = [_norm(_unit_gradient(u)) for u in units]
    clip = _clip_norm_below(true_norms)
    engine = ClippingEngine(_model(), engine="vectorized", pad_id=0, tensor_core_matmul=True)
    engine.clipped_sum(units[:1], clip)  # the attribution check, on exact arithmetic
    assert engine.attribution_verified
    for path in PATHS:
        with emulated_tensor_cores(path):
            results = [engine.clipped_sum([unit], clip) for unit in units]
        for unit, true_norm, got in zip(units, true_norms, results, strict=True):
            used = got.stats.norm_sum
            released = _norm(got.sums)
            assert released <= clip * (1 + REL_TOL), (
                f"tensor-core mode (adversarial accumulation, p = {ALIGN_BITS}, {path} norms): "
                f"unit {unit.unit_id} releases {released:.8g} vs C = {clip:.8g} (ratio "
                f"{released / clip:.6f}): the engine's rounding bound does not cover the model"
            )
            assert path == "retained" or used >= true_norm * (1 - REL_TOL), (
                f"tensor-core mode ({path} norms): unit {unit.unit_id} was clipped by norm "
                f"{used:.8g} < its true norm {true_norm:.8g}"
            )


def check_clip_factor_rounding_is_on_the_safe_side() -> None:
    """The clip factor C/B_u reaches the book-keeping as float32, rounded either way by up to
    2⁻²⁴; the bound B_u is raised by its factor-rounding margin so that the ROUNDED factor times
    the bound without that margin is still at most C. Adversarial input: norms whose factor
    C/n rounds UP in float32 (a margin in the wrong direction, or none, then releases more than
    C on every one of them). Checked exactly (rationals) with the engine's own steps: the
    bound (:func:`~userdp.clients.tensor_core_bound.clip_squared_norms`, no book-kept weights),
    the factor (:meth:`~userdp.clients.clipping.Accumulator.record`'s ``clip_factor``) and the
    float32 tensor the book-keeping multiplies by."""
    from fractions import Fraction

    import numpy as np
    from userdp.clients.clipping import clip_factor

    clip = 1.0
    norms = np.random.default_rng(5).uniform(1.0, 4.0, 4096)
    exact = torch.tensor(norms, dtype=torch.float64).square()
    empty = torch.zeros(0, len(norms), dtype=torch.float64)
    bounds = tensor_core_bound.Bounds(
        booked=torch.zeros(len(norms), dtype=torch.float64),
        magnitude=empty,
        upper=empty,
        error=torch.zeros(0, dtype=torch.float64),
        sketched_magnitude=empty,
        sketched_error=torch.zeros(0, dtype=torch.float64),
    )
    with mock.patch.object(tensor_core_bound, "CLIP_FACTOR_ROUNDING", 1.0):
        covered_sq = tensor_core_bound.clip_squared_norms(exact, bounds, len(norms)).tolist()
    # adversarial: the bounds whose factor C/B would round UP in float32
    chosen = [
        i for i, s in enumerate(covered_sq) if float(np.float32(clip / s**0.5)) > clip / s**0.5
    ]
    assert len(chosen) >= 1000, f"precondition: only {len(chosen)} factors round up"
    clip_sq = tensor_core_bound.clip_squared_norms(exact, bounds, len(norms)).tolist()
    factors = torch.tensor(
        [clip_factor(clip_sq[i] ** 0.5, clip) for i in chosen], dtype=torch.float32
    ).tolist()
    worst = max(
        (Fraction(f) ** 2 * Fraction(covered_sq[i]), i)
        for f, i in zip(factors, chosen, strict=True)
    )
    assert worst[0] <= Fraction(clip) ** 2, (
        f"norm {norms[worst[1]]!r}: the float32 clip factor times the bound it covers is "
        f"C·(1 + {float(worst[0]) ** 0.5 - 1:.3e}) > C = {clip}: the clip factor's rounding "
        "margin is applied in the wrong direction (or not at all)"
    )


BOOK_ROWS, BOOK_LEFT, BOOK_RIGHT = 96, 24, 40


@contextlib.contextmanager
def bf16_gemms_on_cpu():
    """The engine's CUDA branch of the book-keeping product (bf16 ``left`` against the two-part
    bf16 split of R·c, the parts' products subtracted) dispatched on CPU: bf16 operands count as
    tensor-core operands, and the bf16 GEMM with float32 output is done as on the hardware's
    model (products exact, float64 accumulation, one rounding to float32; within (A1)-(A3))."""
    patches = [
        mock.patch.object(
            matmul_precision,
            "bf16_exact",
            lambda *tensors: all(t.dtype == torch.bfloat16 for t in tensors),
        ),
        mock.patch.object(
            matmul_precision, "mm32", lambda a, b: (a.double() @ b.double()).to(torch.float32)
        ),
    ]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


def check_split_book_keeping_product_within_its_bound() -> None:
    """The tensor-core book-keeping product Lᵀ(R ⊙ c) (:func:`~userdp.clients.matmul_precision.
    left_times_scaled`, CUDA branch on CPU) against a float64 reference: every entry within
    ε_bk·Σ_t |L_t,i|·|R_t,j·c_t| (:func:`~userdp.clients.tensor_core_bound.release_error`, the
    bound the clip relies on; about 4·10⁻⁵ here). Rows of R span six orders of magnitude and c is
    random, so R·c has full float32 significands: its first bf16 part alone errs by up to 2⁻⁸,
    far above the bound, and the split's second part must be there to meet it."""
    gen = torch.Generator().manual_seed(7)
    left = torch.randn(BOOK_ROWS, BOOK_LEFT, generator=gen).to(torch.bfloat16)
    scales = torch.logspace(-3, 3, BOOK_ROWS, dtype=torch.float32)[:, None]
    right = torch.randn(BOOK_ROWS, BOOK_RIGHT, generator=gen) * scales
    factor = torch.rand(BOOK_ROWS, 1, generator=gen).clamp_min(0.05)
    with bf16_gemms_on_cpu():
        got = matmul_precision.left_times_scaled(left, right, factor)
    scaled = right.double() * factor.double()  # R·c of the float32 values, exact in float64
    reference = left.double().T @ scaled
    magnitude = left.double().abs().T @ scaled.abs()
    bound = tensor_core_bound.release_error(BOOK_ROWS, 1) * magnitude
    excess = (got.double() - reference).abs() / bound
    worst = int(torch.argmax(excess))
    i, j = divmod(worst, BOOK_RIGHT)
    assert float(excess.max()) <= 1.0, (
        f"tensor-core book-keeping product, entry ({i}, {j}): error "
        f"{float((got.double() - reference).abs()[i, j]):.3e} is {float(excess.max()):.1f} times "
        f"its bound ε_bk·S = {float(bound[i, j]):.3e}: the split product of R·c is incomplete "
        "(a bf16 part dropped?)"
    )
