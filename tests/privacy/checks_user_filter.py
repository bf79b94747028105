"""Checks on user-wise DP-SGD with filter (Asi & Liu; Algorithm 3 of "Mind the Privacy Unit!
User-Level Differential Privacy for Language Model Fine-Tuning"), run through the real strategy.

* the noise on the released mean is exactly N(0, 8τ² log(e^ε T/δ) σ²/N²) per coordinate (χ² test);
* AboveThreshold halts with the probability its Laplace scales 2Δ/ε' and 4Δ/ε' give, with
  ε' = ε/2 and Δ = 2 the sensitivity of the concentration query (binomial test);
* the ledger's ε is AboveThreshold's ε/2 plus dp_accounting's ε of the Gaussian steps at δ/2.

Every expected value is computed from this module's constants, never read from the code."""

from __future__ import annotations

import copy
import math

import dp_accounting
import numpy as np
from dp_accounting.pld import PLDAccountant
from scipy import integrate
from scipy import stats as scipy_stats
from userdp.strategies.local_step import run_local_step
from userdp.strategies.noise import GaussianNoise, NoiseRng
from userdp.strategies.optimizers import Sgd
from userdp.strategies.unit_stats import UnitStats
from userdp.strategies.user_filter import UserWiseFilter

from .stats import assert_gaussian_noise, binomial_interval

SIGMA, TAU, CLIP = 1.5, 0.3, 1.0
EPSILON, DELTA, STEPS = 8.0, 1e-5, 10
N_USERS = 100  # the zero updates are all within τ: the score N is N/5 = 20 above 4N/5
SHAPES = {"w": (100, 200), "b": (300,)}  # 20 300 coordinates: χ² interval about ±3.8%
SCORE_SENSITIVITY = 2.0  # the query s − 4N/5 moves by < 9/5 when a user joins or leaves
HALT_TRIALS = 20_000
HALT_QUERY = 3.0  # P(halt) ≈ 0.140 with Laplace scales 1 and 2; halved scales give ≈ 0.033


def make_strategy(seed: int = 20240607) -> UserWiseFilter:
    return UserWiseFilter(
        noise_multiplier=SIGMA,
        clip_norm=CLIP,
        concentration_threshold=TAU,
        epsilon=EPSILON,
        delta=DELTA,
        steps=STEPS,
        noise=GaussianNoise(NoiseRng.for_testing(seed)),
        optimizer=Sgd(1.0),
    )


def zero_compute(task, unit_ids, params):
    sums = {name: np.zeros_like(np.asarray(value)) for name, value in params.items()}
    return sums, UnitStats(count=len(unit_ids))


def check_user_filter_noise_magnitude() -> None:
    """The released filtered mean (release ÷ N) is pure noise with Algorithm 3's std."""
    users = [f"u{i:03d}" for i in range(N_USERS)]
    params = {name: np.zeros(shape) for name, shape in SHAPES.items()}
    seen = []
    run_local_step(make_strategy(), 0, params, users, zero_compute, on_release=seen.append)
    assert seen and seen[0].noisy_sum, "the concentrated step released nothing (halted)"
    values = np.concatenate([np.ravel(v) / N_USERS for v in seen[0].noisy_sum.values()])
    log_term = EPSILON + math.log(STEPS / DELTA)  # log(e^ε T/δ)
    std = math.sqrt(8 * TAU**2 * log_term) * SIGMA / N_USERS
    assert_gaussian_noise(values, std, "user-wise filter: noise on the filtered mean")


def _halt_probability(value: float, threshold_scale: float, query_scale: float) -> float:
    """P(value + ν < ρ) for ν ~ Lap(query_scale), ρ ~ Lap(threshold_scale)."""

    def integrand(r: float) -> float:
        return scipy_stats.laplace.pdf(r, scale=threshold_scale) * scipy_stats.laplace.cdf(
            r - value, scale=query_scale
        )

    edges = [-np.inf, min(0.0, value), max(0.0, value), np.inf]
    return sum(
        integrate.quad(integrand, a, b, epsabs=1e-13)[0]
        for a, b in zip(edges, edges[1:], strict=False)
        if a < b
    )


def check_above_threshold_halting_probability() -> None:
    """The strategy's AboveThreshold answers "below" to a query HALT_QUERY above its threshold
    with probability P(q + Lap(4Δ/ε') < Lap(2Δ/ε')), ε' = ε/2, Δ = 2 (fresh copies of the
    instance the strategy builds, each drawing its own threshold noise)."""
    eps_prime = EPSILON / 2
    p = _halt_probability(
        HALT_QUERY, 2 * SCORE_SENSITIVITY / eps_prime, 4 * SCORE_SENSITIVITY / eps_prime
    )
    rng = NoiseRng.for_testing(7)
    built = make_strategy().above_threshold  # not queried yet: no threshold noise drawn
    halts = 0
    for _ in range(HALT_TRIALS):
        halts += not copy.deepcopy(built).above(HALT_QUERY, rng)
    lo, hi = binomial_interval(HALT_TRIALS, p)
    assert lo <= halts <= hi, (
        f"AboveThreshold halted {halts} of {HALT_TRIALS} times on a query {HALT_QUERY} above its "
        f"threshold; Laplace scales 2Δ/ε' = {2 * SCORE_SENSITIVITY / eps_prime:g} and 4Δ/ε' = "
        f"{4 * SCORE_SENSITIVITY / eps_prime:g} (Δ = 2, ε' = ε/2) give P = {p:.4f}, acceptance "
        f"[{lo}, {hi}]: its noise is too small or too large for its ε"
    )


def check_user_filter_ledger_epsilon() -> None:
    """ε after t steps = ε/2 (AboveThreshold) + dp_accounting's ε of t Gaussian(σ) steps at δ/2."""
    from userdp.accounting import api

    mechanism = make_strategy().mechanism()
    for steps in (1, STEPS):
        accountant = PLDAccountant()
        accountant.compose(dp_accounting.GaussianDpEvent(SIGMA), steps)
        expected = EPSILON / 2 + accountant.get_epsilon(DELTA / 2)
        got = api.epsilon(mechanism, steps, DELTA)
        assert abs(got - expected) <= 1e-6 * expected, (
            f"user-wise filter after {steps} steps: the accountant says ε = {got:.6g}, but "
            f"AboveThreshold's ε/2 = {EPSILON / 2:g} plus dp_accounting's Gaussian ε at δ/2 is "
            f"{expected:.6g}"
        )
