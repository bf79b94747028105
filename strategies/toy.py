"""Toy workers for tutorials and tests: per-user clipped mean estimation, and a Flower node
partition of its users.

``ToyMeanEstimation`` plays the worker compute of
:func:`userdp.strategies.local_step.run_local_step` (and of the Flower ClientApp) without a model:
each user holds points in R^d and a unit's update is the gradient of ½‖θ − x‖², clipped exactly
as a real worker clips.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from userdp.strategies.base import TaskSpec, parse_example_unit_id
from userdp.strategies.tensors import is_torch, to_numpy
from userdp.strategies.unit_stats import UnitStats

__all__ = ["PartitionedUsers", "ToyMeanEstimation"]


class ToyMeanEstimation:
    """A toy worker for tutorials and tests: users hold points in R^d and the loss is ½‖θ − x‖²,
    so a user unit's gradient is θ − (mean of its points) and an example unit's is θ − x.

    Call it as the worker compute: ``(task, unit_ids, params) -> (clipped sum, UnitStats)``;
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
        return {"theta": total}, UnitStats(count=len(unit_ids), clipped=clipped)


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
