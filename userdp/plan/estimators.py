"""The two estimators of Estimate-and-Double (Algorithm 3 of Charles et al., "Fine-Tuning Large
Language Models with User-Level Differential Privacy", App. F) for one config: L(G), the median
user gradient norm at the initial model, and σ(M), the noise multiplier at cohort size M."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from userdp.accounting.calibration import calibrate_noise_multiplier
from userdp.accounting.mechanisms import UlsMechanism
from userdp.clients.batching import Unit, prepare_units
from userdp.clients.clipping import squared_norm, unit_gradient
from userdp.clients.perplexity import score_examples
from userdp.clients.selection import PERPLEXITY_SELECTIONS, select_examples
from userdp.strategies.compute_budget import (
    median_user_norm,
)

PLAN_DISCRETIZATION = 1e-3
"""The PLD grid of the plan's σ(M): ten times coarser than a run's calibration (each ε costs about
a tenth); pessimistic discretization keeps σ(M) on the private side, a fraction of a percent above
the run's, which calibrates its own σ for the chosen q."""


def _user_rng(seed: int, group_size: int, user_id: str) -> np.random.Generator:
    user_hash = int.from_bytes(hashlib.sha256(user_id.encode()).digest()[:8], "big")
    return np.random.default_rng([seed, group_size, user_hash])


class UserGradientNorms:
    """``norm_of_group_size`` for :func:`estimate_and_double`: L(G) = median over ``users`` of the
    norm of the user's unit gradient with ≤ G examples at ``engine.module``'s current weights.

    ``engine`` is a :class:`userdp.clients.engine.ClippingEngine` (its trainable parameters, pad
    id, context length and token budget); ``examples_of`` maps a user id to its token arrays.
    ``norms[G]`` keeps every user's norm, in ``users`` order."""

    def __init__(
        self,
        engine: Any,
        users: Sequence[str],
        examples_of: Any,
        *,
        selection: str,
        seq_len: int,
        seed: int,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        self.on_progress = on_progress or (lambda message: None)
        self.engine = engine
        self.users = list(users)
        self.examples_of = examples_of
        self.selection = selection
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.norms: dict[int, list[float]] = {}
        self._perplexities: dict[str, np.ndarray] = {}  # per user: the model does not change

    def user_norm(self, user_id: str, group_size: int) -> float:
        """‖∇θ (mean loss over ≤ G selected examples of ``user_id``)‖ (0 with no usable example)."""
        engine = self.engine
        everything = self.examples_of(user_id)
        perplexities = None
        if self.selection in PERPLEXITY_SELECTIONS:  # the plan runs at the initial model
            if user_id not in self._perplexities:  # once per user, whatever the group sizes
                self._perplexities[user_id] = score_examples(
                    engine.module,
                    everything,
                    self.seq_len,
                    token_budget=engine.token_budget,
                    pad_id=engine.pad_id,
                )
            perplexities = self._perplexities[user_id]
        examples = select_examples(
            everything,
            group_size,
            self.selection,
            self.seq_len,
            _user_rng(self.seed, group_size, user_id),
            perplexities=perplexities,
        )
        prepared = prepare_units([Unit(user_id, examples)], engine.max_positions)
        if not prepared[0].examples:
            return 0.0
        grads, _, _ = unit_gradient(
            engine.module, engine.params, prepared, 0, engine.token_budget, engine.pad_id
        )
        return math.sqrt(squared_norm(list(grads.values())))

    def __call__(self, group_size: int) -> float:
        if group_size not in self.norms:
            norms = []
            for done, user in enumerate(self.users):
                self.on_progress(f"L(G={group_size}): user {done + 1} of {len(self.users)}")
                norms.append(self.user_norm(user, group_size))
            self.norms[group_size] = norms
        return median_user_norm(self.norms[group_size])


class CohortNoise:
    """``noise_multiplier_of_cohort`` for :func:`estimate_and_double`: σ(M) calibrated for ULS
    with Poisson sampling at q = M/N, ``steps`` steps, to (``epsilon``, ``delta``)."""

    def __init__(
        self,
        num_users: int,
        epsilon: float,
        delta: float,
        steps: int,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        self.on_progress = on_progress or (lambda message: None)
        self.num_users = int(num_users)
        self.epsilon = float(epsilon)
        self.delta = float(delta)
        self.steps = int(steps)
        self.sigmas: dict[int, float] = {}

    def sampling_prob(self, cohort_size: int) -> float:
        return cohort_size / self.num_users

    def __call__(self, cohort_size: int) -> float:
        if cohort_size not in self.sigmas:
            self.on_progress(f"σ(M={cohort_size}): calibrating to ε = {self.epsilon:g}")
            template = UlsMechanism(1.0, self.sampling_prob(cohort_size))  # σ is the free field
            self.sigmas[cohort_size] = float(
                calibrate_noise_multiplier(
                    template,
                    self.epsilon,
                    self.delta,
                    self.steps,
                    value_discretization_interval=PLAN_DISCRETIZATION,
                    search_discretization_interval=None,
                )
            )
        return self.sigmas[cohort_size]
