"""TRANSPORT-TEST COMPONENTS (labelled toys, not used by userdp itself).

- :class:`ToyCompute`: a tiny numpy/torch "gradient" per user, deterministic in (user id, model),
  clipped to C — so the coordinator's exactly-once sum can be compared with an in-process
  reference bit for bit, without a language model. The real worker compute is
  ``userdp.clients.worker_service.EngineCompute`` (tested in tests/clients/test_worker_grpc*.py).
- :func:`toy_population`: user ids mapped to shard names, no files.

Run as a script it is a worker process: ``python toy.py ADDRESS WORKER_ID SHARD[,SHARD] [DELAY]``.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping

import numpy as np
import torch

SHAPES = {"w": (6,), "b": (2, 3)}


def initial_params() -> dict[str, torch.Tensor]:
    return {
        name: torch.linspace(-0.5, 0.5, int(np.prod(shape))).reshape(shape)
        for name, shape in SHAPES.items()
    }


def toy_population(num_users: int = 40, num_shards: int = 4):
    from userdp.server.coordinator import Population

    shards = [f"shard-{i:05d}" for i in range(num_shards)]
    return Population(
        shard_of_user={f"user-{i}": shards[i % num_shards] for i in range(num_users)},
        shard_sha256={name: hashlib.sha256(name.encode()).hexdigest() for name in shards},
    )


def user_gradient(user: str, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A deterministic, model-dependent 'gradient' of one user (norms between ~0.2 and ~6)."""
    seed = int.from_bytes(hashlib.sha256(user.encode()).digest()[:4], "big")
    gen = torch.Generator().manual_seed(seed)
    scale = 0.2 + 6.0 * torch.rand((), generator=gen)
    return {
        name: scale * torch.randn(p.shape, generator=gen) / p.numel() ** 0.5 + 0.1 * p
        for name, p in sorted(params.items())
    }


def clipped_sum(units, params, clip_norm: float):
    """Sum over units of clip(g_u, C), with statistics (the reference and the toy worker both use
    this, so any difference in the coordinator's result is a transport/exactly-once bug)."""
    sums = {name: torch.zeros_like(p) for name, p in params.items()}
    norms = []
    for unit in units:
        grad = user_gradient(unit, params)
        norm = float(torch.sqrt(sum(torch.sum(g.double() ** 2) for g in grad.values())))
        factor = min(1.0, clip_norm / norm)
        for name, g in grad.items():
            sums[name] += g * factor
        norms.append(norm)
    return sums, norms


class ToyCompute:
    """A worker compute for transport tests (see the module docstring)."""

    def __init__(
        self, delay_s: float = 0.0, corrupt: str | None = None, flat: bool = False
    ) -> None:
        """``flat``: return the sums as views of one float32 buffer in the model's order
        (:data:`SHAPES`, the coordinator's), as the engines' accumulator does."""
        self.params: dict[str, torch.Tensor] = {}
        self.delay_s = delay_s
        self.corrupt = corrupt
        self.flat = flat
        self.full_applies = 0

    def apply_model(self, tensors, full: bool) -> None:
        if full:
            self.full_applies += 1
            self.params = {name: t.torch().clone() for name, t in tensors.items()}
        else:
            for name, t in tensors.items():
                self.params[name] = t.torch().clone()

    def compute(self, task):
        import time

        from userdp.proto.results import TaskSum
        from userdp.strategies.unit_stats import UnitStats

        if self.delay_s:
            time.sleep(self.delay_s)
        sums, norms = clipped_sum(task.unit_ids, self.params, task.clip_norm)
        if self.corrupt == "nan":
            sums["w"][0] = float("nan")
        elif self.corrupt == "shape":
            sums["w"] = torch.zeros(7)
        elif self.corrupt == "unclipped":
            sums = {name: s * 100 for name, s in sums.items()}
        stats = UnitStats(
            count=len(task.unit_ids),
            clipped=sum(n > task.clip_norm for n in norms),
            norm_min=min(norms, default=0.0),
            norm_max=max(norms, default=0.0),
            norm_sum=sum(norms),
            norm_sum_sq=sum(n * n for n in norms),
            loss_sum=float(len(norms)),
            tokens=len(norms),
        )
        if self.flat:
            from userdp.proto.layout import TensorLayout

            buffer = torch.cat([sums[name].reshape(-1).float() for name in SHAPES])
            sums = TensorLayout.of_shapes(SHAPES).views(buffer)
        return TaskSum(sums=sums, stats=stats)


def main(argv: list[str]) -> int:
    import logging

    from userdp.clients.grpc_client import Backoff, WorkerClient

    logging.basicConfig(level=logging.INFO)
    address, worker_id, shard_list = argv[:3]
    delay = float(argv[3]) if len(argv) > 3 else 0.0
    population = toy_population()
    shards = [(s, population.shard_sha256[s]) for s in shard_list.split(",")]
    client = WorkerClient(
        address,
        worker_id,
        shards,
        ToyCompute(delay_s=delay),
        backoff=Backoff(initial_s=0.1, max_s=1.0),
        heartbeat_s=0.5,
    )
    client.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
