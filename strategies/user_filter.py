"""User-wise DP-SGD with filter (Asi & Liu, "User-level Differentially Private Stochastic Convex
Optimization: Efficient Algorithms with Optimal Rates", AISTATS 2024; Algorithm 3 of "Mind the
Privacy Unit! User-Level Differential Privacy for Language Model Fine-Tuning"): full-batch
user-level DP-SGD whose noise scales with a concentration radius τ instead of the clip norm, for
as long as the users' gradients stay concentrated.

Each step uses all N users (Poisson with q = 1); gᵢ is user i's mean gradient over at most G of
its examples, clipped to C by the worker like every userdp unit. Clipping is a projection onto a
ball, which never moves two gradients apart, so the analysis (which uses τ, not C) is unchanged.

1. s = (1/N) Σ_{i,i'} 1(‖gᵢ − gᵢ'‖ ≤ τ), over ordered pairs with i = i' included;
2. AboveThreshold at ε/2 with Δ = 2 on s − 4N/5 against 0
   (:data:`~userdp.accounting.user_filter.CONCENTRATION_SCORE_SENSITIVITY`, derived there):
   "below" halts the run. That step releases nothing and the next one raises
   :class:`TrainingHalted`;
3. fᵢ = Σ_{i'} 1(‖gᵢ − gᵢ'‖ ≤ 2τ); user i is kept with probability
   pᵢ = 0 if fᵢ < N/2, 1 if fᵢ ≥ 2N/3, (fᵢ − N/2)/(N/6) otherwise;
4. ĝ = the mean of the kept users (0 if none). The release is N·ĝ + N(0, (σ·√(8 log(e^ε T/δ))·τ)²I),
   so dividing by the expected cohort N gives ĝ + N(0, 8τ² log(e^ε T/δ) σ²/N² I).

The filter needs every user's own gradient, so :attr:`UserWiseFilter.needs_unit_updates` is set:
the in-process step (``userdp simulate --in-process``, ``userdp audit``) gathers them. The
coordinator's workers return one sum per task, so the coordinator refuses the strategy before its
first step. A step holds N gradients and O(N²) distances. Accounting:
:class:`~userdp.accounting.mechanisms.UserWiseFilterMechanism` and
:mod:`userdp.accounting.user_filter`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from userdp.accounting import user_filter
from userdp.accounting.ledger import BudgetExceededError
from userdp.accounting.mechanisms import Mechanism, UserWiseFilterMechanism
from userdp.strategies import tensors as T
from userdp.strategies.above_threshold import AboveThreshold
from userdp.strategies.base import Cohort, Release, Strategy, StrategyError
from userdp.strategies.noise import NoiseMechanism
from userdp.strategies.optimizers import ServerOptimizer
from userdp.strategies.samplers import PoissonSampler
from userdp.strategies.unit_stats import UnitStats

__all__ = [
    "TrainingHalted",
    "UserWiseFilter",
    "concentration_score",
    "keep_probabilities",
    "neighbour_counts",
    "pairwise_sq_distances",
]

log = logging.getLogger(__name__)


class TrainingHalted(BudgetExceededError):
    """AboveThreshold answered "below": Algorithm 3 halts, and its ε/2 for AboveThreshold covers
    no further step. A budget stop for the step loops (they stop cleanly and write the report)."""


# ---------------------------------------------------------------------------------------------
# the filter's math, on the users' clipped gradients


def pairwise_sq_distances(updates: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """‖gᵢ − gⱼ‖² for every pair of tensor dicts, from their Gram matrix accumulated tensor by
    tensor in float64 (never more than one tensor of every user in memory as a matrix)."""
    n = len(updates)
    gram = np.zeros((n, n))
    for name in updates[0]:
        rows = np.stack(
            [T.to_numpy(u[name]).astype(np.float64, copy=False).ravel() for u in updates]
        )
        gram += rows @ rows.T
    norms = np.diag(gram).copy()
    distances = norms[:, None] + norms[None, :] - 2.0 * gram
    np.maximum(distances, 0.0, out=distances)
    np.fill_diagonal(distances, 0.0)
    return distances


def neighbour_counts(sq_distances: np.ndarray, radius: float) -> np.ndarray:
    """Σ_{i'} 1(‖gᵢ − gᵢ'‖ ≤ radius) for every i, i' = i included."""
    return np.count_nonzero(sq_distances <= radius * radius, axis=1)


def concentration_score(sq_distances: np.ndarray, radius: float) -> float:
    """s = (1/N) Σ_{i,i'} 1(‖gᵢ − gᵢ'‖ ≤ radius) over ordered pairs (Algorithm 3, eq. 1)."""
    return float(neighbour_counts(sq_distances, radius).sum()) / len(sq_distances)


def keep_probabilities(counts: np.ndarray, num_users: int) -> np.ndarray:
    """pᵢ = 0 if fᵢ < N/2, 1 if fᵢ ≥ 2N/3, (fᵢ − N/2)/(N/6) otherwise (Algorithm 3, line 12):
    the middle piece is 0 at N/2 and 1 at 2N/3, so pᵢ is it clipped to [0, 1] (exactly 0 and 1
    at the edges: N/2 and N/6 are exact in floating point)."""
    f = np.asarray(counts, dtype=np.float64)
    return np.clip((f - num_users / 2) / (num_users / 6), 0.0, 1.0)


# ---------------------------------------------------------------------------------------------
# the strategy


class UserWiseFilter(Strategy):
    """User-wise DP-SGD with filter (module docstring), for a run of ``steps`` steps targeting
    (``epsilon``, ``delta``) over all users.

    ``noise_multiplier`` σ = PrivAccounting(ε/2, δ/2, q = 1, T), i.e. what
    :func:`userdp.accounting.calibration.calibrate_noise_multiplier` returns for
    :meth:`mechanism` at (ε, δ, T); ``concentration_threshold`` is τ; ``clip_norm`` C is the
    workers' per-user clip (it does not enter the noise). The accountant needs ε, δ and T at
    construction: ε/2 goes to AboveThreshold, δ/2 to the filter, and the noise std uses all three.
    """

    needs_unit_updates = True
    samplings = ("poisson",)
    full_participation = True
    required_keys = ("concentration_threshold",)

    def __init__(
        self,
        *,
        noise_multiplier: float,
        clip_norm: float,
        concentration_threshold: float,
        epsilon: float,
        delta: float,
        steps: int,
        group_size: int = 1,
        noise: NoiseMechanism | None = None,
        optimizer: ServerOptimizer | None = None,
    ) -> None:
        super().__init__(
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            sampler=PoissonSampler(1.0),  # every user in every step: nothing random to seed
            unit="user",
            group_size=group_size,
            noise=noise,
            optimizer=optimizer,
        )
        try:
            self.budget = user_filter.split_budget(epsilon, delta)
            user_filter.filter_sensitivity(concentration_threshold, 1, epsilon, delta, steps)
        except ValueError as exc:
            raise StrategyError(str(exc)) from None
        self.concentration_threshold = float(concentration_threshold)
        self.epsilon, self.delta, self.steps = float(epsilon), float(delta), int(steps)
        self.above_threshold = AboveThreshold(
            self.budget.above_threshold_epsilon, user_filter.CONCENTRATION_SCORE_SENSITIVITY
        )
        self.halted_at: int | None = None
        self.last_step: int | None = None  # the last step that queried AboveThreshold

    # ---- the step ------------------------------------------------------------------------------

    def sample_cohort(self, step: int, population: Any) -> Cohort:
        """All users; after a halt, :class:`TrainingHalted` (before any work of the step). A step
        other than the next one (steps lost after a checkpoint, then skipped on resume) is
        refused: the AboveThreshold answers of the lost steps, a possible "below" among them,
        are not in this state, and a run that went on would not be the accounted mechanism."""
        if self.halted_at is not None:
            raise TrainingHalted(
                f"AboveThreshold answered below at step {self.halted_at}: the users' gradients "
                f"were not concentrated within tau = {self.concentration_threshold:g}, so "
                "user-wise DP-SGD with filter halts (its budget covers no further step)"
            )
        expected = 0 if self.last_step is None else self.last_step + 1
        if step not in (expected, self.last_step):  # the same step again: a retry
            raise StrategyError(
                f"step {step} follows step {expected - 1} in this strategy's state: the "
                "AboveThreshold state of the steps in between was lost with them (after the last "
                "checkpoint), so the run cannot continue as the accounted mechanism. Keep the "
                "ledger (it stays charged) and use coordinator.checkpoint_every = 1 for "
                "user-wise-filter"
            )
        if step >= self.steps:
            raise StrategyError(
                f"step {step} is past steps = {self.steps}, the horizon the noise and the "
                "accountant were set for"
            )
        return super().sample_cohort(step, population)

    def privatize(self, step, summed, stats, cohort) -> Release:
        raise StrategyError(
            "UserWiseFilter filters individual users: it needs privatize_units (every user's "
            "update), not the clipped sum"
        )

    def noise_std(self, num_users: int) -> float:
        """The std of the noise on the filtered MEAN over ``num_users`` users (Algorithm 3)."""
        return user_filter.filter_noise_std(
            self.noise_multiplier,
            self.concentration_threshold,
            num_users,
            self.epsilon,
            self.delta,
            self.steps,
        )

    def privatize_units(
        self,
        step: int,
        updates: Mapping[str, Mapping[str, Any]],
        stats: UnitStats,
        cohort: Cohort,
    ) -> Release:
        """Concentration score → AboveThreshold → filter → N·(ĝ + ν) (module docstring); on
        "below", a release with nothing in it and the run halted."""
        if set(updates) != set(cohort.unit_ids) or len(updates) != len(cohort):
            raise StrategyError(
                f"step {step}: got updates of {len(updates)} units for a cohort of "
                f"{len(cohort)}; the filter needs exactly one update per user"
            )
        if not len(cohort):
            raise StrategyError(f"step {step}: no users; the filter needs every user")
        users = [updates[unit] for unit in cohort.unit_ids]
        n = len(users)
        tau = self.concentration_threshold
        rng = self.noise.rng
        sq_distances = pairwise_sq_distances(users)
        score = concentration_score(sq_distances, tau)
        query = score - user_filter.SCORE_THRESHOLD_FRACTION * n
        self.last_step = step
        if not self.above_threshold.above(query, rng):
            self.halted_at = step
            log.warning("step %d: AboveThreshold answered below; training halts", step)
            return Release(step, cohort, {})
        keep = rng.uniform(n) < keep_probabilities(neighbour_counts(sq_distances, 2 * tau), n)
        kept = [update for update, k in zip(users, keep.tolist(), strict=True) if k]
        if kept:  # N·ĝ: the server divides by the expected cohort N
            total = {name: v * (n / len(kept)) for name, v in T.sum_tensor_dicts(kept).items()}
        else:
            total = {name: v * 0.0 for name, v in T.sum_tensor_dicts(users[:1]).items()}
        noisy = self.noise.add(step, total, std=n * self.noise_std(n))
        return Release(step, cohort, noisy)

    def server_update(self, params: Mapping[str, Any], release: Release) -> None:
        """The usual update; nothing after a halt (the halted step released nothing)."""
        if release.noisy_sum:
            super().server_update(params, release)

    # ---- privacy description ------------------------------------------------------------------

    def mechanism(self) -> Mechanism:
        return UserWiseFilterMechanism(
            noise_multiplier=self.noise_multiplier,
            above_threshold_epsilon=self.budget.above_threshold_epsilon,
            filter_delta=self.budget.filter_delta,
            horizon=self.steps,
        )

    def caveats(self) -> tuple[str, ...]:
        b = self.budget
        own = [
            f"Budget split of user-wise DP-SGD with filter (Asi & Liu): epsilon/2 = "
            f"{b.above_threshold_epsilon:g} to AboveThreshold on the gradient concentration "
            f"score (charged once), epsilon/2 = {b.gaussian_epsilon:g} at delta/2 = "
            f"{b.gaussian_delta:.3g} to {self.steps} full-batch Gaussian steps (sigma = "
            f"{self.noise_multiplier:g}), delta/2 = {b.filter_delta:.3g} to the filter's "
            f"sensitivity bound sqrt(8 log(e^eps T/delta))·tau/N with tau = "
            f"{self.concentration_threshold:g}; the accountant follows the analysis as stated in "
            "Algorithm 3 of 'Mind the Privacy Unit!'",
            "N (the number of training users) is treated as public: the threshold 4N/5, the "
            "filter's N/2 and 2N/3 and the noise's 1/N use it",
        ]
        if self.halted_at is not None:
            own.append(
                f"HALT: AboveThreshold answered below at step {self.halted_at} (the users' "
                f"gradients were not concentrated within tau = {self.concentration_threshold:g}); "
                "training stopped there. That step released nothing but is charged in the ledger "
                "as a full step (conservative)"
            )
        return (*super().caveats(), *own)

    # ---- checkpoint -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The base state plus AboveThreshold's (its noisy threshold is as secret as the sampler
        seed), the halted step and the last step that queried it."""
        return {
            **super().state_dict(),
            "above_threshold": self.above_threshold.state_dict(),
            "halted_at": self.halted_at,
            "last_step": self.last_step,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.above_threshold.load_state_dict(state["above_threshold"])
        halted, last = state["halted_at"], state["last_step"]
        self.halted_at = None if halted is None else int(halted)
        self.last_step = None if last is None else int(last)
