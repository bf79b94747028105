"""The noise stream inverts exactly the C the accountant accounts.

For every C that :class:`~userdp.strategies.dpftrl.BltDpFtrl` builds, the streaming noise is run on
unit impulses (z_t = e_t, so the n outputs stacked are the stream's C⁻¹) and multiplied by the
dense C that the balls-in-bins accountant builds from the CorrelationSpec in the strategy's
ledger entry (after its JSON round trip). The product must be the identity: the privacy guarantee
(Near Exact Privacy Amplification for Matrix Mechanisms, §2) holds for the released x + σC⁻¹Z
only if this C is the one accounted.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from userdp.accounting import balls_in_bins as bb
from userdp.accounting.mechanisms import mechanism_from_dict
from userdp.strategies.blt import Blt
from userdp.strategies.dpftrl import BltDpFtrl
from userdp.strategies.noise import NoiseRng

BINS, EPOCHS = 10, 5
N = BINS * EPOCHS

CONFIGS = {
    "given-blt": dict(blt=Blt((0.95, 0.6), (0.05, 0.3))),
    "optimized-blt-2": dict(buffers=2),
    "optimized-blt-3": dict(buffers=3),
    "given-banded": dict(banded_coefs=[1.0, 0.6, 0.3, 0.1]),
    "optimized-banded": dict(bands=4),
}


class UnitImpulseRng(NoiseRng):
    """Step t's "normal" draw is the unit vector e_t, so stream output t is row t of C⁻¹."""

    def __init__(self) -> None:
        super().__init__(_test_seed=0)
        self.step = 0

    def normal_like(self, x):
        z = np.zeros(tuple(x.shape))
        z[self.step] = 1.0
        self.step += 1
        return torch.from_numpy(z).to(x.dtype) if isinstance(x, torch.Tensor) else z


def _streamed_inverse(strategy: BltDpFtrl, like) -> np.ndarray:
    rows = [strategy.noise.sample(t, {"w": like})["w"] for t in range(N)]
    return np.stack([np.asarray(r, dtype=np.float64) for r in rows])


def _accounted_matrix(strategy: BltDpFtrl) -> np.ndarray:
    entry = json.loads(json.dumps(strategy.mechanism().to_dict()))
    mechanism = mechanism_from_dict(entry)
    return bb.correlation_matrix(mechanism.correlation, mechanism.bins * mechanism.epochs)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_stream_inverts_the_accounted_matrix(config, backend):
    strategy = BltDpFtrl(
        noise_multiplier=1.0,
        clip_norm=1.0,
        bins=BINS,
        epochs=EPOCHS,
        rng=UnitImpulseRng(),
        **CONFIGS[config],
    )
    like = np.zeros(N) if backend == "numpy" else torch.zeros(N, dtype=torch.float64)
    c_inv = _streamed_inverse(strategy, like)
    c = _accounted_matrix(strategy)
    assert c is not None and not np.allclose(c, np.eye(N))  # a real correlation, not C = I
    assert np.max(np.abs(c_inv @ c - np.eye(N))) < 1e-10
    assert np.max(np.abs(c @ c_inv - np.eye(N))) < 1e-10
