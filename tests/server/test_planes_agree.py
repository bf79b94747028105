"""The two data planes release the same sum for the same cohort.

The same workers, shards and sampler seed run one noiseless step through the gRPC plane (each
task's sum streamed to the coordinator, added in float64) and through the collective plane (the
sums held, reduced over a gloo group in float32); the released sums agree within float32
rounding, and both count the same units.
"""

from __future__ import annotations

import torch
from userdp.server.coordinator import CoordinatorSettings
from userdp.server.group_plane import GroupSettings
from userdp.strategies.builtins import UserLevelSampling
from userdp.strategies.optimizers import Sgd

from .harness import make_loopback

GROUP = GroupSettings(store_bind="127.0.0.1", timeout_s=60.0)
SETTINGS = CoordinatorSettings(step_deadline_s=120, task_deadline_s=60, worker_startup_s=300)
TOLERANCE = 1e-5
"""The collective plane adds up to a cohort's (~12) float32 sums of norm ≤ C = 1 in float32:
a few float32 ulps of values below ~12, far under 1e-5."""


class RecordingUls(UserLevelSampling):
    """userdp's ULS strategy, keeping each release's sum (the step's only output)."""

    def __init__(self) -> None:
        super().__init__(
            noise_multiplier=1.0, clip_norm=1.0, sampling_prob=0.3, seed=0, optimizer=Sgd(0.1)
        )
        self.released: list[dict[str, torch.Tensor]] = []

    def server_update(self, params, release) -> None:
        self.released.append({n: t.detach().clone() for n, t in release.noisy_sum.items()})
        super().server_update(params, release)


def _released(tmp_path, group) -> tuple[dict[str, torch.Tensor], int]:
    tmp_path.mkdir()
    strategy = RecordingUls()
    loop = make_loopback(tmp_path, strategy=strategy, settings=SETTINGS, group=group)
    shards = sorted(loop.coordinator.population.shard_sha256)
    try:
        for i in range(3):
            loop.add_worker(f"w{i}", shards[i::3])
        loop.coordinator.wait_for_workers()
        (report,) = loop.coordinator.run(1)
    finally:
        loop.close()
    (released,) = strategy.released
    return released, report.stats.count


def test_the_grpc_and_collective_planes_release_the_same_sum(tmp_path):
    streamed, streamed_units = _released(tmp_path / "grpc", None)
    reduced, reduced_units = _released(tmp_path / "collective", GROUP)
    assert streamed_units == reduced_units > 0
    assert set(streamed) == set(reduced)
    for name, value in streamed.items():
        error = float((value.double() - reduced[name].double()).abs().max())
        assert error <= TOLERANCE, f"{name!r}: the planes' released sums differ by {error:.3g}"
