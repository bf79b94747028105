"""Choosing G_ULS and the cohort M for a compute budget B: "Estimate-and-Double" (Algorithm 3 of
Charles et al., "Fine-Tuning Large Language Models with User-Level Differential Privacy", App. F).

Start at (G⁰, M⁰) = (1, 32) (App. F.1); while G·M < B, double whichever of G or M reduces the
noise more. With L(G) the (median) norm of users' mean gradients over ≤ G examples (eq. 8) and
σ(M) the noise multiplier calibrated for cohort M (q = M/N), the std of the noise on the averaged
update is σ(M)·L(G)/M (eq. 6). Two decision rules:

- ``"std-ratio"`` (default): double G iff τ_G < τ_M / 2, i.e. compare the actual std ratios
  L(2G)/L(G) and σ(2M)/(2σ(M)).
- ``"paper"``: the rule as printed in Alg. 3, double G iff τ_G < τ_M (drops the 1/M factor and
  nearly always doubles G; kept to reproduce the paper).

τ_G = L(2G)/L(G), τ_M = σ(2M)/σ(M). Both estimators are callables supplied by the caller:
``norm_of_group_size(G)`` (e.g. median over 128 users at the pre-trained θ, see
:func:`median_user_norm`) and ``noise_multiplier_of_cohort(M)`` (e.g. a closure over
``userdp.accounting.calibrate_noise_multiplier`` for fixed ε, δ, T, N).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["RULES", "BudgetChoice", "Doubling", "estimate_and_double", "median_user_norm"]

RULES: tuple[str, ...] = ("std-ratio", "paper")


@dataclass(frozen=True)
class Doubling:
    """One decision: at (G, M), the ratios and what was doubled (``"G"`` or ``"M"``)."""

    group_size: int
    cohort_size: int
    tau_g: float
    tau_m: float
    doubled: str


@dataclass(frozen=True)
class BudgetChoice:
    group_size: int
    cohort_size: int
    rule: str
    trace: tuple[Doubling, ...]

    @property
    def compute(self) -> int:
        return self.group_size * self.cohort_size


def median_user_norm(user_gradient_norms: Sequence[float]) -> float:
    """ψ = median of ρ_u = ‖mean of user u's ≤ G example gradients‖ (eq. 8, App. F)."""
    norms = np.asarray(user_gradient_norms, dtype=float)
    if norms.size == 0:
        raise ValueError("user_gradient_norms is empty; sample some users (App. F.1 uses 128)")
    return float(np.median(norms))


def estimate_and_double(
    budget: int,
    norm_of_group_size: Callable[[int], float],
    noise_multiplier_of_cohort: Callable[[int], float],
    *,
    initial_group_size: int = 1,
    initial_cohort_size: int = 32,
    rule: str = "std-ratio",
    max_cohort_size: int | None = None,
) -> BudgetChoice:
    """Algorithm 3 of "Fine-Tuning Large Language Models with User-Level Differential Privacy".

    ``max_cohort_size`` (e.g. N) stops M from growing past the population; then only G is
    doubled. Each estimator is called once per distinct argument."""
    if rule not in RULES:
        raise ValueError(f"rule={rule!r} is not allowed; expected one of {RULES}")
    if budget < initial_group_size * initial_cohort_size:
        raise ValueError(
            f"budget={budget} is below the initial G·M = {initial_group_size * initial_cohort_size}"
        )
    norm_cache: dict[int, float] = {}
    sigma_cache: dict[int, float] = {}

    def norm(g: int) -> float:
        if g not in norm_cache:
            norm_cache[g] = float(norm_of_group_size(g))
        return norm_cache[g]

    def sigma(m: int) -> float:
        if m not in sigma_cache:
            sigma_cache[m] = float(noise_multiplier_of_cohort(m))
        return sigma_cache[m]

    g, m = int(initial_group_size), int(initial_cohort_size)
    trace = []
    while 2 * g * m <= budget:
        tau_g = norm(2 * g) / norm(g)
        can_grow_m = max_cohort_size is None or 2 * m <= max_cohort_size
        tau_m = sigma(2 * m) / sigma(m) if can_grow_m else float("inf")
        threshold = tau_m / 2.0 if rule == "std-ratio" else tau_m
        doubled = "G" if tau_g < threshold else "M"
        trace.append(Doubling(g, m, tau_g, tau_m, doubled))
        if doubled == "G":
            g *= 2
        else:
            m *= 2
    return BudgetChoice(g, m, rule, tuple(trace))
