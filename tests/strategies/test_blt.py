"""BLT / banded correlated noise: streaming equals dense C⁻¹Z; optimizer matches jax_privacy."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.linalg import solve_triangular
from userdp.strategies.blt import (
    BandedNoise,
    Blt,
    BltError,
    BltNoise,
    banded_inverse_coefs,
    blt_loss,
    max_error,
    mean_error,
    min_sep_sensitivity_squared,
    optimize_banded,
    optimize_blt,
    toeplitz_matrix,
)
from userdp.strategies.noise import NoiseRng

# jax_privacy 2.0.0 buffered_toeplitz.optimize reference values
REF_SINGLE = Blt((0.998952, 0.978231, 0.741555), (0.044871, 0.121107, 0.310793))
REF_MINSEP = Blt((0.986072, 0.623144), (0.231319, 0.272538))


class ScriptedRng(NoiseRng):
    """Returns pre-drawn standard normals, so streaming output can be compared with dense."""

    def __init__(self, rows):
        super().__init__(_test_seed=0)
        self.rows = list(rows)

    def normal_like(self, x):
        z = self.rows.pop(0)
        return torch.tensor(z, dtype=x.dtype) if isinstance(x, torch.Tensor) else z.copy()


def _stream(noise, steps, shape, make=np.zeros):
    out = []
    for t in range(steps):
        out.append(noise.sample(t, {"w": make(shape)})["w"])
    return out


def test_blt_streaming_equals_dense_inverse():
    n, shape = 60, (3, 4)
    rng = np.random.default_rng(0)
    z = rng.standard_normal((n, *shape))
    noise = BltNoise(REF_SINGLE, ScriptedRng(z))
    streamed = np.stack(_stream(noise, n, shape))
    dense_c = toeplitz_matrix(REF_SINGLE.toeplitz_coefs(n))
    expected = solve_triangular(dense_c, z.reshape(n, -1), lower=True).reshape(z.shape)
    assert np.max(np.abs(streamed - expected)) < 1e-10
    # and the inverse coefficients are column 0 of C⁻¹
    inv = np.linalg.inv(dense_c)
    assert np.max(np.abs(REF_SINGLE.inverse_coefs(n) - inv[:, 0])) < 1e-10


def test_blt_streaming_torch_float64_matches_numpy():
    n = 20
    z = np.random.default_rng(1).standard_normal((n, 5))
    a = np.stack(_stream(BltNoise(REF_MINSEP, ScriptedRng(z)), n, (5,)))
    b = _stream(
        BltNoise(REF_MINSEP, ScriptedRng(z)), n, (5,), lambda s: torch.zeros(s, dtype=torch.float64)
    )
    assert np.max(np.abs(a - torch.stack(b).numpy())) < 1e-12


def test_blt_stream_survives_checkpoint():
    n, cut = 30, 12
    z = np.random.default_rng(2).standard_normal((n, 4))
    whole = np.stack(_stream(BltNoise(REF_SINGLE, ScriptedRng(z)), n, (4,)))
    first = BltNoise(REF_SINGLE, ScriptedRng(z[:cut]))
    part1 = _stream(first, cut, (4,))
    state = first.state_dict()
    resumed = BltNoise(REF_SINGLE, ScriptedRng(z[cut:]))
    resumed.load_state_dict(state)
    part2 = [resumed.sample(t, {"w": np.zeros(4)})["w"] for t in range(cut, n)]
    assert np.max(np.abs(np.stack(part1 + part2) - whole)) < 1e-12


def test_blt_refuses_out_of_order_steps():
    noise = BltNoise(REF_SINGLE, NoiseRng.for_testing(0))
    noise.sample(0, {"w": np.zeros(2)})
    with pytest.raises(BltError):
        noise.sample(0, {"w": np.zeros(2)})
    with pytest.raises(BltError):
        noise.sample(5, {"w": np.zeros(2)})


def test_banded_streaming_equals_dense_inverse():
    n, coefs = 40, [1.0, 0.5, 0.25, 0.1]
    z = np.random.default_rng(3).standard_normal((n, 6))
    streamed = np.stack(_stream(BandedNoise(coefs, ScriptedRng(z)), n, (6,)))
    padded = np.zeros(n)
    padded[: len(coefs)] = coefs
    expected = solve_triangular(toeplitz_matrix(padded), z, lower=True)
    assert np.max(np.abs(streamed - expected)) < 1e-10
    assert (
        np.max(
            np.abs(banded_inverse_coefs(coefs, n) - np.linalg.inv(toeplitz_matrix(padded))[:, 0])
        )
        < 1e-10
    )


def test_losses_reproduce_jax_privacy_reference():
    assert blt_loss(REF_SINGLE, 1000) == pytest.approx(10.692, rel=1e-4)
    sens2 = min_sep_sensitivity_squared(REF_MINSEP.toeplitz_coefs(1000), 100, 10)
    assert sens2 == pytest.approx(46.8146, rel=1e-4)
    assert blt_loss(REF_MINSEP, 1000, 100, 10) == pytest.approx(223.591, rel=1e-4)
    # identity C: loss n (single participation)
    assert max_error(np.eye(1000)[0]) == pytest.approx(1000)


def test_optimize_single_participation_matches_reference():
    blt, loss = optimize_blt(1000, 3)
    assert loss == pytest.approx(10.692, rel=1e-4)
    np.testing.assert_allclose(blt.buf_decay, REF_SINGLE.buf_decay, atol=1e-5)
    np.testing.assert_allclose(blt.output_scale, REF_SINGLE.output_scale, atol=1e-5)


def test_optimize_min_sep_matches_reference():
    blt, loss = optimize_blt(1000, 2, min_sep=100, participations=10)
    assert loss == pytest.approx(223.591, rel=1e-4)
    np.testing.assert_allclose(blt.buf_decay, REF_MINSEP.buf_decay, atol=1e-5)


def test_mean_error_is_the_squared_frobenius_norm_over_n():
    n, blt = 12, Blt((0.9, 0.3), (0.2, 0.1))
    dense = np.tril(np.ones((n, n))) @ np.linalg.inv(blt.matrix(n))
    assert mean_error(blt.inverse_coefs(n)) == pytest.approx(np.sum(dense**2) / n, rel=1e-12)
    assert max_error(blt.inverse_coefs(n)) == pytest.approx(np.max(np.sum(dense**2, axis=1)))


def test_each_objective_wins_on_its_own_error():
    n, bins, epochs = 24, 6, 4
    blts = {
        obj: optimize_blt(n, 2, min_sep=bins, participations=epochs, objective=obj)[0]
        for obj in ("rmse", "max-error")
    }
    bands = {
        obj: optimize_banded(n, 3, min_sep=bins, participations=epochs, objective=obj)[0]
        for obj in ("rmse", "max-error")
    }

    def loss(coefs, inverse, error):
        return min_sep_sensitivity_squared(coefs, bins, epochs) * error(inverse)

    for mine, other, error in (("rmse", "max-error", mean_error), ("max-error", "rmse", max_error)):
        a, b = blts[mine], blts[other]
        assert loss(a.toeplitz_coefs(n), a.inverse_coefs(n), error) <= loss(
            b.toeplitz_coefs(n), b.inverse_coefs(n), error
        ) * (1 + 1e-9)
        a, b = np.pad(bands[mine], (0, n - 3)), np.pad(bands[other], (0, n - 3))
        assert loss(a, banded_inverse_coefs(bands[mine], n), error) <= loss(
            b, banded_inverse_coefs(bands[other], n), error
        ) * (1 + 1e-9)
    with pytest.raises(BltError, match="objective='mse'"):
        optimize_blt(n, 2, objective="mse")


def test_blt_rejects_bad_parameters():
    with pytest.raises(BltError):
        Blt((1.2,), (0.1,))
    with pytest.raises(BltError):
        Blt((0.5, 0.4), (0.1,))
    with pytest.raises(BltError):
        BandedNoise([0.0, 1.0])


def test_blt_correlation_spec_is_json_round_trip():
    spec = REF_SINGLE.correlation()
    assert spec.name == "blt"
    assert dict(spec.params)["buf_decay"] == REF_SINGLE.buf_decay


def test_optimize_banded_beats_identity_and_matches_a_grid_search():
    n = 200
    _, identity = optimize_banded(n, 1)
    assert identity == pytest.approx(n)
    coefs, loss = optimize_banded(n, 2)
    grid = min(
        (1 + c * c) * max_error(banded_inverse_coefs([1.0, c], n)) for c in np.linspace(0, 1, 2001)
    )
    assert loss <= grid * (1 + 1e-6) and loss < identity
    _, loss4 = optimize_banded(n, 4)
    assert loss4 <= loss * (1 + 1e-9)
    # with min-sep b = bands and k participations, sensitivity² is k·‖c‖²
    c, loss_k = optimize_banded(n, 4, min_sep=4, participations=3)
    assert loss_k == pytest.approx(3 * float(c @ c) * max_error(banded_inverse_coefs(c, n)))
