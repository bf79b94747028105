"""Certified balls-in-bins ε and epochs (Estimate-Verify-Release), against an exact accountant
where one exists and against the uncertified estimate."""

from __future__ import annotations

import json

import dp_accounting
import pytest
from userdp.accounting import balls_in_bins as bib
from userdp.accounting.balls_in_bins_certified import certified_epsilon, query_seed
from userdp.accounting.mechanisms import BallsInBinsMechanism

from tests.accounting.account_cli import account

SIGMA = 1.5
DELTA = 1e-3


def _gaussian_epsilon(sigma: float, steps: int, delta: float) -> float:
    """ε of ``steps`` compositions of the Gaussian mechanism (sensitivity 1), dp_accounting's
    exact PLD: balls-in-bins with ONE bin puts every user in every step."""
    accountant = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(dp_accounting.GaussianDpEvent(sigma), steps)
    return accountant.get_epsilon(delta)


@pytest.mark.parametrize("semantics", ["fixed", "per-epoch"])
def test_one_bin_certified_epsilon_is_above_the_exact_gaussian_epsilon(semantics):
    """Never optimistic: the certified ε is at least dp_accounting's exact ε, and within the
    margin the certificate needs (the estimate at the calibration target, δ̂ ≈ 0.6·δ here)."""
    exact = _gaussian_epsilon(SIGMA, 4, DELTA)
    certified = bib.certified_epsilon(SIGMA, 1, 4, DELTA, bin_semantics=semantics, seed=3)
    at_design = _gaussian_epsilon(SIGMA, 4, 0.5 * DELTA)  # ε at a δ below the target level
    assert exact <= certified <= at_design, (exact, certified, at_design)


def test_certified_epsilon_is_above_the_estimate_and_passes_a_fresh_check():
    estimate = bib.epsilon(SIGMA, 4, 5, DELTA, seed=1)
    certified = bib.certified_epsilon(SIGMA, 4, 5, DELTA, seed=1)
    assert certified > estimate
    # an independent check on other fresh samples (another seed's verify stream)
    assert bib.verify(SIGMA, 4, 5, certified, DELTA, seed=99).passed
    # 10% below the estimate the true δ is well above δ: the certificate refuses it
    assert not bib.verify(SIGMA, 4, 5, 0.9 * estimate, DELTA, seed=99).passed


def test_a_failed_check_raises_instead_of_returning_an_estimate():
    with pytest.raises(bib.VerificationFailedError, match="does not certify delta"):
        bib.certified_epsilon(SIGMA, 4, 5, DELTA, seed=1, verify_samples=100)


def test_certified_max_epochs_is_the_largest_within_the_target():
    target = 3.0
    epochs = bib.certified_max_epochs(SIGMA, 4, target, DELTA, max_epochs=8, seed=1)
    assert 1 <= epochs < 8
    goal = bib.calibration_target(DELTA, bib.calibration_samples(DELTA))
    assert bib.epsilon(SIGMA, 4, epochs, goal, seed=1) <= target
    assert bib.epsilon(SIGMA, 4, epochs + 1, goal, seed=1) > target
    assert bib.verify(SIGMA, 4, epochs, target, DELTA, seed=99).passed
    assert bib.certified_max_epochs(SIGMA, 4, 0.01, DELTA, max_epochs=8, seed=1) == 0
    assert bib.certified_max_epochs(SIGMA, 4, 1e3, DELTA, max_epochs=8, seed=1) == 8


def test_the_cli_states_the_certified_bound_and_refuses_estimate_elsewhere():
    common = ["--mechanism", "balls-in-bins", "--noise-multiplier", "1.5", "--bins", "4"]
    common += ["--epochs", "5", "--bin-semantics", "fixed", "--delta", "1e-3"]
    common += ["--correlation", "banded:coefs=1,0.5"]
    done = account("epsilon", *common, "--steps", "20", "--json")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["method"] == "Monte Carlo EVR" and "Estimate-Verify-Release" in result["note"]
    mechanism = BallsInBinsMechanism(
        1.5, 4, 5, "fixed", {"name": "banded", "params": {"coefs": [1.0, 0.5]}}
    )
    assert result["epsilon"] == bib.certified_epsilon(
        1.5, 4, 5, 1e-3, correlation=mechanism.correlation, seed=query_seed(mechanism, 5, 1e-3)
    )
    estimate = account("epsilon", *common, "--steps", "20", "--estimate", "--seed", "1", "--json")
    plain = json.loads(estimate.stdout)
    assert plain["estimate"] is True and plain["epsilon"] < result["epsilon"]
    refused = account(
        "epsilon",
        "--mechanism",
        "uls",
        "--noise-multiplier",
        "1",
        "--steps",
        "10",
        "--sampling-prob",
        "0.1",
        "--estimate",
    )
    assert refused.returncode == 2
    assert refused.stderr.strip().endswith("accountant is not a Monte Carlo estimate")


def test_the_cli_takes_the_correlation_as_a_named_family_its_json_or_a_file(tmp_path):
    """The three spellings of the same banded C give the same ε, which is the library's ε for
    that C; a C with per-epoch bins or a malformed spec is a one-line error (exit 2)."""
    from userdp.accounting.correlation import BandedCorrelation

    common = ["--mechanism", "balls-in-bins", "--noise-multiplier", "2", "--bins", "2"]
    common += ["--epochs", "3", "--steps", "6", "--delta", "1e-3", "--json"]
    spec = {"name": "banded", "params": {"coefs": [1.0, 0.5]}}
    (tmp_path / "c.json").write_text(json.dumps(spec))
    values = set()
    for text in ("banded:coefs=1,0.5", json.dumps(spec), f"@{tmp_path / 'c.json'}"):
        done = account("epsilon", *common, "--bin-semantics", "fixed", "--correlation", text)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout)
        assert result["mechanism"]["correlation"] == spec
        values.add(result["epsilon"])
    mechanism = BallsInBinsMechanism(2.0, 2, 3, "fixed", spec)
    library = certified_epsilon(mechanism, 3, 1e-3).epsilon
    assert values == {library}
    identity = BallsInBinsMechanism(2.0, 2, 3, "fixed")
    assert library > certified_epsilon(identity, 3, 1e-3).epsilon  # correlation costs privacy here
    assert BandedCorrelation((1.0, 0.5)).spec().to_dict() == spec
    for bad, message in (
        (["--correlation", "banded:coefs=1,0.5"], "per-epoch"),  # default bin semantics
        (["--bin-semantics", "fixed", "--correlation", "blt:buf_decay=0.9"], "output_scale"),
        (["--bin-semantics", "fixed", "--correlation", "@/nonexistent.json"], "nonexistent"),
    ):
        refused = account("epsilon", *common, *bad)
        assert refused.returncode == 2 and message in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
