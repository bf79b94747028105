"""Matrix products as exact as float32, for the vectorized engines' norms and clipped sums.

Clip factors are computed from the per-unit norms (:mod:`userdp.clients.norms`) and the clipped
sum is built from these products, so their precision is part of the sensitivity argument.

- ``tensor_cores=False`` (``workers.tensor_core_matmul = false``, and every float32 operand):
  IEEE float32 GEMMs (CUDA cores; TF32 and reduced-precision reductions switched off for the
  duration by :func:`exact_matmul`, whatever the caller's global settings say), so norms and
  sums carry float32 rounding only.
- ``tensor_cores=True`` (``workers.tensor_core_matmul``, the default; bf16 operands on CUDA):
  bf16 GEMMs with float32 output. Each product of two 8-bit significands is exact in float32,
  and a float32 operand that multiplies bf16 data (the book-keeping's c_t·R_t) is split into
  two bf16 parts, hi − rest, within 2^-16 relative (:func:`split_bf16`). The tensor cores'
  float32 ACCUMULATION is not IEEE (addends aligned and truncated inside each block FMA), so
  the engine clips each unit by a proven bound on what it releases
  (:mod:`userdp.clients.tensor_core_bound`).
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from userdp.clients.norms import Factor

_TENSOR_CORES: contextvars.ContextVar[bool] = contextvars.ContextVar("tensor_cores", default=False)


@contextlib.contextmanager
def exact_matmul(tensor_cores: bool = False) -> Iterator[None]:
    """float32 GEMMs in IEEE float32 (no TF32 on CUDA, no bf16/TF32 passes in oneDNN on CPU) and
    bf16 GEMMs without reduced-precision split-K reductions, whatever the caller set, restored on
    exit; ``tensor_cores`` lets bf16 operands use bf16 GEMMs (see the module docstring).

    Torch ≥ 2.9 has per-backend ``fp32_precision`` settings and refuses to READ its legacy flags
    once both APIs were used, so the new API is used alone where it exists."""
    token = _TENSOR_CORES.set(tensor_cores)
    cuda = torch.backends.cuda.matmul
    backends = [cuda, torch.backends.mkldnn.matmul]
    new_api = all(hasattr(b, "fp32_precision") for b in backends)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the legacy allow_tf32 flag warns in newer torch
        saved = [b.fp32_precision for b in backends] if new_api else [cuda.allow_tf32]
        saved_reduction = cuda.allow_bf16_reduced_precision_reduction
        if new_api:
            for backend in backends:
                backend.fp32_precision = "ieee"
        else:
            cuda.allow_tf32 = False
        cuda.allow_bf16_reduced_precision_reduction = False
    try:
        yield
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cuda.allow_bf16_reduced_precision_reduction = saved_reduction
            if new_api:
                for backend, value in zip(backends, saved, strict=True):
                    backend.fp32_precision = value
            else:
                cuda.allow_tf32 = saved[0]
        _TENSOR_CORES.reset(token)


def tensor_cores_active(device: torch.device) -> bool:
    """Tensor-core mode is on (:func:`exact_matmul`) and ``device`` is a GPU."""
    return _TENSOR_CORES.get() and device.type == "cuda"


def bf16_exact(*tensors: torch.Tensor) -> bool:
    """Tensor-core mode is on and all operands are bf16 on CUDA: products run as bf16 GEMMs with
    float32 output."""
    return _TENSOR_CORES.get() and all(t.is_cuda and t.dtype == torch.bfloat16 for t in tensors)


def bf16_rows(uses: Sequence[tuple[Factor, torch.Tensor]]) -> bool:
    """Every factor of a weight's ``uses`` goes to the tensor cores as the bf16 it is."""
    return all(bf16_exact(r) and (f.dense is None or bf16_exact(f.dense)) for f, r in uses)


def _pad(x: torch.Tensor, dim: int, multiple: int = 8) -> torch.Tensor:
    """``x`` with zeros appended along ``dim`` up to a multiple of ``multiple``."""
    extra = -x.shape[dim] % multiple
    if not extra:
        return x
    widths = [0, 0] * (x.dim() - dim % x.dim() - 1) + [0, extra]
    return torch.nn.functional.pad(x, widths)


def _align(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its memory-contiguous (stride-1) matrix dimension zero-padded to a multiple of
    8, keeping the orientation: a leading dimension that is not a multiple of 8 (GPT-2's
    vocabulary, 50257) sends cuBLAS to kernels several times slower."""
    if x.stride(-1) == 1:
        return _pad(x, -1)
    if x.stride(-2) == 1:
        return _pad(x.transpose(-1, -2), -1).transpose(-1, -2)
    return _pad(x.contiguous(), -1)


def mm32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` (2-D or batched 3-D) in float32 (see the module docstring).

    bf16 operands are first aligned (:func:`_align`); zeros add nothing to the sums and the
    padded rows/columns of the product are cut off."""
    if bf16_exact(a, b):
        m, n = a.shape[-2], b.shape[-1]
        if _is_transpose(b, a):  # a Gram x xᵀ: one padded copy serves both sides
            a = _align(a)
            b = a.transpose(-1, -2)
        else:
            a, b = _align(a), _align(b)
        if a.shape[-1] != b.shape[-2]:  # the inner dimension was padded on one side only
            k = max(a.shape[-1], b.shape[-2])
            a = _pad(a, -1, k) if a.shape[-1] < k else a
            b = _pad(b, -2, k) if b.shape[-2] < k else b
        op = torch.bmm if a.dim() == 3 else torch.mm
        out = op(a, b, out_dtype=torch.float32)
        return out[..., :m, :n]
    dtype = _at_least_float32(a, b)
    return torch.matmul(a.to(dtype), b.to(dtype))


def _is_transpose(b: torch.Tensor, a: torch.Tensor) -> bool:
    """``b`` is ``a``'s last two dimensions transposed, in the same memory."""
    return (
        b.data_ptr() == a.data_ptr()
        and b.shape == (*a.shape[:-2], a.shape[-1], a.shape[-2])
        and b.stride() == (*a.stride()[:-2], a.stride()[-1], a.stride()[-2])
    )


def _at_least_float32(*tensors: torch.Tensor) -> torch.dtype:
    """float32, or float64 when an operand is float64 (the tests' references)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def split_bf16(x: torch.Tensor, factor: torch.Tensor | None = None) -> torch.Tensor:
    """x = ``x`` (times ``factor`` [n, 1] when given) [n, d] as two bf16 parts concatenated on
    the last axis [n, 2d], x ≈ hi − rest: hi = bf16(x·c), rest = bf16(hi − x·c), both products
    and the difference formed in float32 (a fused multiply-add may skip the product's own
    rounding). |x·c − hi + rest| ≤ (2^-16 + 2^-24)·|x·c| (two 8-bit significands, and x·c's
    rounding to float32) and |hi| + |rest| ≤ (1 + 2^-7)·|x·c|. The rounding bound of tensor-core
    mode counts both (:func:`userdp.clients.tensor_core_bound.release_error`); a third part would
    cost a third more book-keeping FLOPs for an error far below the GEMM's.

    Two passes that read ``x`` and write bf16, no float32 temporary: hi, then rest by one
    ``addcmul`` (hi − x·c); the remainder is kept negated so that no pass negates it."""
    d = x.shape[-1]
    out = torch.empty(*x.shape[:-1], 2 * d, dtype=torch.bfloat16, device=x.device)
    hi, rest = out[..., :d], out[..., d:]
    if factor is None:
        hi.copy_(x)
        torch.sub(hi, x, out=rest)  # float32 hi − x (exact), rounded to bf16 as it is stored
    else:
        factor = factor.to(torch.float32)
        torch.mul(x, factor, out=hi)  # float32 x·c, rounded to bf16 as it is stored
        torch.addcmul(hi, x, factor, value=-1, out=rest)
    return out


def left_times_scaled(
    left: torch.Tensor, right: torch.Tensor, factor: torch.Tensor | None = None
) -> torch.Tensor:
    """Lᵀ (R ⊙ c) [d0, d1] float32 for dense ``left`` [n, d0], ``right`` [n, d1] and an optional
    per-row ``factor`` c [n, 1] (the book-keeping product; R·c is formed in float32): in
    tensor-core mode with a bf16 ``left`` on CUDA, one bf16 GEMM against the two-part split of
    R·c (:func:`split_bf16`, which forms the product itself), the parts' products subtracted;
    otherwise a float32 GEMM."""
    if bf16_exact(left):
        d1 = right.shape[1]
        parts = mm32(left.T, split_bf16(right, factor))
        return parts[:, :d1] - parts[:, d1:]
    dtype = _at_least_float32(left, right)
    right = right.to(dtype) if factor is None else right * factor.to(dtype)
    return left.to(dtype).T @ right


def scatter_rows(index: torch.Tensor, rows: torch.Tensor, num: int) -> torch.Tensor:
    """onehot(index)ᵀ · rows: a [num, d] float32 matrix whose row i sums the rows with index i.

    The embedding backward kernel (much faster than ``index_add_`` on CPU)."""
    return torch.ops.aten.embedding_dense_backward(rows.to(torch.float32), index, num, -1, False)


def add_scattered(
    total: torch.Tensor, unit: torch.Tensor, index: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """``total`` [U, num, d] float32 plus, per unit u, onehot(index)ᵀ · rows over the rows whose
    ``unit`` is u, in place. On CUDA the rows are added where they land (``index_put_`` with
    accumulation into :func:`row_view`): no dense temporary, whose write and add move U·num·d
    float32 four times (GPT-2's tied embedding: 0.6 GB per unit). On CPU they are scattered
    first (:func:`scatter_rows`) and added. Each row is added once to its own entry."""
    rows = rows.to(torch.float32)
    if not scatters_in_place(total):
        part = scatter_rows(index + unit * total.shape[1], rows, total.shape[0] * total.shape[1])
        return total.add_(part.view(total.shape))
    view = row_view(total)
    if view is None:  # padded rows: index_put_ takes any strides (by a copy of ``total``)
        return total.index_put_((unit, index), rows, accumulate=True)
    flat, rows_per_unit = view
    flat.index_put_((unit * rows_per_unit + index,), rows, accumulate=True)
    return total


def row_view(total: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """A contiguous [rows, d] view of the storage under ``total`` [U, num, d], whose units may
    sit ``rows_per_unit`` ≥ num rows apart (a padded GEMM's output cut to size), and
    ``rows_per_unit``; None where its rows are not dense (padded columns). CUDA's ``index_put_``
    copies a non-contiguous tensor whole and back, which :func:`add_scattered` avoids with this
    view."""
    units, num, d = total.shape
    dense_rows = total.stride(2) == 1 and (num <= 1 or total.stride(1) == d)
    if not dense_rows or total.stride(0) % max(d, 1):
        return None
    per_unit = total.stride(0) // max(d, 1) if units > 1 else num
    span = (units - 1) * per_unit + num  # the rows from the first unit's first to the last's
    return total.as_strided((span, d), (d, 1), total.storage_offset()), per_unit


def scatters_in_place(total: torch.Tensor) -> bool:
    """Where :func:`add_scattered` adds rows in place: a GPU."""
    return total.is_cuda
