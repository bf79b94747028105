"""Secure Gaussian noise: draws from a cryptographic keystream, releases on a fixed grid.

Two weaknesses of textbook floating-point noise are closed here.

* **Predictable generators.** PCG64 or a Mersenne twister can be reconstructed from enough of
  their outputs, and the noisy releases are outputs. :class:`SecureNormal` takes its bits from
  AES-256 in counter mode keyed from 256 bits of ``os.urandom`` (the ``cryptography`` package):
  without the key the stream cannot be told apart from uniform bits.
* **Least significant bits.** In floating point the set of values ``x + noise`` can take depends
  on ``x``, so the low-order bits of a release can identify the input (Mironov, "On Significance
  of the Least Significant Bits for Differential Privacy", CCS 2012, §3). :func:`add_on_grid`
  rounds every release to the grid γℤ, γ = 2^(⌊log₂ std⌋ − GRID_BITS): the values a release can
  take do not depend on the input.

The Gaussian draw is Box–Muller in float64 on 53-bit uniforms, with the radius' uniform refined
to 106 bits when it is below 2⁻²¹, so the tail reaches |z| ≈ 12.1 (the ideal Gaussian puts less
than 10⁻³² beyond it). Accounting needs no change: rounding the Gaussian mechanism's output is
post-processing. What remains of floating point is the rounding of ``x + std·z`` at the edges of a
grid cell: each grid value's probability differs from the ideal mechanism's by a relative error of
order 2⁻⁵²·(|x|/γ + 2^(GRID_BITS+1)·|z|), far below anything an accountant resolves; this module does
not claim bit-exact sampling (an exact discrete Gaussian, Canonne, Kamath & Steinke, "The Discrete
Gaussian for Differential Privacy", NeurIPS 2020, costs integer arithmetic per coordinate).
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from userdp.strategies import tensors as T

__all__ = ["GRID_BITS", "SecureNormal", "add_on_grid", "grid_step"]

GRID_BITS = 8
"""The grid step is between std/2^(GRID_BITS+1) and std/2^GRID_BITS: it adds a variance of at
most γ²/4 ≤ std²·2⁻¹⁸ to the release, and keeps cell edges far from float resolution."""

_CHUNK = 1 << 16  # Box–Muller pairs per block: small buffers, few Python iterations
_MASK53 = (1 << 53) - 1
_TWO_M53 = 2.0**-53
_REFINE_BELOW = float(1 << 32)  # u₁ ≤ 2⁻²¹: draw 53 more bits for its tail
_GRID_CHUNK = 1 << 20  # coordinates per block when rounding onto the grid


def grid_step(std: float) -> float:
    """γ = 2^(⌊log₂ std⌋ − GRID_BITS): a power of two, so multiples of it are exact floats."""
    if not (std > 0.0 and math.isfinite(std)):
        raise ValueError(f"noise std must be positive and finite, got {std}")
    return math.ldexp(1.0, math.frexp(std)[1] - 1 - GRID_BITS)


class SecureNormal:
    """Standard normal draws from an AES-256-CTR keystream.

    ``key``: 32 bytes (:class:`~userdp.strategies.noise.NoiseRng` passes a SHA-256 of 256 bits of
    ``os.urandom``, or of a test seed); None draws one from ``os.urandom``. Never written anywhere.
    """

    def __init__(self, key: bytes | None = None) -> None:
        key = os.urandom(32) if key is None else bytes(key)
        if len(key) != 32:
            raise ValueError(f"SecureNormal key must be 32 bytes, got {len(key)}")
        self._encryptor = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
        self._zeros = bytearray(16 * _CHUNK)
        self._out = bytearray(16 * _CHUNK + 15)

    def _words(self, count: int) -> Any:
        """``count`` fresh 64-bit keystream words as an int64 tensor (a copy)."""
        import torch

        size = 8 * count
        zeros = self._zeros if size <= len(self._zeros) else bytearray(size)
        out = self._out if size + 15 <= len(self._out) else bytearray(size + 15)
        self._encryptor.update_into(memoryview(zeros)[:size], out)
        return torch.frombuffer(out, dtype=torch.int64, count=count).clone()

    def standard_normal(self, n: int) -> Any:
        """``n`` iid N(0, 1) draws as a float64 CPU tensor."""
        import torch

        out = torch.empty(n, dtype=torch.float64)
        pairs = (n + 1) // 2
        for start in range(0, pairs, _CHUNK):
            m = min(_CHUNK, pairs - start)
            words = self._words(2 * m)
            hi = (words[:m] & _MASK53).to(torch.float64)
            angle = (words[m:] & _MASK53).to(torch.float64).mul_(2.0 * math.pi * _TWO_M53)
            u1 = (hi + 1.0).mul_(_TWO_M53)  # (0, 1]
            small = torch.nonzero(hi < _REFINE_BELOW).flatten()
            if small.numel():
                lo = (self._words(small.numel()) & _MASK53).to(torch.float64)
                u1[small] = (hi[small] + (lo + 1.0) * _TWO_M53) * _TWO_M53
            radius = u1.log_().mul_(-2.0).sqrt_()
            first = out[2 * start : 2 * start + m]
            torch.mul(radius[: first.numel()], torch.cos(angle[: first.numel()]), out=first)
            second = out[2 * start + m : 2 * (start + m)]
            k = second.numel()
            torch.mul(radius[:k], torch.sin(angle[:k]), out=second)
        return out

    def normal_like(self, x: Any) -> Any:
        """N(0, 1) draws shaped like ``x``: float64, on ``x``'s device for a tensor."""
        if T.is_torch(x):
            return self.standard_normal(x.numel()).reshape(x.shape).to(x.device)
        shape = np.shape(x)
        return self.standard_normal(math.prod(shape)).numpy().reshape(shape)


def add_on_grid(value: Any, std: float, z: Any) -> Any:
    """γ·round((value + std·z)/γ), computed in float64, returned in ``value``'s float dtype
    (float64 for integer inputs); ``z`` are unit-variance draws of ``value``'s shape."""
    step = grid_step(std)
    if T.is_torch(value):
        import torch

        dtype = value.dtype if value.is_floating_point() else torch.float64
        flat_value, flat_z = value.reshape(-1), z.reshape(-1)
        out = torch.empty(value.shape, dtype=dtype, device=value.device)
        flat_out = out.view(-1)
        wide = torch.empty(
            min(_GRID_CHUNK, flat_value.numel()), dtype=torch.float64, device=value.device
        )
        for start in range(0, flat_value.numel(), _GRID_CHUNK):
            part = slice(start, start + _GRID_CHUNK)
            w = wide[: flat_value[part].numel()]
            w.copy_(flat_value[part]).div_(step)
            w.add_(flat_z[part].to(device=w.device, dtype=torch.float64), alpha=std / step)
            flat_out[part] = w.round_().mul_(step)
        return out
    value = np.asarray(value)
    wide = np.round(np.asarray(value, dtype=np.float64) / step + (std / step) * np.asarray(z))
    dtype = value.dtype if np.issubdtype(value.dtype, np.floating) else np.float64
    return (wide * step).astype(dtype, copy=False)
