"""Probe matrices and norm sketches for the randomized engine (DP-SGD-RC: Ullah et al.,
"Efficient DP-SGD for LLMs with Randomized Clipping").

For a weight gradient M (d0 × d1) two estimators of ‖M‖²_F are available (``SKETCHES``):

- ``"hutchinson"``: n̂ = ‖Mᵀ P‖²_F with P ∈ ℝ^{d0×k}, P_ij ~ N(0, 1/k) i.i.d.: E n̂ = ‖M‖²_F and
  n̂ has EXACTLY the law Σ_j λ_j χ²_j(k)/k over the squared singular values λ_j of M (rotation
  invariance of the Gaussian), which is what the accountant (accounting/randomized_clipping.py)
  assumes.
- ``"hutch++"`` (Meyer, Musco, Musco, Woodruff, "Hutch++: Optimal Stochastic Trace Estimation"):
  a second, independent S ∈ ℝ^{d0×k} finds Q = orth(M Mᵀ S); n̂ = ‖MᵀQ‖² + ‖Mᵀ(I − QQᵀ)P‖², exact
  on span Q and Hutchinson (k probes) on the residual. Given Q, its law is the Hutchinson law of
  the residual shifted by the exact head, which the same accountant covers (see its docstring).
  Cost: four k-wide passes and one QR per unit and weight instead of one pass.

Gaussian, not Rademacher: ±1 probes are also unbiased but have a different law, for which the
envelope was not derived.

RNG hygiene (the accountant's analysis needs probes that are independent of the data and fresh
every step; it may hand them to the adversary): the generator is seeded from ``os.urandom`` for
every task (``clipped_sum`` call) and every draw is fresh (per micro-batch and per weight; Hutch++
draws S, then P); the probes never depend on the data and never share a stream with the
coordinator's noise. A fixed ``seed`` exists for statistical tests only. :class:`IdentityProbes`
(P = I, k = d0) makes the sketch exact: the test mode in which the randomized engine must equal
``loop``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Protocol

import torch
from userdp.clients.norms import (
    Factor,
    Padded,
    batched_hutchpp_squared_norms,
    batched_sketch_squared_norms,
)


class ProbeSource(Protocol):
    estimator: str
    """A key of :data:`SKETCHES`: which estimate the probes feed."""

    def draw(self, dim: int, device: torch.device) -> torch.Tensor:
        """A [dim, k] float32 probe matrix on ``device``."""
        ...


class GaussianProbes:
    """P ~ N(0, 1/k)^{dim×k}, fresh per draw; os.urandom-seeded unless ``seed`` (tests only);
    ``estimator``: the sketch they feed (a key of :data:`SKETCHES`)."""

    def __init__(self, probes: int, seed: int | None = None, estimator: str = "hutchinson") -> None:
        if probes < 1:
            raise ValueError(f"{estimator} needs at least 1 probe, got {probes}")
        if estimator not in SKETCHES:
            raise ValueError(f"estimator {estimator!r} is not one of {tuple(SKETCHES)}")
        self.probes = int(probes)
        self.estimator = estimator
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

    estimator = "hutchinson"

    def draw(self, dim: int, device: torch.device) -> torch.Tensor:
        return torch.eye(dim, device=device)


Uses = Sequence[tuple[Factor, torch.Tensor]]


def _hutchinson(uses: Uses, source: ProbeSource, padded: Padded, dim: int, device) -> torch.Tensor:
    return batched_sketch_squared_norms(uses, source.draw(dim, device), padded)


def _hutchpp(uses: Uses, source: ProbeSource, padded: Padded, dim: int, device) -> torch.Tensor:
    head_probes = source.draw(dim, device)  # S: finds the head
    tail_probes = source.draw(dim, device)  # P: independent of S, hence of Q
    return batched_hutchpp_squared_norms(uses, head_probes, tail_probes, padded)


SKETCHES: dict[str, Callable[..., torch.Tensor]] = {"hutchinson": _hutchinson, "hutch++": _hutchpp}


def sketched_squared_norms(
    uses: Uses, source: ProbeSource, padded: Padded, dim: int, device: torch.device
) -> torch.Tensor:
    """[U] float64 norm estimates of one weight (leading dimension ``dim``) per unit, by the
    source's estimator with fresh probes."""
    return SKETCHES[source.estimator](uses, source, padded, dim, device)
