"""Weight gradients with a chosen spectrum, as the engine sees them (one unit of L/R rows), and the
Z = ‖M‖/√n̂ draws of its norm estimators: shared by the engine tests and the accountant's
domination test."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch
from userdp.clients.norms import (
    Factor,
    Padded,
    batched_hutchpp_squared_norms,
    batched_sketch_squared_norms,
    materialize,
)
from userdp.clients.sketch import GaussianProbes

CPU = torch.device("cpu")


def spectral_uses(
    squared_singular_values: Sequence[float], d0: int, d1: int, seed: int = 0
) -> tuple[list[tuple[Factor, torch.Tensor]], Padded, float]:
    """One unit whose gradient is M = U diag(√λ) Vᵀ (d0 × d1, random orthonormal U, V), written as
    r = len(λ) token rows L_t = √λ_t u_tᵀ, R_t = v_tᵀ; returns (uses, padding, ‖M‖² in float64
    of the float32 factors)."""
    gen = torch.Generator().manual_seed(seed)
    rank = len(squared_singular_values)
    u = torch.linalg.qr(torch.randn(d0, rank, generator=gen, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(d1, rank, generator=gen, dtype=torch.float64)).Q
    scale = torch.tensor(squared_singular_values, dtype=torch.float64).sqrt()
    uses = [(Factor((u * scale).T.float().contiguous(), None, d0), v.T.float().contiguous())]
    exact = float(materialize(uses, torch.Size([d0, d1])).double().pow(2).sum())
    return uses, Padded.of([slice(0, rank)], rank, CPU), exact


def hutchpp(uses, source: GaussianProbes, padded: Padded, d0: int) -> float:
    """One Hutch++ estimate of the unit's ‖M‖² (fresh S, then P, as the engine draws them)."""
    head, tail = source.draw(d0, CPU), source.draw(d0, CPU)
    return float(batched_hutchpp_squared_norms(uses, head, tail, padded)[0])


def head_only(uses, source: GaussianProbes, padded: Padded, d0: int) -> float:
    """MUTATION: Hutch++ without its tail term (the tail probes are zero, so n̂ = ‖MᵀQ‖²)."""
    head = source.draw(d0, CPU)
    return float(batched_hutchpp_squared_norms(uses, head, torch.zeros_like(head), padded)[0])


def hutchinson(uses, source: GaussianProbes, padded: Padded, d0: int) -> float:
    """One Hutchinson estimate ‖MᵀP‖²."""
    return float(batched_sketch_squared_norms(uses, source.draw(d0, CPU), padded)[0])


def estimates(
    estimator: Callable[..., float],
    uses,
    padded: Padded,
    d0: int,
    probes: int,
    draws: int,
    seed: int,
) -> np.ndarray:
    """``draws`` independent estimates (one fixed-seed probe stream, fresh probes per draw)."""
    source = GaussianProbes(probes, seed=seed)
    return np.array([estimator(uses, source, padded, d0) for _ in range(draws)])
