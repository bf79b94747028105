"""The noise stream inverts exactly the C the accountant accounts.

For every C that :class:`~userdp.strategies.dpftrl.BltDpFtrl` builds, the streaming noise is run on
unit impulses (z_t = e_t, so the n outputs stacked are the stream's C⁻¹) and multiplied by the
dense C that the balls-in-bins accountant builds from the CorrelationSpec in the strategy's
ledger entry (after its JSON round trip). The product must be the identity: the privacy guarantee
(Near Exact Privacy Amplification for Matrix Mechanisms, §2) holds for the released x + σC⁻¹Z
only if this C is the one accounted. And the accountant's C⁻¹ and the noise stream are one code
path: :meth:`~userdp.accounting.correlation.Correlation.inverse_step`, iid noise its identity case.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from userdp.accounting import balls_in_bins as bb
from userdp.accounting.correlation import (
    IDENTITY,
    BandedCorrelation,
    BltCorrelation,
    toeplitz_matrix,
)
from userdp.accounting.mechanisms import mechanism_from_dict
from userdp.strategies.blt import BandedNoise, Blt, BltNoise, CorrelatedNoise
from userdp.strategies.dpftrl import BltDpFtrl
from userdp.strategies.noise import GaussianNoise, NoiseRng

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


# The accountant's C⁻¹ and the noise stream are one recurrence: Correlation.inverse_step.

STREAMS = {
    "blt": (Blt((0.95, 0.6), (0.05, 0.3)), lambda c, rng: BltNoise(c, rng)),
    "banded": (BandedCorrelation((1.0, 0.6, 0.3)), lambda c, rng: BandedNoise(c.coefs, rng)),
    "identity": (IDENTITY, lambda c, rng: CorrelatedNoise(c, rng)),
}


class FixedRng(NoiseRng):
    """Step t's draw is row t of a fixed z."""

    def __init__(self, z: np.ndarray) -> None:
        super().__init__(_test_seed=0)
        self.rows = list(z)

    def normal_like(self, x):
        row = self.rows.pop(0)
        return torch.from_numpy(row.copy()) if isinstance(x, torch.Tensor) else row.copy()


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("name", sorted(STREAMS))
def test_noise_stream_is_the_accountants_inverse_on_a_fixed_z(name, backend) -> None:
    correlation, make_noise = STREAMS[name]
    n = 12
    z = np.random.default_rng(7).standard_normal((n, 5))
    noise = make_noise(correlation, FixedRng(z))
    assert noise.correlation == correlation
    like = np.zeros(5) if backend == "numpy" else torch.zeros(5, dtype=torch.float64)
    streamed = np.stack([np.asarray(noise.sample(t, {"w": like})["w"]) for t in range(n)])
    # the same object's recurrence by hand on the same kind of array, bit for bit
    state, by_hand = [], []
    for row in z:
        z_t = row.copy() if backend == "numpy" else torch.from_numpy(row.copy())
        x, state = correlation.inverse_step(z_t, state)
        by_hand.append(np.asarray(x))
    np.testing.assert_array_equal(streamed, np.stack(by_hand))
    # and the accountant's C⁻¹ (its first column is that recurrence on the unit impulse)
    dense = toeplitz_matrix(correlation.inverse_coefs(n)) @ z
    np.testing.assert_allclose(streamed, dense, rtol=0, atol=1e-12)
    np.testing.assert_allclose(correlation.matrix(n) @ streamed, z, rtol=0, atol=1e-12)


def test_the_stream_calls_the_correlations_inverse_step(monkeypatch) -> None:
    calls = []
    original = BltCorrelation.inverse_step

    def spy(self, z, state):
        calls.append(self)
        return original(self, z, state)

    monkeypatch.setattr(BltCorrelation, "inverse_step", spy)
    blt = Blt((0.9,), (0.2,))
    noise = BltNoise(blt, FixedRng(np.ones((4, 3))))
    for t in range(2):
        noise.sample(t, {"a": np.zeros(3), "b": np.zeros(3)})
    assert calls == [blt] * 4
    calls.clear()
    blt.inverse_coefs(3)
    assert calls == [blt] * 3


def test_iid_noise_is_the_identity_stream() -> None:
    z = np.random.default_rng(3).standard_normal((4, 6))
    iid = GaussianNoise(FixedRng(z))
    identity = CorrelatedNoise(IDENTITY, FixedRng(z))
    for t in range(4):
        a = iid.sample(t, {"w": np.zeros(6)})["w"]
        np.testing.assert_array_equal(identity.sample(t, {"w": np.zeros(6)})["w"], a)
    assert identity.buffers == {"w": []}
    assert IDENTITY.is_identity and IDENTITY.inverse_coefs(5).tolist() == [1.0, 0, 0, 0, 0]
