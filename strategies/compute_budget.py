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
``userdp.accounting.calibrate_noise_multiplier`` for fixed ε, δ, T, N); ``userdp plan`` builds
both from a config (:mod:`userdp.plan.budget`).

For ELS the same paper takes G_ELS ≈ the median number of examples per user, rounded to a power
of two (:func:`els_group_size`); :func:`els_heuristic` adds the ELS sampling rate with the same
expected examples per step as a ULS choice (G, M).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "RULES",
    "BudgetChoice",
    "Doubling",
    "ElsHeuristic",
    "els_group_size",
    "els_heuristic",
    "estimate_and_double",
    "median_user_norm",
]

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


def els_group_size(median_examples: float) -> int:
    """G_ELS = 2^round(log2(median examples per user)), at least 1 (the ELS heuristic of
    "Fine-Tuning Large Language Models with User-Level Differential Privacy")."""
    if not median_examples > 0:
        raise ValueError(f"the median number of examples per user is {median_examples!r}")
    return max(1, 2 ** round(math.log2(median_examples)))


@dataclass(frozen=True)
class ElsHeuristic:
    """G_ELS and the ELS sampling rate p with p·|D_sub| = the ULS plan's expected examples per
    step, |D_sub| = Σ_u min(n_u, G_ELS) over the training users."""

    median_examples: float
    group_size: int
    subset_examples: int
    expected_examples_per_step: float
    sampling_prob: float


def els_heuristic(
    median_examples: float,
    training_counts: Sequence[int],
    uls_group_size: int,
    uls_cohort_size: int,
    selection: str,
) -> ElsHeuristic:
    """:class:`ElsHeuristic` for the ULS plan (G, M): its expected examples per step are
    (M/N)·Σ_u min(n_u, G) (G for every user with ``random_chunk``, which cuts G windows)."""
    counts = np.asarray(training_counts, dtype=np.int64)
    group_size = els_group_size(median_examples)
    per_user = (
        np.full_like(counts, uls_group_size)
        if selection == "random_chunk"
        else np.minimum(counts, uls_group_size)
    )
    expected = uls_cohort_size / counts.size * float(per_user.sum())
    subset = int(np.minimum(counts, group_size).sum())
    return ElsHeuristic(
        median_examples=float(median_examples),
        group_size=group_size,
        subset_examples=subset,
        expected_examples_per_step=expected,
        sampling_prob=min(1.0, expected / subset),
    )
