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
