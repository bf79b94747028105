"""The accountant of user-wise DP-SGD with filter (Asi & Liu; Algorithm 3 of "Mind the Privacy
Unit! User-Level Differential Privacy for Language Model Fine-Tuning"): σ is PrivAccounting at
(ε/2, δ/2) with q = 1, ε is AboveThreshold's ε/2 plus the Gaussian steps' ε at δ − δ/2, the
noise std is Algorithm 3's, and the concentration query's sensitivity is at most 2. The reference
values come from dp_accounting's own accountant and calibration, computed here."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import PLDAccountant
from userdp.accounting import api, user_filter
from userdp.accounting.api import NotComposableError
from userdp.accounting.calibration import calibrate_noise_multiplier
from userdp.accounting.ledger import Ledger
from userdp.accounting.mechanisms import (
    InvalidMechanismError,
    UlsMechanism,
    UserWiseFilterMechanism,
    mechanism_from_dict,
)

EPSILON, DELTA, STEPS = 2.0, 1e-5, 50


def _gaussian_epsilon(sigma: float, steps: int, delta: float) -> float:
    """dp_accounting: ε(δ) of ``steps`` Gaussian mechanisms with noise multiplier σ (q = 1)."""
    accountant = PLDAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(sigma), steps)
    return accountant.get_epsilon(delta)


def _template(sigma: float = 1.0) -> UserWiseFilterMechanism:
    split = user_filter.split_budget(EPSILON, DELTA)
    return UserWiseFilterMechanism(sigma, split.above_threshold_epsilon, split.filter_delta, STEPS)


def test_split_is_half_and_half():
    split = user_filter.split_budget(EPSILON, DELTA)
    assert (split.above_threshold_epsilon, split.gaussian_epsilon) == (EPSILON / 2, EPSILON / 2)
    assert (split.gaussian_delta, split.filter_delta) == (DELTA / 2, DELTA / 2)


def test_sigma_is_privaccounting_at_half_the_budget_with_q_1():
    sigma = calibrate_noise_multiplier(_template(), EPSILON, DELTA, STEPS, use_cache=False)
    # dp_accounting's own calibration of T Gaussian steps (q = 1) to (ε/2, δ/2)
    reference = dp_accounting.calibrate_dp_mechanism(
        PLDAccountant,
        lambda s: dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(s), STEPS),
        EPSILON / 2,
        DELTA / 2,
        dp_accounting.LowerEndpointAndGuess(1.0, 20.0),
        tol=1e-6,
    )
    assert sigma == pytest.approx(reference, rel=2e-4)
    # on the private side, and tight: a 2·rtol smaller σ is over ε/2
    assert _gaussian_epsilon(sigma, STEPS, DELTA / 2) <= EPSILON / 2
    assert _gaussian_epsilon(sigma * (1 - 2e-4), STEPS, DELTA / 2) > EPSILON / 2


@pytest.mark.parametrize("steps", [1, 7, STEPS])
def test_epsilon_is_above_threshold_plus_the_gaussian_steps(steps):
    mechanism = _template(sigma=3.0)
    expected = EPSILON / 2 + _gaussian_epsilon(3.0, steps, DELTA - DELTA / 2)
    assert api.epsilon(mechanism, steps, DELTA) == pytest.approx(expected, rel=1e-6)
    # at a larger δ only the Gaussian part moves; δ at or below δ/2 buys nothing
    assert api.epsilon(mechanism, steps, 1e-3) == pytest.approx(
        EPSILON / 2 + _gaussian_epsilon(3.0, steps, 1e-3 - DELTA / 2), rel=1e-6
    )
    assert api.epsilon(mechanism, steps, DELTA / 2) == math.inf


def test_past_the_horizon_or_mixed_with_other_phases_is_refused():
    mechanism = _template(sigma=3.0)
    with pytest.raises(InvalidMechanismError, match="horizon=50"):
        api.epsilon(mechanism, STEPS + 1, DELTA)
    with pytest.raises(NotComposableError):
        api.compose_epsilon([(mechanism, 3), (UlsMechanism(1.0, 0.1), 3)], DELTA)
    with pytest.raises(InvalidMechanismError, match="filter_delta"):
        UserWiseFilterMechanism(1.0, 1.0, 1.0, 10)


def test_the_ledger_reaccounts_the_records(tmp_path):
    mechanism = _template(sigma=3.0)
    assert mechanism_from_dict(mechanism.to_dict()) == mechanism
    ledger = Ledger.open(tmp_path / "l.jsonl", create=True, budget_epsilon=10.0, delta=DELTA)
    for step in range(4):
        ledger.append(step, mechanism)
    ledger.close()
    again = Ledger.open(tmp_path / "l.jsonl")
    assert again.spent(DELTA) == pytest.approx(
        EPSILON / 2 + _gaussian_epsilon(3.0, 4, DELTA / 2), rel=1e-6
    )
    again.close()


def test_noise_std_is_algorithm_3s():
    tau, n, sigma = 0.25, 400, 1.7
    expected = math.sqrt(8 * tau**2 * math.log(math.exp(EPSILON) * STEPS / DELTA)) * sigma / n
    got = user_filter.filter_noise_std(sigma, tau, n, EPSILON, DELTA, STEPS)
    assert got == pytest.approx(expected, rel=1e-12)
    # no overflow where e^ε does: log(e^ε T/δ) is ε + log(T/δ)
    big = user_filter.filter_noise_std(sigma, tau, n, 800.0, DELTA, STEPS)
    assert big == pytest.approx(
        math.sqrt(8 * tau**2 * (800.0 + math.log(STEPS / DELTA))) * sigma / n, rel=1e-12
    )


# ---- the sensitivity of AboveThreshold's query --------------------------------------------------


def _query(points: np.ndarray, tau: float) -> float:
    """q(D) = s − 4N/5, s = (1/N) Σ_{i,i'} 1(‖gᵢ − gᵢ'‖ ≤ τ), by brute force."""
    n = len(points)
    close = sum(np.linalg.norm(a - b) <= tau for a in points for b in points)
    return close / n - 4 * n / 5


def test_the_concentration_query_moves_by_less_than_2_when_a_user_joins():
    assert user_filter.CONCENTRATION_SCORE_SENSITIVITY == 2.0
    rng = np.random.default_rng(0)
    tau = 1.0
    worst_up, worst_down = -math.inf, math.inf
    for _ in range(300):
        n = int(rng.integers(1, 14))
        clusters = rng.normal(scale=2.0, size=(3, 4))
        points = clusters[rng.integers(0, 3, n)] + rng.normal(scale=0.4, size=(n, 4))
        newcomer = clusters[rng.integers(0, 3)] + rng.normal(scale=0.4, size=4)
        change = _query(np.vstack([points, newcomer]), tau) - _query(points, tau)
        worst_up, worst_down = max(worst_up, change), min(worst_down, change)
    assert -9 / 5 < worst_down and worst_up < 6 / 5
    # the extremes of the derivation. Up: N users pairwise farther than τ (a simplex of side
    # 0.9·√2) and a newcomer within τ of all of them at its centre: S = N → S + 2N + 1.
    n = 8
    simplex = 0.9 * np.eye(n)
    centre = simplex.mean(axis=0)
    assert all(np.linalg.norm(p - centre) <= tau for p in simplex)
    up = _query(np.vstack([simplex, centre]), tau) - _query(simplex, tau)
    assert up == pytest.approx(2 * n / (n + 1) - 4 / 5)
    # Down: N identical users (S = N²) and a newcomer far from all (a = 1).
    same = np.zeros((n, 3))
    down = _query(np.vstack([same, [[10.0, 0, 0]]]), tau) - _query(same, tau)
    assert down == pytest.approx(-(n - 1) / (n + 1) - 4 / 5)
    assert max(abs(up), abs(down)) < user_filter.CONCENTRATION_SCORE_SENSITIVITY
