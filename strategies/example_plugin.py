"""A complete user-level DP strategy in one short file: the tutorial's example (docs/strategies.md).

``WarmupUls`` is DP-FedSGD (Poisson users, per-user clipping, Gaussian noise) whose server
learning rate warms up linearly. What a strategy must say is here: its sampler (which also
states the sampling scheme, adjacency and whether an accountant matches it, and is checkpointed
by the base class), the ledger's mechanism, and the update. The warm-up is post-processing of the
noisy release, so it costs no privacy and the mechanism is the plain ULS one.

Run it from a config with ``[strategy] name = "userdp.strategies.example_plugin:WarmupUls"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from userdp.accounting.mechanisms import UlsMechanism
from userdp.strategies.base import (
    ClipStatistics,
    Release,
    Strategy,
    TaskSpec,
    parse_example_unit_id,
)
from userdp.strategies.optimizers import Sgd
from userdp.strategies.samplers import PoissonSampler
from userdp.strategies.tensors import is_torch, to_numpy


class WarmupUls(Strategy):
    """Poisson users with probability q, clip C, noise σ·C, SGD with lr warmed up over
    ``warmup_steps``."""

    def __init__(
        self,
        *,
        noise_multiplier: float,
        clip_norm: float,
        sampling_prob: float,
        learning_rate: float,
        warmup_steps: int = 10,
        seed: int | None = None,  # None: a secret seed from os.urandom (production)
    ) -> None:
        super().__init__(
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            sampler=PoissonSampler(sampling_prob, seed),  # 1. who contributes: users w.p. q
            optimizer=Sgd(learning_rate),
        )
        self.peak_lr = learning_rate
        self.warmup_steps = warmup_steps

    # 2. what the ledger records for every step
    def mechanism(self) -> UlsMechanism:
        return UlsMechanism(
            noise_multiplier=self.noise_multiplier, sampling_prob=self.sampler.sampling_prob
        )

    # 3. the update: warm the learning rate up, then the inherited ÷ qN + SGD step
    def server_update(self, params: Mapping[str, Any], release: Release) -> None:
        fraction = min(1.0, (release.step + 1) / self.warmup_steps)
        self.optimizer.learning_rate = self.peak_lr * fraction
        super().server_update(params, release)


class ToyMeanEstimation:
    """A toy worker for tutorials and tests: users hold points in R^d and the loss is ½‖θ − x‖²,
    so a user unit's gradient is θ − (mean of its points) and an example unit's is θ − x.

    Call it as the worker compute: ``(task, unit_ids, params) -> (clipped sum, ClipStatistics)``;
    it clips each unit to ``task.clip_norm`` exactly as a real worker must.
    """

    def __init__(self, n_users: int = 400, dim: int = 3, seed: int = 0, spread: float = 0.3):
        rng = np.random.default_rng(seed)
        self.center = rng.normal(size=dim)
        counts = rng.integers(1, 12, size=n_users)
        self.data = {
            f"user{i}": self.center + spread * rng.normal(size=(c, dim))
            for i, c in enumerate(counts)
        }
        self.calls: list[tuple[TaskSpec, tuple[str, ...]]] = []

    @property
    def population(self) -> dict[str, int]:
        """user id -> number of examples (what the coordinator may know)."""
        return {u: len(x) for u, x in self.data.items()}

    def __call__(self, task: TaskSpec, unit_ids, params: Mapping[str, Any]):
        self.calls.append((task, tuple(unit_ids)))
        theta = to_numpy(params["theta"]).astype(np.float64)
        total = np.zeros_like(theta)
        clipped = 0
        for unit in unit_ids:
            if task.unit == "example":
                user, index = parse_example_unit_id(unit)
                point = self.data[user][index]
            else:
                point = self.data[unit].mean(axis=0)
            grad = theta - point
            norm = float(np.linalg.norm(grad))
            if norm > task.clip_norm:
                grad = grad * (task.clip_norm / norm)
                clipped += 1
            total += grad
        if is_torch(params["theta"]):
            import torch

            total = torch.from_numpy(total).to(params["theta"].dtype)
        return {"theta": total}, ClipStatistics(len(unit_ids), clipped)


class PartitionedUsers:
    """``users_of_node`` for Flower simulations: node with partition id i holds every
    ``nodes``-th user of ``population`` (user id -> n_examples), starting at i."""

    def __init__(self, population: Mapping[str, int], nodes: int) -> None:
        self.users = sorted(population)
        self.population = dict(population)
        self.nodes = nodes

    def __call__(self, context: Any) -> dict[str, int]:
        partition = int(context.node_config["partition-id"])
        return {u: self.population[u] for u in self.users[partition :: self.nodes]}
