"""Noise is N(0, σ²C²), fresh per call and after resume; optimizers update in place."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from userdp.strategies import Adafactor, Adam, GaussianNoise, NoiseRng, Sgd, UserLevelSampling
from userdp.strategies.tensors import TensorDictError, sum_tensor_dicts


def test_gaussian_noise_has_std_sigma_c_numpy_and_torch():
    noise = GaussianNoise(NoiseRng.for_testing(1))
    summed = {"a": np.zeros(200_000), "b": torch.zeros(100_000)}
    noisy = noise.add(0, summed, std=2.5)
    assert np.std(noisy["a"]) == pytest.approx(2.5, rel=0.01)
    assert isinstance(noisy["b"], torch.Tensor) and noisy["b"].dtype == torch.float32
    assert float(noisy["b"].std()) == pytest.approx(2.5, rel=0.01)
    assert abs(float(np.mean(noisy["a"]))) < 0.05
    assert not summed["b"].any()  # input untouched


def test_production_noise_is_fresh_every_call_and_every_strategy():
    summed = {"w": np.zeros(8)}
    a = UserLevelSampling(noise_multiplier=1.0, clip_norm=1.0, sampling_prob=0.1, seed=3)
    b = UserLevelSampling(noise_multiplier=1.0, clip_norm=1.0, sampling_prob=0.1, seed=3)
    first, again = a.add_noise(0, summed)["w"], a.add_noise(0, summed)["w"]
    assert not np.allclose(first, again)  # a retried step draws new noise
    assert not np.allclose(first, b.add_noise(0, summed)["w"])  # config seed does not seed noise


def test_resume_does_not_replay_noise_even_in_test_mode():
    rng = NoiseRng.for_testing(5)
    noise = GaussianNoise(rng)
    state = noise.state_dict()
    before = noise.sample(0, {"w": np.zeros(6)})["w"]
    clone = GaussianNoise(NoiseRng.for_testing(5))
    clone.load_state_dict(state)
    assert not np.allclose(clone.sample(0, {"w": np.zeros(6)})["w"], before)
    assert "seed" not in str(state)


def test_sum_rejects_mismatch_and_nonfinite():
    ok = {"w": np.ones(3, np.float32)}
    assert sum_tensor_dicts([ok, ok])["w"].dtype == np.float64
    with pytest.raises(TensorDictError):
        sum_tensor_dicts([ok, {"w": np.ones(4, np.float32)}])
    with pytest.raises(TensorDictError):
        sum_tensor_dicts([ok, {"w": np.ones(3, np.float64)}])
    with pytest.raises(TensorDictError):
        sum_tensor_dicts([ok, {"v": np.ones(3, np.float32)}])
    with pytest.raises(TensorDictError):
        sum_tensor_dicts([ok, {"w": np.array([1, np.nan, 1], np.float32)}])


def test_sgd_momentum_and_adam_match_hand_computation():
    p = {"w": np.array([1.0, -2.0])}
    g = {"w": np.array([0.5, 0.5])}
    opt = Sgd(0.1, momentum=0.9)
    opt.step(p, g)
    opt.step(p, g)
    np.testing.assert_allclose(
        p["w"], [1.0 - 0.1 * 0.5 - 0.1 * 0.95, -2.0 - 0.1 * 0.5 - 0.1 * 0.95]
    )
    q = {"w": torch.tensor([1.0, -2.0])}
    adam = Adam(0.01)
    adam.step(q, {"w": torch.tensor([0.5, -3.0])})
    # first Adam step moves each coordinate by lr·sign(g)
    np.testing.assert_allclose(q["w"].numpy(), [0.99, -1.99], atol=1e-6)


def test_adafactor_factored_update_and_state_round_trip():
    p = {"m": np.ones((3, 4)), "v": np.ones(4)}
    g = {"m": np.arange(12.0).reshape(3, 4) + 1, "v": np.full(4, 2.0)}
    opt = Adafactor(0.1)
    opt.step(p, g)
    assert opt.slots["m"]["r"].shape == (3, 1) and opt.slots["m"]["c"].shape == (1, 4)
    # update is clipped to RMS ≤ 1, so no coordinate moves by more than lr·√(numel)
    assert np.all(np.abs(p["m"] - 1) <= 0.1 * np.sqrt(12) + 1e-12)
    np.testing.assert_allclose(p["v"], 1 - 0.1)  # vector: g/√(g²) = 1
    restored = Adafactor(0.1)
    restored.load_state_dict(opt.state_dict())
    p2 = {k: v.copy() for k, v in p.items()}
    opt.step(p, g)
    restored.step(p2, g)
    np.testing.assert_allclose(p["m"], p2["m"])
    with pytest.raises(ValueError):
        Sgd(0.1).load_state_dict(opt.state_dict())


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Sgd(True), "learning_rate=True is not a number"),
        (lambda: Sgd(float("nan")), "learning_rate=nan is out of range"),
        (lambda: Sgd(0.1, momentum=True), "momentum=True is out of range"),
        (lambda: Sgd(0.1, momentum=1.0), "expected a float in [0, 1)"),
    ],
)
def test_optimizer_hyperparameters_are_checked_like_every_other_range(build, message) -> None:
    """One validation module: a bool is not a learning rate, momentum is in [0, 1)."""
    with pytest.raises(ValueError) as info:
        build()
    assert message in str(info.value)
