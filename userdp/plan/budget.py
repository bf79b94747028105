"""Choosing ULS's group size G and cohort M for a compute budget B from a config: the two
estimators of Estimate-and-Double (Algorithm 3 of Charles et al., "Fine-Tuning Large Language
Models with User-Level Differential Privacy", App. F), and the paper's ELS heuristic.

- L(G) (eq. 8): the median, over a fixed sample of users, of ‖∇θ ℓ_u(θ₀)‖ with ℓ_u the run's unit
  loss (mean over ≤ G of the user's examples, chosen by ``data.selection`` and truncated to
  ``data.seq_len``; :mod:`userdp.clients.batching`) at the config's initial model θ₀, over its
  trainable parameters; one plain autograd gradient per user (the loop engine's
  :func:`userdp.clients.clipping.unit_gradient`), unclipped.
- σ(M): the noise multiplier calibrated for (``privacy.epsilon``, δ, ``strategy.steps``) with ULS
  Poisson sampling at q = M/N, N the training users
  (:func:`userdp.accounting.calibration.calibrate_noise_multiplier` at the coarser
  :data:`PLAN_DISCRETIZATION`, cached on disk; the run calibrates its own σ).
- G_ELS: the median number of examples per user (the shard manifest's ``examples_per_user``)
  rounded to the nearest power of two, with the ELS sampling rate p that gives the chosen ULS
  configuration's expected examples per step
  (:func:`userdp.strategies.compute_budget.els_heuristic`).

L(G) reads users' examples and releases a statistic of them without noise. The chosen (G, M) is
a hyperparameter picked from data, and ε does not account for it: by default the users come from
the held-out split (``data.eval_fraction``), which the run never trains on; training users only
with an explicit acknowledgment (:data:`PRIVACY_CAVEAT`).

The estimators are in :mod:`userdp.plan.estimators`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from userdp.clients.engine import ClippingEngine
from userdp.clients.model import build_model, model_shape
from userdp.clients.shard_store import ShardStore
from userdp.config import Config
from userdp.plan.estimators import CohortNoise, UserGradientNorms
from userdp.run.components import default_delta, shard_directory, split_users
from userdp.strategies.compute_budget import (
    RULES,
    BudgetChoice,
    ElsHeuristic,
    els_heuristic,
    estimate_and_double,
)

__all__ = [
    "PRIVACY_CAVEAT",
    "USER_SOURCES",
    "BudgetPlan",
    "CohortNoise",
    "PlanError",
    "UserGradientNorms",
    "plan_budget",
]

USER_SOURCES: tuple[str, ...] = ("held-out", "training")
INITIAL_GROUP_SIZE, INITIAL_COHORT_SIZE = 1, 32  # (G⁰, M⁰) of App. F.1

PRIVACY_CAVEAT = (
    "L(G) is computed from users' examples without noise, and the per-user example counts feed "
    "G_ELS: choosing G and M this way is a data-dependent hyperparameter choice that the "
    "privacy guarantee (ε) does not account for. The paper estimates L(G) on public or "
    "held-out data or treats the choice as a hyperparameter search"
)
SOURCE_NOTES = {
    "held-out": (
        "L(G) came from held-out users, whom the run never trains on: no training user's "
        "examples were read (their example counts were, for G_ELS and the ELS rate)"
    ),
    "training": (
        "L(G) came from TRAINING users: their examples influenced the choice of G and M outside "
        "ε (--allow-training-users)"
    ),
}


class PlanError(ValueError):
    """The config or the flags cannot be planned; the message says what to change."""


# ---- L(G): users' mean-gradient norms ----------------------------------------------------------


# ---- σ(M): calibrated noise multiplier ---------------------------------------------------------


# ---- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class BudgetPlan:
    """The outcome of :func:`plan_budget`: the choice, its trace and every estimate it used."""

    budget: int
    rule: str
    choice: BudgetChoice
    num_users: int
    epsilon: float
    delta: float
    delta_source: str
    """``"privacy.delta"`` or ``"1/(10·N)"`` (:func:`userdp.run.components.default_delta`)."""
    steps: int
    user_source: str
    sampled_users: int
    user_seed: int
    model_init_seed: int
    norms: dict[int, float]
    """L(G) for every G the search evaluated."""
    sigmas: dict[int, float]
    """σ(M) for every M the search evaluated."""
    els: ElsHeuristic
    notes: tuple[str, ...] = field(default=())

    @property
    def sampling_prob(self) -> float:
        return self.choice.cohort_size / self.num_users

    @property
    def noise_multiplier(self) -> float:
        return self.sigmas[self.choice.cohort_size]

    def config_lines(self) -> list[str]:
        """The ``[strategy]`` lines that run the chosen (G, M)."""
        return [
            f"group_size = {self.choice.group_size}",
            f"sampling_prob = {self.sampling_prob!r}",
        ]

    def to_dict(self) -> dict[str, Any]:
        g, m = self.choice.group_size, self.choice.cohort_size
        trace = []
        for d in self.choice.trace:
            grow_m = math.isfinite(d.tau_m)
            trace.append(
                {
                    "group_size": d.group_size,
                    "cohort_size": d.cohort_size,
                    "norm": self.norms[d.group_size],
                    "norm_doubled": self.norms[2 * d.group_size],
                    "tau_g": d.tau_g,
                    "noise_multiplier": self.sigmas[d.cohort_size],
                    "noise_multiplier_doubled": self.sigmas[2 * d.cohort_size] if grow_m else None,
                    "tau_m": d.tau_m if grow_m else None,
                    "doubled": d.doubled,
                }
            )
        return {
            "budget": self.budget,
            "rule": self.rule,
            "group_size": g,
            "cohort_size": m,
            "compute": self.choice.compute,
            "sampling_prob": self.sampling_prob,
            "noise_multiplier": self.noise_multiplier,
            "noise_std_of_mean": self.noise_multiplier * self.norms[g] / m,
            "num_users": self.num_users,
            "epsilon": self.epsilon,
            "delta": self.delta,
            "delta_source": self.delta_source,
            "steps": self.steps,
            "user_source": self.user_source,
            "sampled_users": self.sampled_users,
            "user_seed": self.user_seed,
            "model_init_seed": self.model_init_seed,
            "norms": {str(k): v for k, v in sorted(self.norms.items())},
            "noise_multipliers": {str(k): v for k, v in sorted(self.sigmas.items())},
            "trace": trace,
            "config": {"strategy": {"group_size": g, "sampling_prob": self.sampling_prob}},
            "els": asdict(self.els),
            "notes": list(self.notes),
            "privacy_caveat": f"{PRIVACY_CAVEAT}. {SOURCE_NOTES[self.user_source]}.",
        }


def check_plannable(config: Config, budget: int, rule: str, users: int, seed: int) -> None:
    """Refuse what Estimate-and-Double cannot plan, before any data or model is read."""
    s = config.strategy
    if s.name != "uls" or s.sampling != "poisson":
        raise PlanError(
            "plan chooses ULS's group size and cohort (σ(M) is calibrated for user-level "
            f"Poisson sampling): set strategy.name = 'uls' and strategy.sampling = 'poisson', got "
            f"name = {s.name!r}, sampling = {s.sampling!r}"
        )
    if rule not in RULES:
        raise PlanError(f"--rule must be one of {', '.join(RULES)}, got {rule!r}")
    initial = INITIAL_GROUP_SIZE * INITIAL_COHORT_SIZE
    if budget < initial:
        raise PlanError(
            f"--compute-budget {budget} is below the initial G·M = {INITIAL_GROUP_SIZE}·"
            f"{INITIAL_COHORT_SIZE} = {initial} of Estimate-and-Double; give at least {initial}"
        )
    if users < 1:
        raise PlanError(f"--users must be a positive integer, got {users}")
    if seed < 0:
        raise PlanError(f"--seed must be a non-negative integer, got {seed}")


def sample_users(
    train: Sequence[str],
    held_out: Sequence[str],
    source: str,
    count: int,
    seed: int,
    *,
    allow_training_users: bool,
    eval_fraction: float,
) -> list[str]:
    """``count`` users of ``source`` (sorted ids, then a seeded draw without replacement)."""
    if source not in USER_SOURCES:
        raise PlanError(f"--users-from must be one of {', '.join(USER_SOURCES)}, got {source!r}")
    if source == "training" and not allow_training_users:
        raise PlanError(
            "--users-from training reads the training users' examples without noise, a privacy "
            "cost that ε does not account for: add --allow-training-users to accept it, or use "
            "the held-out users (the default)"
        )
    pool = sorted(train if source == "training" else held_out)
    if len(pool) < count:
        if source == "training":
            raise PlanError(f"--users {count} exceeds the {len(pool)} training users")
        raise PlanError(
            f"only {len(pool)} held-out users (data.eval_fraction = {eval_fraction:g}) for "
            f"--users {count}: pass --users {len(pool)} or fewer, raise data.eval_fraction, or "
            "estimate on training users (--users-from training --allow-training-users, which ε "
            "does not account for)"
            if pool
            else f"no held-out users (data.eval_fraction = {eval_fraction:g}): raise "
            "data.eval_fraction, or estimate on training users (--users-from training "
            "--allow-training-users, which ε does not account for)"
        )
    chosen = np.random.default_rng(seed).choice(len(pool), size=count, replace=False)
    return [pool[i] for i in sorted(chosen)]


def plan_budget(
    config: Config,
    budget: int,
    *,
    rule: str = "std-ratio",
    users: int = 128,
    user_source: str = "held-out",
    allow_training_users: bool = False,
    seed: int = 0,
    device: str | None = None,
    on_progress: Callable[[str], None] | None = None,
) -> BudgetPlan:
    """Run Estimate-and-Double for ``config`` (a validated :class:`userdp.config.Config`) with
    compute budget ``budget`` = G·M, M ≤ N; see the module docstring for the estimators.
    ``on_progress`` hears what is being computed (each user's L(G), each σ(M) calibration)."""
    check_plannable(config, budget, rule, users, seed)
    shard_dir = shard_directory(config)
    with ShardStore(shard_dir) as store:
        counts = store.user_counts()
        manifest = store.manifest
        train, held = split_users(list(counts), config.data.eval_fraction)
        num_users = len(train)
        if num_users < INITIAL_COHORT_SIZE:
            raise PlanError(
                f"{num_users} training users in {shard_dir}: Estimate-and-Double starts at a "
                f"cohort of M = {INITIAL_COHORT_SIZE} users, so it needs at least that many"
            )
        sampled = sample_users(
            train,
            held,
            user_source,
            users,
            seed,
            allow_training_users=allow_training_users,
            eval_fraction=config.data.eval_fraction,
        )
        notes = []
        init_seed = config.output.seed
        if init_seed is None:
            init_seed = 0
            notes.append(
                "output.seed is not set, so the run's initial model is unseeded; L(G) was "
                "measured at the initial model of seed 0"
            )
        if config.privacy.noise_multiplier is not None:
            notes.append(
                f"privacy.noise_multiplier = {config.privacy.noise_multiplier:g} is set: the run "
                "uses it instead of calibrating σ to ε; remove it to run at the σ planned here"
            )
        on = torch.device(device or config.workers.device)
        if on.type == "cuda" and not torch.cuda.is_available():
            raise PlanError(f"device {str(on)!r} but no CUDA device is visible; use --device cpu")
        shape = model_shape(manifest, config.data.seq_len)
        module = build_model(config.model, shape, init_seed).to(on)
        engine = ClippingEngine(
            module,
            engine="loop",
            token_budget=config.workers.token_budget,
            pad_id=shape.pad_id if shape.pad_id is not None else 0,
        )
        loaded: dict[str, list[np.ndarray]] = {}

        def examples_of(user_id: str) -> list[np.ndarray]:
            if user_id not in loaded:
                loaded[user_id] = store.user_examples(user_id)
            return loaded[user_id]

        norms = UserGradientNorms(
            engine,
            sampled,
            examples_of,
            selection=config.data.selection,
            seq_len=config.data.seq_len,
            seed=seed,
            on_progress=on_progress,
        )
        delta = config.privacy.delta or default_delta(num_users)
        noise = CohortNoise(
            num_users, config.privacy.epsilon, delta, config.strategy.steps, on_progress
        )
        choice = estimate_and_double(
            budget,
            norms,
            noise,
            initial_group_size=INITIAL_GROUP_SIZE,
            initial_cohort_size=INITIAL_COHORT_SIZE,
            rule=rule,
            max_cohort_size=num_users,
        )
        norms(choice.group_size)  # the chosen point's L and σ, also when no doubling ran
        noise(choice.cohort_size)
    els = els_heuristic(
        manifest.examples_per_user["median"],
        [counts[u].n_examples for u in train],
        choice.group_size,
        choice.cohort_size,
        config.data.selection,
    )
    return BudgetPlan(
        budget=int(budget),
        rule=rule,
        choice=choice,
        num_users=num_users,
        epsilon=float(config.privacy.epsilon),
        delta=float(delta),
        delta_source="privacy.delta" if config.privacy.delta else "1/(10·N)",
        steps=int(config.strategy.steps),
        user_source=user_source,
        sampled_users=len(sampled),
        user_seed=int(seed),
        model_init_seed=int(init_seed),
        norms={g: float(np.median(v)) for g, v in norms.norms.items()},
        sigmas=dict(noise.sigmas),
        els=els,
        notes=tuple(notes),
    )
