"""Test helpers: the toy mean-estimation worker, a zero noise, a list ledger."""

from __future__ import annotations

import numpy as np
from userdp.strategies.example_plugin import ToyMeanEstimation
from userdp.strategies.noise import NoiseMechanism


class ZeroNoise(NoiseMechanism):
    """NOT PRIVATE: lets tests check the non-noise arithmetic exactly."""

    def sample(self, step, like):
        return {name: np.zeros(np.shape(value)) for name, value in like.items()}


MeanEstimationWorker = ToyMeanEstimation


class ListLedger:
    def __init__(self):
        self.entries = []

    def append(self, step, mechanism):
        self.entries.append((step, mechanism.to_dict()))
