"""Noise mechanisms: iid Gaussian here, BLT correlated noise in :mod:`userdp.strategies.blt`.

A noise mechanism turns the step's sum of clipped updates into the released noisy sum:
    iid:        summed + std · z_t,            z_t ~ N(0, I)
    correlated: summed + std · (C⁻¹ Z)_t,      Z rows ~ N(0, I)     (DP-FTRL / matrix mechanism)
with std = noise_multiplier · clip_norm (correlated: times the sensitivity of C, folded in by the
strategy).

Randomness: :class:`NoiseRng` is keyed from ``os.urandom`` at construction and again after
every :meth:`NoiseMechanism.load_state_dict`, so noise is never replayed across a retry or a
resume, and never derived from a config seed. By default it is *secure*
(:mod:`userdp.strategies.secure_random`): draws from an AES-256-CTR keystream and releases rounded
onto a grid finer than std/256, so neither a predictable generator nor the low-order bits of
floating-point sums leak the input. ``secure=False`` (config ``privacy.secure_noise = false``)
uses numpy's PCG64 and torch's generators, seeded from 256 bits of ``os.urandom``: faster, but
exposed to both. Tests can build a deterministic one with :meth:`NoiseRng.for_testing`, which logs
a NOT PRIVATE warning.
"""

from __future__ import annotations

import hashlib
import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np
from userdp.accounting.facts import DETERMINISTIC_NOISE_CAVEAT, FAST_NOISE_CAVEAT
from userdp.strategies import tensors as T
from userdp.strategies.secure_random import SecureNormal, add_on_grid

__all__ = [
    "DETERMINISTIC_NOISE_CAVEAT",
    "FAST_NOISE_CAVEAT",
    "GaussianNoise",
    "NoiseMechanism",
    "NoiseRng",
    "noise_mode",
]

log = logging.getLogger(__name__)


def _urandom_seed() -> int:
    """256 bits of ``os.urandom``: the only entropy a production :class:`NoiseRng` uses."""
    return int.from_bytes(os.urandom(32), "little")


class NoiseRng:
    """Standard-normal draws shaped like a numpy array or torch tensor (same device), and the
    release ``value + std·z`` built from them.

    ``secure=True`` (the default): AES-256-CTR keystream keyed by SHA-256 of that entropy, float64 draws,
    releases on the grid of :func:`~userdp.strategies.secure_random.add_on_grid`.
    ``secure=False``: PCG64/torch generators seeded from 256 bits of ``os.urandom``, draws in the
    value's float dtype, releases computed in that dtype.
    ``for_testing(seed)``: deterministic, for tests only; on :meth:`reseed` it moves to a new
    deterministic stream, never back to an old one.
    """

    def __init__(self, *, secure: bool = True, _test_seed: int | None = None) -> None:
        self.secure = bool(secure)
        self._test_seed = _test_seed
        self._reseeds = 0
        self._seed(_urandom_seed() if _test_seed is None else _test_seed)

    @classmethod
    def for_testing(cls, seed: int, *, secure: bool = False) -> NoiseRng:
        log.warning("NoiseRng.for_testing(%d): deterministic noise, NOT PRIVATE", seed)
        return cls(secure=secure, _test_seed=int(seed))

    @property
    def deterministic(self) -> bool:
        return self._test_seed is not None

    def _seed(self, entropy: int | list[int]) -> None:
        if self.secure:  # the AES key is a hash of the entropy; neither is kept anywhere else
            self._secure = SecureNormal(hashlib.sha256(repr(entropy).encode()).digest())
            return
        self._root = np.random.SeedSequence(entropy)
        self._numpy = np.random.Generator(np.random.PCG64(self._root.spawn(1)[0]))
        self._torch: dict[str, Any] = {}

    def reseed(self) -> None:
        """Drop the current stream for a fresh one (urandom; tests: the next fixed stream)."""
        self._reseeds += 1
        if self._test_seed is None:
            self._seed(_urandom_seed())
        else:
            self._seed([self._test_seed, self._reseeds])

    def standard_normal(self) -> float:
        """One N(0, 1) draw."""
        if self.secure:
            return float(self._secure.standard_normal(1)[0])
        return float(self._numpy.standard_normal())

    def exponential(self, n: int) -> np.ndarray:
        """``n`` iid Exp(1) draws as (Z₁² + Z₂²)/2 from this generator's N(0, 1) stream (a χ²₂/2
        is Exp(1)), so they are as secure, fast or deterministic as its Gaussian draws."""
        z = np.asarray(self.normal_like(np.zeros((int(n), 2))), dtype=np.float64)
        return 0.5 * np.sum(z * z, axis=1)

    def laplace(self, scale: float) -> float:
        """One Laplace(0, ``scale``) draw: scale·(E₁ − E₂), E₁, E₂ iid Exp(1)."""
        e = self.exponential(2)
        return float(scale * (e[0] - e[1]))

    def uniform(self, n: int) -> np.ndarray:
        """``n`` iid Uniform(0, 1) draws: exp(−E), E ~ Exp(1)."""
        return np.exp(-self.exponential(n))

    def noisy_scalar(self, value: float, std: float) -> float:
        """``value + std·z`` for one scalar release (e.g. a noisy count), on the grid if secure."""
        return float(self.release(np.float64(value), std, self.standard_normal()))

    def normal_like(self, x: Any) -> Any:
        """N(0, 1) draws shaped like ``x`` (secure: float64; fast: ``x``'s float dtype)."""
        if self.secure:
            return self._secure.normal_like(x)
        if T.is_torch(x):
            import torch

            key = str(x.device)
            gen = self._torch.get(key)
            if gen is None:
                seed = int(self._root.spawn(1)[0].generate_state(1, np.uint64)[0] >> 1)
                gen = torch.Generator(device=x.device).manual_seed(seed)
                self._torch[key] = gen
            dtype = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
            return torch.randn(x.shape, generator=gen, dtype=dtype, device=x.device)
        x = np.asarray(x)
        dtype = x.dtype if x.dtype in (np.float32, np.float64) else np.float64
        return self._numpy.standard_normal(x.shape, dtype=dtype)

    def release(self, value: Any, std: float, z: Any) -> Any:
        """``value + std·z`` in ``value``'s type (secure: rounded onto the grid)."""
        if self.secure:
            return add_on_grid(value, std, z)
        if T.is_torch(value):
            if not value.is_floating_point():  # noise is never truncated to an integer type
                value = value.double()
            return value + (std * z).to(value.dtype)
        return np.asarray(value) + std * z


def noise_mode(mechanism: Any) -> str | None:
    """How a noise mechanism draws (the ledger's ``noise`` field): ``"test"`` for a fixed test
    seed, ``"secure"`` or ``"fast"``; None when it does not use a :class:`NoiseRng`."""
    rng = getattr(mechanism, "rng", None)
    if not isinstance(rng, NoiseRng):
        return None
    if rng.deterministic:
        return "test"
    return "secure" if rng.secure else "fast"


class NoiseMechanism(ABC):
    """Adds the step's noise to a tensor dict. Checkpointable state excludes the RNG."""

    def __init__(self, rng: NoiseRng | None = None) -> None:
        self.rng = rng if rng is not None else NoiseRng()

    @abstractmethod
    def sample(self, step: int, like: Mapping[str, Any]) -> dict[str, Any]:
        """The unit-variance-scale noise for ``step``, shaped like ``like`` (before × std)."""

    def add(self, step: int, summed: Mapping[str, Any], *, std: float) -> dict[str, Any]:
        """``summed + std · sample(step)`` as a new dict (inputs untouched; see
        :meth:`NoiseRng.release`)."""
        noise = self.sample(step, summed)
        return {name: self.rng.release(value, std, noise[name]) for name, value in summed.items()}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rng.reseed()


class GaussianNoise(NoiseMechanism):
    """iid Gaussian noise: z_t ~ N(0, I), independent across steps (DP-SGD)."""

    def sample(self, step: int, like: Mapping[str, Any]) -> dict[str, Any]:
        return {name: self.rng.normal_like(value) for name, value in like.items()}
