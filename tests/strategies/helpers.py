"""Test helpers: the toy mean-estimation worker, a zero noise, a list ledger, the example plugin."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from userdp.strategies.noise import NoiseMechanism
from userdp.strategies.toy import ToyMeanEstimation

from userdp.run.registry import strategy_class

EXAMPLE_PLUGIN_DIR = Path(__file__).resolve().parents[2] / "examples" / "plugin"


def example_plugin() -> type:
    """``WarmupUls`` of examples/plugin/warmup_uls.py, imported as a config names it."""
    return strategy_class("warmup_uls:WarmupUls", str(EXAMPLE_PLUGIN_DIR))


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
