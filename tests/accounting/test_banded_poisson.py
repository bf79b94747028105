"""The banded-Poisson accountant (accounting/banded_poisson.py): the reduction to DP-SGD rounds,
its limits against dp_accounting and the balls-in-bins accountant, refusals, and the CLI. The
check against the mechanism's own Monte Carlo δ, with its mutation, is in tests/privacy."""

from __future__ import annotations

import json
import math

import dp_accounting
import pytest
from userdp.accounting import balls_in_bins, epsilon
from userdp.accounting.mechanisms import (
    BandedPoissonMechanism,
    CorrelationSpec,
    InvalidMechanismError,
    mechanism_from_dict,
)

from tests.accounting.account_cli import account

Z_TOL = 5.33  # two-sided normal quantile of the suite's 1e-7 false-alarm rate
BANDED = CorrelationSpec.of("banded", coefs=[1.0, 0.5, 0.25])


def _dp_sgd_epsilon(sigma: float, q: float, rounds: int, delta: float) -> float:
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, rounds))
    return accountant.get_epsilon(delta)


def test_a_run_is_dp_sgd_with_one_round_per_cycle_at_sigma_over_the_column_norm() -> None:
    mechanism = BandedPoissonMechanism(2.0, 0.2, 3, correlation=BANDED)
    norm = math.sqrt(1.0 + 0.25 + 0.0625)
    expected = _dp_sgd_epsilon(2.0 / norm, 0.2, 34, 1e-6)  # ⌈100/3⌉ rounds
    assert epsilon(mechanism, 100, 1e-6) == pytest.approx(expected, rel=1e-9)
    # a partial cycle is charged as a whole one: 97, 98 and 99 steps are all 33 cycles
    assert epsilon(mechanism, 97, 1e-6) == epsilon(mechanism, 99, 1e-6)
    assert epsilon(mechanism, 100, 1e-6) > epsilon(mechanism, 99, 1e-6)


def test_one_band_full_participation_is_the_gaussian_composition_of_balls_in_bins() -> None:
    # b̂ = 1, p = 1, C = I: every unit in every step, n Gaussian mechanisms; balls-in-bins with
    # one bin (per-epoch) is the same mechanism, estimated by Monte Carlo.
    sigma, steps, delta = 3.0, 8, 1e-3
    eps = epsilon(BandedPoissonMechanism(sigma, 1.0, 1), steps, delta)
    est = balls_in_bins.delta_estimate(
        sigma, 1, steps, eps, bin_semantics="per-epoch", num_samples=2**18, seed=5
    )
    assert abs(est.delta - delta) <= Z_TOL * est.stderr, (eps, est)
    assert balls_in_bins.gaussian_delta(eps, math.sqrt(steps), sigma) <= delta


@pytest.mark.parametrize(
    "correlation",
    [
        CorrelationSpec.of("banded", coefs=[1.0, 0.5, 0.25, 0.1]),
        CorrelationSpec.of("toeplitz", coefs=[1.0, 0.5, 0.25, 0.1, 0.05]),
        CorrelationSpec.of("blt", buf_decay=[0.9], output_scale=[0.3]),
    ],
)
def test_a_correlation_with_more_diagonals_than_bands_is_refused(correlation) -> None:
    mechanism = BandedPoissonMechanism(2.0, 0.2, 3, correlation=correlation)
    with pytest.raises(InvalidMechanismError, match="is not 3-banded"):
        epsilon(mechanism, 30, 1e-6)


def test_the_mechanism_round_trips_through_its_ledger_form() -> None:
    mechanism = BandedPoissonMechanism(2.0, 0.2, 3, correlation=BANDED)
    again = mechanism_from_dict(json.loads(json.dumps(mechanism.to_dict())))
    assert again == mechanism
    with pytest.raises(InvalidMechanismError, match="bands=0 is out of range"):
        BandedPoissonMechanism(2.0, 0.2, 0)


def test_the_cli_accounts_and_calibrates_it_and_refuses_a_wide_correlation() -> None:
    common = ["--mechanism", "banded-poisson", "--sampling-prob", "0.2", "--bands", "3"]
    common += ["--correlation", "banded:coefs=1,0.5,0.25", "--steps", "100", "--delta", "1e-6"]
    out = account("epsilon", *common, "--noise-multiplier", "2", "--json")
    assert out.returncode == 0, out.stderr
    eps = json.loads(out.stdout)["epsilon"]
    assert eps == pytest.approx(epsilon(BandedPoissonMechanism(2.0, 0.2, 3, BANDED), 100, 1e-6))
    out = account("calibrate", *common, "--epsilon", f"{eps}", "--json", "--no-cache")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["noise_multiplier"] == pytest.approx(2.0, rel=1e-3)
    wide = [*common[:-6], "--correlation", "banded:coefs=1,0.5,0.25,0.1", *common[-4:]]
    out = account("epsilon", *wide, "--noise-multiplier", "2")
    assert out.returncode == 2
    assert len(out.stderr.strip().splitlines()) == 1
    assert "not 3-banded" in out.stderr
