"""The commitment to a step's noise draw: a SHA-256 of the release's noisy values that changes
with any value, name, dtype or released statistic, and is the same for numpy and torch."""

from __future__ import annotations

import numpy as np
import torch
from userdp.strategies.base import Cohort, NoisyStatistic, Release
from userdp.strategies.release_commitment import release_sha256


def _release(sums, statistics=None) -> Release:
    return Release(0, Cohort(0, ("u0",), 1.0), sums, statistics or {})


def test_the_commitment_follows_every_released_value():
    w = np.linspace(-1.0, 1.0, 12, dtype=np.float32).reshape(3, 4)
    base = release_sha256(_release({"w": w, "b": np.ones(4, np.float32)}))
    assert base == release_sha256(_release({"b": np.ones(4, np.float32), "w": w.copy()}))
    assert base == release_sha256(_release({"w": torch.from_numpy(w), "b": torch.ones(4)}))
    one_ulp = w.copy()
    one_ulp[2, 3] = np.nextafter(one_ulp[2, 3], np.float32(2.0))
    changed = [
        {"w": one_ulp, "b": np.ones(4, np.float32)},
        {"w": w.astype(np.float64), "b": np.ones(4, np.float32)},
        {"w": w.reshape(4, 3), "b": np.ones(4, np.float32)},
        {"v": w, "b": np.ones(4, np.float32)},
    ]
    digests = {release_sha256(_release(sums)) for sums in changed}
    assert len(digests) == len(changed) and base not in digests
    statistic = {"clipped_fraction": NoisyStatistic(0.25, 1.0)}
    with_statistic = release_sha256(_release({"w": w, "b": np.ones(4, np.float32)}, statistic))
    assert with_statistic != base and len(with_statistic) == 64
