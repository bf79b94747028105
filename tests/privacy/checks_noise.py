"""Noise checks on the real strategies in the reference step loop (``strategies.local_step``).

Each ``check_*`` runs the real hooks (sample → sum → add_noise → server_update) through
:func:`userdp.strategies.local_step.run_local_step` and raises AssertionError when a DP property
fails.
The expected values are computed from this module's constants (σ, C, q, N, G, lr), never read
back from the code under test, so a bug cannot cancel itself out.

The checks: an absolute noise oracle (an exact χ² test of the std of the released update with
zero or known contributions), expected-cohort normalization (the step is chosen so the realized
cohort is ≥ 25% off the expected one), and noise reuse (independence across steps, retries and
resumes), which the noise-calibration test of "Finding Private Bugs: Debugging Implementations of
Differentially Private Stochastic Gradient Descent" (§3.2) also detects.
"""

from __future__ import annotations

import math

import numpy as np
from userdp.strategies.adaptive_clipping import AdaptiveClipping
from userdp.strategies.builtins import ExampleLevelSampling, UserLevelSampling
from userdp.strategies.dpftrl import BltDpFtrl
from userdp.strategies.local_step import run_local_step
from userdp.strategies.noise import GaussianNoise, NoiseRng
from userdp.strategies.optimizers import Sgd
from userdp.strategies.unit_stats import UnitStats

from .stats import ALPHA, assert_gaussian_noise, assert_uncorrelated

# The mechanism's constants. Chosen so every classic wrong factor moves the std far outside the
# ±1.2% acceptance interval of 10⁵ coordinates: σ² vs σ (×2), σ vs σ·C (×1/3), √B (×4.5),
# 1/B (×1/20), realized vs expected cohort (≥ ±25%, enforced below).
SIGMA = 2.0
CLIP = 3.0
LR = 0.5
N_USERS = 400
Q = 0.05  # expected cohort qN = 20
G = 4  # ELS: examples per user in D_sub
BINS = 20  # balls-in-bins: expected cohort N/b = 20
BANDED = (1.0, 0.5)  # banded Toeplitz C for BLT-DP-FTRL: (C⁻¹)_k = (−0.5)^k
SAMPLER_SEED = 11
NOISE_SEED = 20240607
SHAPES = {"w": (400, 256), "b": (512,)}  # 102 912 coordinates
MIN_COHORT_GAP = 0.25


def user_ids() -> list[str]:
    return [f"u{i:04d}" for i in range(N_USERS)]


def examples_per_user() -> dict[str, int]:
    """A fixed, uneven population for ELS: 1..9 examples per user."""
    return {u: 1 + (7 * i) % 9 for i, u in enumerate(user_ids())}


def dsub_size() -> int:
    """|D_sub| = Σ_u min(n_u, G), computed here independently of the sampler."""
    return sum(min(n, G) for n in examples_per_user().values())


ELS_P = 20.0 / dsub_size()  # expected batch p·|D_sub| = 20


def zero_params() -> dict[str, np.ndarray]:
    return {name: np.zeros(shape) for name, shape in SHAPES.items()}


def zero_compute(task, unit_ids, params):
    """A worker whose every unit contributes zero (so the release is pure noise)."""
    sums = {name: np.zeros_like(np.asarray(value)) for name, value in params.items()}
    return sums, UnitStats(count=len(unit_ids))


def test_rng() -> GaussianNoise:
    return GaussianNoise(NoiseRng.for_testing(NOISE_SEED))


def make_strategy(kind: str, production_noise: bool = False):
    """The real built-in strategy of ``kind`` with this module's constants; its noise comes from
    a fixed test seed, or with ``production_noise`` from the default generator (os.urandom)."""
    if kind == "uls":
        return UserLevelSampling(
            noise_multiplier=SIGMA,
            clip_norm=CLIP,
            sampling_prob=Q,
            seed=SAMPLER_SEED,
            noise=None if production_noise else test_rng(),
            optimizer=Sgd(LR),
        )
    if kind == "els":
        return ExampleLevelSampling(
            noise_multiplier=SIGMA,
            clip_norm=CLIP,
            sampling_prob=ELS_P,
            group_size=G,
            seed=SAMPLER_SEED,
            noise=test_rng(),
            optimizer=Sgd(LR),
        )
    if kind == "blt":
        return BltDpFtrl(
            noise_multiplier=SIGMA,
            clip_norm=CLIP,
            bins=BINS,
            epochs=2,
            banded_coefs=list(BANDED),
            seed=SAMPLER_SEED,
            rng=NoiseRng.for_testing(NOISE_SEED),
            optimizer=Sgd(LR),
        )
    raise ValueError(kind)


def population(kind: str):
    return examples_per_user() if kind == "els" else user_ids()


def expected_cohort(kind: str) -> float:
    """The normalizer the mechanism promises, from the constants: qN, p|D_sub|, N/b."""
    return {"uls": Q * N_USERS, "els": ELS_P * dsub_size(), "blt": N_USERS / BINS}[kind]


def banded_noise_variance(step: int) -> float:
    """Var of (C⁻¹Z)_step per coordinate for the banded C = Toeplitz(BANDED): Σ_{k≤t} ĉ_k²."""
    inverse = [1.0 / BANDED[0]]
    for k in range(1, step + 1):
        acc = sum(BANDED[j] * inverse[k - j] for j in range(1, min(k, len(BANDED) - 1) + 1))
        inverse.append(-acc / BANDED[0])
    return float(sum(c * c for c in inverse))


def step_with_cohort_gap(strategy, pop, start: int = 0, limit: int = 400) -> tuple[int, int]:
    """The first step ≥ start whose realized cohort differs from the expected one by at least
    MIN_COHORT_GAP (relative), so normalizing by the realized size is detectable."""
    expected = None
    for step in range(start, limit):
        cohort = strategy.sample_cohort(step, pop)
        expected = cohort.expected_size
        if abs(len(cohort) - expected) >= MIN_COHORT_GAP * expected:
            return step, len(cohort)
    raise AssertionError(f"no step in [{start}, {limit}) has a cohort ≥ 25% off {expected}")


def released_update(strategy, step, pop, compute=zero_compute, params=None):
    """Run one real step; return (params before − params after) per tensor, and the cohort size."""
    params = params if params is not None else zero_params()
    before = {name: np.array(value, copy=True) for name, value in params.items()}
    record = run_local_step(strategy, step, params, pop, compute)
    return {name: before[name] - np.asarray(params[name]) for name in params}, record.units


# ---------------------------------------------------------------------------------------------
# checks


def check_noise_magnitude(kind: str = "uls") -> None:
    """R4 + R8: with zero contributions, the released update of one step is exactly
    N(0, (lr·σ·C/E)²) per coordinate, E the EXPECTED cohort (qN, p|D_sub|, N/b) — tested on a step
    whose realized cohort is ≥ 25% off E. BLT: step t carries σ·C·(C⁻¹Z)_t, variance
    σ²C²·Σ_{k≤t} ĉ_k²; steps 0..2 are checked."""
    strategy = make_strategy(kind)
    pop = population(kind)
    expected = expected_cohort(kind)
    if kind == "blt":
        for step in range(3):
            update, realized = released_update(strategy, step, pop)
            std = LR * SIGMA * CLIP * banded_noise_variance(step) ** 0.5 / expected
            values = np.concatenate([v.ravel() for v in update.values()])
            assert_gaussian_noise(
                values, std, f"BLT step {step} (cohort {realized}, expected {expected:g})"
            )
        return
    step, realized = step_with_cohort_gap(make_strategy(kind), pop)
    update, units = released_update(strategy, step, pop)
    assert units == realized, f"step {step}: {units} units ran, the sampler drew {realized}"
    values = np.concatenate([v.ravel() for v in update.values()])
    assert_gaussian_noise(
        values,
        LR * SIGMA * CLIP / expected,
        f"{kind} step {step}: update = lr·(Σclip + σ·C·z)/E with E = {expected:g} expected units "
        f"({realized} realized)",
    )


def check_noise_fresh_across_steps() -> None:
    """Noise of two consecutive steps is independent (production generator, os.urandom)."""
    strategy = make_strategy("uls", production_noise=True)
    pop = user_ids()
    first, _ = released_update(strategy, 0, pop)
    second, _ = released_update(strategy, 1, pop)
    for name in SHAPES:
        assert_uncorrelated(first[name], second[name], f"steps 0 and 1, tensor {name!r}")
    # within one step, two tensors must not share a stream either
    n = SHAPES["b"][0]
    assert_uncorrelated(first["w"].ravel()[:n], first["b"], "step 0, tensors 'w' and 'b'")


def check_noise_fresh_on_retry() -> None:
    """A step index run twice (a retry after an abort that released nothing) draws fresh noise:
    the strategy contract of ``Strategy.add_noise``."""
    strategy = make_strategy("uls", production_noise=True)
    pop = user_ids()
    first, _ = released_update(strategy, 5, pop)
    again, _ = released_update(strategy, 5, pop)
    assert_uncorrelated(first["w"], again["w"], "step 5 and its retry")


def check_noise_fresh_after_resume() -> None:
    """A run restored from a checkpoint (a NEW strategy object built from the same config, then
    ``load_state_dict``) never replays noise: its draws are independent of every draw made before
    the checkpoint, including the same step index replayed (charged, never released)."""
    pop = user_ids()
    before = make_strategy("uls", production_noise=True)
    draws = [released_update(before, step, pop)[0]["w"] for step in range(2)]
    state = before.state_dict()
    after = make_strategy("uls", production_noise=True)
    after.load_state_dict(state)
    for step in (1, 2):  # step 1 replayed (charged before the crash, never released), then 2
        draws.append(released_update(after, step, pop)[0]["w"])
    pairs = [(i, j) for i in range(2, len(draws)) for j in range(i)]
    for i, j in pairs:
        assert_uncorrelated(
            draws[i], draws[j], f"draw {i} (after resume) vs draw {j}", ALPHA / len(pairs)
        )


COUNT_STDDEV = 2.0  # adaptive clipping's σ_b; 2σ_b = 4 > z = 2


def adaptive_strategy(production_noise: bool = False) -> AdaptiveClipping:
    return AdaptiveClipping(
        noise_multiplier=SIGMA,
        clip_norm=CLIP,
        count_stddev=COUNT_STDDEV,
        target_quantile=0.5,
        clip_lr=0.0,  # C stays at CLIP, so every step's expected std is the same
        sampling_prob=Q,
        seed=SAMPLER_SEED,
        noise=None if production_noise else test_rng(),
        optimizer=Sgd(LR),
    )


def check_adaptive_clipping_noise() -> None:
    """Adaptive clipping (Andrew et al. 2021, Thm. 1) is accounted as ONE Gaussian of multiplier
    z on (sum, count): that holds only if the sum gets σ_Δ·C, σ_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2), and
    the centered count gets N(0, σ_b²). (a) With zero contributions the released update is
    N(0, (lr·σ_Δ·C/E)²) per coordinate (E = qN, on a step whose realized cohort is ≥ 25% off);
    (b) the noisy count of 400 steps, recovered from the released clip fraction, minus the true
    centered count, is N(0, σ_b²)."""
    sigma_delta = (SIGMA**-2 - (2 * COUNT_STDDEV) ** -2) ** -0.5  # 2.309 for z = 2, σ_b = 2
    pop = user_ids()
    expected = Q * N_USERS
    step, realized = step_with_cohort_gap(adaptive_strategy(), pop)
    strategy = adaptive_strategy()
    update, _ = released_update(strategy, step, pop)
    values = np.concatenate([v.ravel() for v in update.values()])
    assert_gaussian_noise(
        values,
        LR * sigma_delta * CLIP / expected,
        f"adaptive clipping sum, step {step}: std lr·σ_Δ·C/E with σ_Δ = {sigma_delta:.4f} for "
        f"z = {SIGMA}, σ_b = {COUNT_STDDEV} ({realized} realized units, E = {expected:g})",
    )
    strategy = adaptive_strategy()
    params = {"b": np.zeros(4)}
    count_noise = []
    for t in range(400):
        record = run_local_step(strategy, t, params, pop, zero_compute)
        _, _, fraction = strategy.history[-1]
        # zero_compute clips nobody: the true centered count is units − units/2 = units/2
        count_noise.append((fraction - 0.5) * expected - record.units / 2)
    assert_gaussian_noise(
        np.asarray(count_noise),
        COUNT_STDDEV,
        f"adaptive clipping count over 400 steps: noise on Σ(b_u − ½) must be N(0, σ_b²), "
        f"σ_b = {COUNT_STDDEV}",
    )


def _assert_on_grid(released: dict, gamma: float, where: str) -> None:
    for name, value in released.items():
        cells = np.asarray(value, dtype=np.float64) / gamma
        off = int(np.sum(cells != np.round(cells)))
        assert off == 0, (
            f"{where}, tensor {name!r}: {off} of {cells.size} released values are off the grid "
            f"{gamma:g}ℤ: the low-order bits of a floating-point release carry its input, so "
            "production noise (iid or correlated) must come from the secure generator, rounded "
            "onto the grid"
        )


def check_production_noise_is_secure_and_on_grid() -> None:
    """The default generator is the secure one: each released coordinate of a production strategy
    lies on the grid γℤ, γ = 2^(⌊log₂ σC⌋ − 8) (computed here from σ and C), whatever the low
    bits of the sum, and the noise is still exactly N(0, (σC)²) (the rounding adds at most γ/2,
    a relative 2⁻⁹ of σC, far inside the χ² interval of 10⁵ coordinates)."""
    strategy = make_strategy("uls", production_noise=True)
    gamma = 2.0 ** (math.floor(math.log2(SIGMA * CLIP)) - 8)
    rng = np.random.default_rng(4)
    summed = {name: rng.normal(size=shape) / 3.0 for name, shape in SHAPES.items()}
    released = strategy.add_noise(0, summed, UnitStats(count=20))
    _assert_on_grid(released, gamma, "ULS step 0")
    noise = np.concatenate([(released[n] - summed[n]).ravel() for n in SHAPES])
    assert_gaussian_noise(noise, SIGMA * CLIP, "secure noise on the grid, ULS step 0")
    blt = BltDpFtrl(
        noise_multiplier=SIGMA,
        clip_norm=CLIP,
        bins=BINS,
        epochs=2,
        banded_coefs=list(BANDED),
        seed=SAMPLER_SEED,
        optimizer=Sgd(LR),
    )
    for step in range(2):
        _assert_on_grid(blt.add_noise(step, summed, UnitStats(count=20)), gamma, f"BLT step {step}")
    # adaptive clipping's noisy count, on the grid of its own std σ_b (read back from the
    # released fraction b̃ = noisy/E + ½, so up to float rounding of that division)
    count_gamma = 2.0 ** (math.floor(math.log2(COUNT_STDDEV)) - 8)
    strategy = adaptive_strategy(production_noise=True)
    params, pop = {"b": np.zeros(4)}, user_ids()
    for t in range(50):
        run_local_step(strategy, t, params, pop, zero_compute)
        fraction = strategy.history[-1][2]
        cells = (fraction - 0.5) * Q * N_USERS / count_gamma
        assert abs(cells - round(cells)) <= 1e-6, (
            f"adaptive clipping step {t}: the noisy count {cells * count_gamma!r} is off the grid "
            f"{count_gamma:g}ℤ: its noise must come from the secure generator, on the grid"
        )


def check_report_names_the_noise_generator() -> None:
    """The privacy facts a report is rendered from state the generator the strategy really uses:
    with ``privacy.secure_noise = false`` the facts say not secure and carry the caveat; by
    default they say secure, and the generator is secure."""
    from userdp.strategies.noise import FAST_NOISE_CAVEAT

    from userdp.config import parse_config
    from userdp.run.registry import build_strategy

    for secure in (True, False):
        config = parse_config({"privacy": {"secure_noise": secure}})
        strategy = build_strategy(config, N_USERS, SIGMA)
        facts = strategy.facts()
        assert strategy.noise.rng.secure is secure, (
            f"privacy.secure_noise = {secure} built a generator with secure = "
            f"{strategy.noise.rng.secure}"
        )
        assert (
            facts.secure_noise is secure and (FAST_NOISE_CAVEAT in facts.caveats) is not secure
        ), (
            f"the report's facts say secure_noise = {facts.secure_noise} (fast-noise caveat "
            f"{'present' if FAST_NOISE_CAVEAT in facts.caveats else 'absent'}) for a strategy "
            f"whose generator has secure = {secure}: the report must name the noise it got"
        )


__all__ = [
    "ALPHA",
    "check_adaptive_clipping_noise",
    "check_noise_fresh_across_steps",
    "check_noise_fresh_after_resume",
    "check_noise_fresh_on_retry",
    "check_noise_magnitude",
    "check_production_noise_is_secure_and_on_grid",
    "check_report_names_the_noise_generator",
]
