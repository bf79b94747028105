"""Probe matrices for the randomized engine's Hutchinson norm sketches (DP-SGD-RC: Ullah et al.,
"Efficient DP-SGD for LLMs with Randomized Clipping").

For a weight gradient M (d0 × d1) the sketch is n̂ = ‖Mᵀ P‖²_F with P ∈ ℝ^{d0×k} and
P_ij ~ N(0, 1/k) i.i.d.: E n̂ = ‖M‖²_F and n̂ has EXACTLY the law Σ_j λ_j χ²_j(k)/k over the
squared singular values λ_j of M (rotation invariance of the Gaussian), which is what the
accountant (accounting/randomized_clipping.py) assumes. Gaussian, not Rademacher: ±1 probes are
also unbiased but have a different law, for which the envelope was not derived.

RNG hygiene (the accountant's analysis needs probes that are independent of the data and fresh
every step; it may hand them to the adversary): the generator is seeded from ``os.urandom`` for
every task (``clipped_sum`` call) and every draw is fresh (per micro-batch and per weight); the
probes never depend on the data and never share a stream with the coordinator's noise. A fixed
``seed`` exists for statistical tests only. :class:`IdentityProbes` (P = I, k = d0) makes the
sketch exact: the test mode in which the randomized engine must equal ``loop``.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch


class ProbeSource(Protocol):
    def draw(self, dim: int, device: torch.device) -> torch.Tensor:
        """A [dim, k] float32 probe matrix on ``device``."""
        ...


class GaussianProbes:
    """P ~ N(0, 1/k)^{dim×k}, fresh per draw; os.urandom-seeded unless ``seed`` (tests only)."""

    def __init__(self, probes: int, seed: int | None = None) -> None:
        if probes < 1:
            raise ValueError(f"Hutchinson needs at least 1 probe, got {probes}")
        self.probes = int(probes)
        self.seed = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed)
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        if key not in self._generators:
            generator = torch.Generator(device=device)
            generator.manual_seed(self.seed)
            self._generators[key] = generator
        return self._generators[key]

    def draw(self, dim: int, device: torch.device) -> torch.Tensor:
        probe = torch.randn((dim, self.probes), generator=self._generator(device), device=device)
        return probe.mul_(self.probes**-0.5)


class IdentityProbes:
    """P = I: the exact sketch ‖MᵀI‖² = ‖M‖² (test mode; equals the exact engines)."""

    def draw(self, dim: int, device: torch.device) -> torch.Tensor:
        return torch.eye(dim, device=device)
