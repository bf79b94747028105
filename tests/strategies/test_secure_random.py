"""Secure noise: the keystream draw, its distribution, the grid, and the generator modes."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from userdp.strategies import secure_random
from userdp.strategies.noise import GaussianNoise, NoiseRng
from userdp.strategies.secure_random import SecureNormal, add_on_grid, grid_step

from userdp.testing.stats import binomial_interval, std_bounds

KEY = bytes(range(32))


def box_muller_reference(key: bytes, n: int) -> np.ndarray:
    """The draw restated from its definition, for n ≤ 2·65536 (one block): words 0..m−1 give
    the radius' uniform u₁ = (w & (2⁵³−1) + 1)·2⁻⁵³, words m..2m−1 the angle's u₂ = w·2⁻⁵³;
    z = (√(−2 ln u₁)·cos 2πu₂, then √(−2 ln u₁)·sin 2πu₂). Python floats, not torch."""
    m = (n + 1) // 2
    encryptor = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
    stream = encryptor.update(bytes(16 * m))
    words = [
        int.from_bytes(stream[8 * i : 8 * i + 8], "little") & (2**53 - 1) for i in range(2 * m)
    ]
    radius = [math.sqrt(-2.0 * math.log((w + 1) * 2.0**-53)) for w in words[:m]]
    angle = [2.0 * math.pi * w * 2.0**-53 for w in words[m:]]
    first = [r * math.cos(a) for r, a in zip(radius, angle, strict=True)]
    second = [r * math.sin(a) for r, a in zip(radius, angle, strict=True)]
    return np.array((first + second)[:n])


@pytest.mark.parametrize("n", [1, 2, 7, 1000])
def test_the_draw_is_box_muller_on_the_aes_ctr_keystream(n):
    """A known-answer test: the draws are a deterministic function of the AES-256-CTR keystream
    (so their unpredictability is the cipher's); any other source fails it."""
    got = SecureNormal(KEY).standard_normal(n).numpy()
    want = box_muller_reference(KEY, n)
    # float64 libm vs torch's vectorized log/cos/sin: a few ulps of |z| ≤ 9
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-13)


def test_consecutive_calls_continue_the_stream_and_keys_differ():
    rng = SecureNormal(KEY)
    first, second = rng.standard_normal(500).numpy(), rng.standard_normal(500).numpy()
    assert not np.any(first == second)
    assert not np.any(SecureNormal(bytes(32)).standard_normal(500).numpy() == first)
    assert not np.any(
        SecureNormal().standard_normal(500).numpy() == SecureNormal().standard_normal(500).numpy()
    )


def test_the_draws_are_standard_normal():
    """10⁶ draws spanning many blocks: std inside its exact χ² interval, mean within 5 standard
    errors, and the two-sided 3σ tail mass inside its binomial interval."""
    z = SecureNormal(KEY).standard_normal(1_000_001).numpy()
    low, high = std_bounds(z.size)
    assert low <= float(np.sqrt(np.mean(z**2))) <= high
    assert abs(float(z.mean())) <= 5.0 / math.sqrt(z.size)
    tail = math.erfc(3.0 / math.sqrt(2.0))  # P(|Z| > 3) = 0.0027
    lo, hi = binomial_interval(z.size, tail)
    assert lo <= int(np.sum(np.abs(z) > 3.0)) <= hi


def test_the_radius_uniform_is_refined_so_the_tail_reaches_twelve(monkeypatch):
    """u₁ below 2⁻²¹ takes 53 more bits: the smallest possible u₁ is 2⁻¹⁰⁶, radius √(212 ln 2)
    ≈ 12.12, where a plain 53-bit uniform would stop at √(106 ln 2) ≈ 8.57."""
    rng = SecureNormal(KEY)
    calls = []

    def words(count):
        calls.append(count)
        return torch.zeros(count, dtype=torch.int64)  # every word 0: u₁ hits its smallest value

    monkeypatch.setattr(rng, "_words", words)
    z = rng.standard_normal(4).numpy()
    assert calls == [4, 2]  # the block, then one refinement word per small u₁
    assert z[0] == pytest.approx(math.sqrt(212.0 * math.log(2.0)), rel=1e-12)  # angle 0: cos = 1


@pytest.mark.parametrize(("std", "step"), [(3.0, 2.0**-7), (1.0, 2.0**-8), (0.9, 2.0**-9)])
def test_grid_step_is_a_power_of_two_between_std_over_512_and_std_over_256(std, step):
    assert grid_step(std) == step
    assert std / 512 < grid_step(std) <= std / 256
    with pytest.raises(ValueError, match="positive and finite"):
        grid_step(0.0)


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_releases_lie_on_the_grid_whatever_the_inputs_low_bits(kind):
    """Two inputs that differ only in their low-order bits give releases from the same set (the
    grid), each within half a step of value + std·z."""
    std = 3.0
    base = np.linspace(-5.0, 5.0, 4001) / 3.0
    z = SecureNormal(KEY).standard_normal(base.size).numpy()
    for value in (base, base + 1e-9):
        if kind == "torch":
            out = add_on_grid(
                torch.tensor(value, dtype=torch.float32), std, torch.tensor(z)
            ).numpy()
            exact = value.astype(np.float32).astype(np.float64) + std * z
        else:
            out = add_on_grid(value, std, z)
            exact = value + std * z
        cells = out.astype(np.float64) / grid_step(std)
        np.testing.assert_array_equal(cells, np.round(cells))
        assert np.max(np.abs(out - exact)) <= grid_step(std) / 2


def test_grid_keeps_float_dtypes_and_widens_integers():
    assert add_on_grid(np.zeros(3, np.float32), 1.0, np.zeros(3)).dtype == np.float32
    assert add_on_grid(np.zeros(3, np.int64), 1.0, np.zeros(3)).dtype == np.float64
    assert add_on_grid(torch.zeros(3, dtype=torch.bfloat16), 1.0, torch.zeros(3)).dtype == (
        torch.bfloat16
    )
    assert add_on_grid(torch.zeros(3, dtype=torch.int32), 1.0, torch.zeros(3)).dtype == (
        torch.float64
    )


def test_grid_handles_tensors_larger_than_one_block(monkeypatch):
    monkeypatch.setattr(secure_random, "_GRID_CHUNK", 1000)
    value = torch.linspace(-1, 1, 2500)
    z = torch.linspace(-2, 2, 2500, dtype=torch.float64)
    out = add_on_grid(value, 0.5, z)
    want = torch.round((value.double() + 0.5 * z) / grid_step(0.5)) * grid_step(0.5)
    torch.testing.assert_close(out, want.float(), rtol=0, atol=0)


def test_noise_rng_is_secure_by_default_and_fast_on_request():
    assert NoiseRng().secure
    assert not NoiseRng(secure=False).secure
    like = {"w": np.zeros(2000)}
    secure = GaussianNoise(NoiseRng()).add(0, like, std=3.0)["w"]
    fast = GaussianNoise(NoiseRng(secure=False)).add(0, like, std=3.0)["w"]
    cells = secure / grid_step(3.0)
    np.testing.assert_array_equal(cells, np.round(cells))
    assert not np.array_equal(fast / grid_step(3.0), np.round(fast / grid_step(3.0)))


def test_deterministic_secure_rng_replays_only_its_own_stream():
    """for_testing(seed, secure=True): the same seed gives the same draws; a reseed moves on."""
    a, b = NoiseRng.for_testing(5, secure=True), NoiseRng.for_testing(5, secure=True)
    x = torch.zeros(300)
    first = a.normal_like(x)
    torch.testing.assert_close(first, b.normal_like(x))
    a.reseed()
    assert not torch.any(a.normal_like(x) == first)
    want = SecureNormal(hashlib.sha256(repr(5).encode()).digest()).standard_normal(300)
    torch.testing.assert_close(first, want)


def test_facts_say_a_fixed_test_seed_is_not_private():
    from userdp.strategies.builtins import UserLevelSampling
    from userdp.strategies.noise import DETERMINISTIC_NOISE_CAVEAT, FAST_NOISE_CAVEAT

    def facts(rng):
        strategy = UserLevelSampling(
            noise_multiplier=1.0, clip_norm=1.0, sampling_prob=0.1, noise=GaussianNoise(rng)
        )
        return strategy.facts()

    for rng in (NoiseRng.for_testing(1, secure=True), NoiseRng.for_testing(1)):
        stated = facts(rng)
        assert stated.secure_noise is False and DETERMINISTIC_NOISE_CAVEAT in stated.caveats
    fast = facts(NoiseRng(secure=False))
    assert fast.secure_noise is False and FAST_NOISE_CAVEAT in fast.caveats
    secure = facts(NoiseRng())
    assert secure.secure_noise is True
    assert not {FAST_NOISE_CAVEAT, DETERMINISTIC_NOISE_CAVEAT} & set(secure.caveats)


def test_fast_release_widens_integer_tensors_instead_of_truncating_the_noise():
    out = NoiseRng(secure=False).release(
        torch.zeros(4, dtype=torch.int64), 0.8, torch.ones(4, dtype=torch.float64)
    )
    assert out.dtype == torch.float64 and torch.all(out == 0.8)


def test_noisy_scalar_is_on_the_grid_and_centred():
    rng = NoiseRng.for_testing(7, secure=True)
    values = np.array([rng.noisy_scalar(1.0 / 3.0, 2.0) for _ in range(4000)])
    cells = values / grid_step(2.0)
    np.testing.assert_array_equal(cells, np.round(cells))
    assert abs(values.mean() - 1.0 / 3.0) <= 5 * 2.0 / math.sqrt(values.size)
