"""Noise mechanisms: iid Gaussian here, BLT correlated noise in :mod:`userdp.strategies.blt`.

A noise mechanism turns the step's sum of clipped updates into the released noisy sum:
    iid:        summed + std · z_t,            z_t ~ N(0, I)
    correlated: summed + std · (C⁻¹ Z)_t,      Z rows ~ N(0, I)     (DP-FTRL / matrix mechanism)
with std = noise_multiplier · clip_norm (correlated: times the sensitivity of C, folded in by the
strategy).

Randomness: :class:`NoiseRng` seeds numpy's PCG64 and torch generators from ``os.urandom`` at
construction and again after every :meth:`NoiseMechanism.load_state_dict`, so noise is never
replayed across a retry or a resume, and never derived from a config seed. Tests can build a
deterministic one with :meth:`NoiseRng.for_testing`, which logs a NOT PRIVATE warning.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np
from userdp.strategies import tensors as T

__all__ = ["GaussianNoise", "NoiseMechanism", "NoiseRng"]

log = logging.getLogger(__name__)


def _urandom_seed() -> int:
    return int.from_bytes(os.urandom(16), "little")


class NoiseRng:
    """Standard-normal draws shaped like a numpy array or torch tensor (same device/dtype).

    Production: seeded from 128 bits of ``os.urandom``. ``for_testing(seed)``: deterministic, for
    tests only; on :meth:`reseed` it moves to a new deterministic stream, never back to an old one.
    """

    def __init__(self, *, _test_seed: int | None = None) -> None:
        self._test_seed = _test_seed
        self._reseeds = 0
        self._seed(_urandom_seed() if _test_seed is None else _test_seed)

    @classmethod
    def for_testing(cls, seed: int) -> NoiseRng:
        log.warning("NoiseRng.for_testing(%d): deterministic noise, NOT PRIVATE", seed)
        return cls(_test_seed=int(seed))

    @property
    def deterministic(self) -> bool:
        return self._test_seed is not None

    def _seed(self, entropy: int | list[int]) -> None:
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
        """One N(0, 1) draw (for scalar releases such as a noisy count)."""
        return float(self._numpy.standard_normal())

    def normal_like(self, x: Any) -> Any:
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


class NoiseMechanism(ABC):
    """Adds the step's noise to a tensor dict. Checkpointable state excludes the RNG."""

    def __init__(self, rng: NoiseRng | None = None) -> None:
        self.rng = rng if rng is not None else NoiseRng()

    @abstractmethod
    def sample(self, step: int, like: Mapping[str, Any]) -> dict[str, Any]:
        """The unit-variance-scale noise for ``step``, shaped like ``like`` (before × std)."""

    def add(self, step: int, summed: Mapping[str, Any], *, std: float) -> dict[str, Any]:
        """``summed + std · sample(step)`` as a new dict (inputs untouched)."""
        noise = self.sample(step, summed)
        out: dict[str, Any] = {}
        for name, value in summed.items():
            z = noise[name]
            if T.is_torch(value):
                out[name] = value + (std * z).to(value.dtype)
            else:
                out[name] = np.asarray(value) + std * z
        return out

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.rng.reseed()


class GaussianNoise(NoiseMechanism):
    """iid Gaussian noise: z_t ~ N(0, I), independent across steps (DP-SGD)."""

    def sample(self, step: int, like: Mapping[str, Any]) -> dict[str, Any]:
        return {name: self.rng.normal_like(value) for name, value in like.items()}
