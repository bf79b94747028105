"""Calibration (σ for a target ε) and max steps: private side, reference numbers, the cache."""

from __future__ import annotations

import dataclasses
import json
import math

import dp_accounting
import pytest
from dp_accounting.pld import PLDAccountant
from userdp.accounting import (
    BallsInBinsMechanism,
    CalibrationError,
    ElsMechanism,
    InvalidMechanismError,
    UlsMechanism,
    api,
    calibrate_noise_multiplier,
    calibration,
    epsilon,
    max_steps,
)

# Cheap settings for tests about the search and the cache rather than about the numbers.
FAST = {"rtol": 1e-2, "value_discretization_interval": 1e-3, "search_discretization_interval": None}

# Balls-in-bins calibration (Choquette-Choo et al., "Near Exact Privacy Amplification for Matrix
# Mechanisms"): σ solves δ̂(σ) = balls_in_bins.calibration_target(δ, num_samples) at ε = target on
# the estimate stream (a KL-Chernoff margin below safety·δ, safety = 0.8), then
# Estimate-Verify-Release checks (ε, δ) on fresh samples, at the default count, which passes a
# calibrated σ with probability ≥ 0.99.
BIB_DELTA = 1e-2
BIB_SAFETY = 0.8


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("USERDP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_uls_calibration_matches_reference_and_is_private() -> None:
    # The mean-estimation setting of "Fine-Tuning Large Language Models with User-Level
    # Differential Privacy" (§4: N=256, T=256, δ=1e-6, ε=1, B=64): ULS G=16, q=1/64 →
    # σ = 1.37700 (dp_accounting PLD, tol 1e-4).
    template = UlsMechanism(1.0, 0.015625)
    sigma = calibrate_noise_multiplier(template, 1.0, 1e-6, 256)
    assert sigma == pytest.approx(1.37700, abs=2e-4)
    assert epsilon(UlsMechanism(sigma, 0.015625), 256, 1e-6) <= 1.0
    # ... and not wastefully noisy: a σ rtol below is over budget.
    assert epsilon(UlsMechanism(sigma * (1 - 2e-4), 0.015625), 256, 1e-6) > 1.0


def test_els_calibration_matches_reference_and_is_private() -> None:
    # Same setting (§4 of the paper): ELS G=16, p=1/64, T=256, δ=1e-6, ε=1 → σ = 17.0461
    # (dp_accounting PLD, vdi 1e-3, tol 1e-3).
    template = ElsMechanism(1.0, 1 / 64, 16)
    sigma = calibrate_noise_multiplier(
        template, 1.0, 1e-6, 256, rtol=1e-4, value_discretization_interval=1e-3
    )
    assert sigma == pytest.approx(17.0461, rel=1e-3)
    eps = epsilon(ElsMechanism(sigma, 1 / 64, 16), 256, 1e-6, value_discretization_interval=1e-3)
    assert eps <= 1.0


def test_calibrated_sigma_is_monotone_in_the_target() -> None:
    template = UlsMechanism(1.0, 0.05)
    sigmas = [calibrate_noise_multiplier(template, e, 1e-6, 100, **FAST) for e in (1, 2, 4)]
    assert sigmas[0] > sigmas[1] > sigmas[2]


def test_calibration_ignores_the_template_sigma() -> None:
    a = calibrate_noise_multiplier(UlsMechanism(0.3, 0.05), 2.0, 1e-6, 100, use_cache=False, **FAST)
    b = calibrate_noise_multiplier(
        UlsMechanism(30.0, 0.05), 2.0, 1e-6, 100, use_cache=False, **FAST
    )
    assert a == b


def test_cache_is_used_for_the_same_query(monkeypatch, _private_cache) -> None:
    template = UlsMechanism(1.0, 0.05)
    first = calibrate_noise_multiplier(template, 2.0, 1e-6, 100, **FAST)
    assert len(list((_private_cache / "accounting").glob("*.json"))) == 1

    def boom(*args, **kwargs):
        raise AssertionError("the accountant ran although the answer was cached")

    monkeypatch.setattr(api, "epsilon", boom)
    assert calibrate_noise_multiplier(template, 2.0, 1e-6, 100, **FAST) == first


@pytest.mark.parametrize(
    "change",
    [
        {"delta": 1e-9},
        {"steps": 200},
        {"target": 4.0},
        {"template": UlsMechanism(1.0, 0.2)},
        {"template": ElsMechanism(1.0, 0.05, 2)},
    ],
    ids=["delta", "steps", "target", "sampling_prob", "kind"],
)
def test_cache_never_answers_a_different_query(change) -> None:
    base = {"template": UlsMechanism(1.0, 0.05), "target": 2.0, "delta": 1e-6, "steps": 100}
    first = calibrate_noise_multiplier(
        base["template"], base["target"], base["delta"], base["steps"], **FAST
    )
    query = {**base, **change}
    args = (query["template"], query["target"], query["delta"], query["steps"])
    through_cache = calibrate_noise_multiplier(*args, **FAST)
    fresh = calibrate_noise_multiplier(*args, use_cache=False, **FAST)
    assert through_cache == fresh
    assert fresh != first  # the change matters, so a wrong cache hit would be caught


def test_a_cache_file_for_another_query_is_ignored(_private_cache) -> None:
    template = UlsMechanism(1.0, 0.05)
    honest = calibrate_noise_multiplier(template, 2.0, 1e-6, 100, **FAST)
    (path,) = (_private_cache / "accounting").glob("*.json")
    stored = json.loads(path.read_text())
    # Same file name, but the query inside says something else: must not be trusted.
    stored["query"]["delta"] = 1e-3
    stored["result"] = 123.0
    path.write_text(json.dumps(stored))
    assert calibrate_noise_multiplier(template, 2.0, 1e-6, 100, **FAST) == honest
    path.write_text("{ truncated")
    assert calibrate_noise_multiplier(template, 2.0, 1e-6, 100, **FAST) == honest


def test_cache_key_includes_the_accountant_version(monkeypatch, _private_cache) -> None:
    template = UlsMechanism(1.0, 0.05)
    calibrate_noise_multiplier(template, 2.0, 1e-6, 100, **FAST)
    monkeypatch.setattr(api, "ACCOUNTANT_VERSION", "test-bump")
    calibrate_noise_multiplier(template, 2.0, 1e-6, 100, **FAST)
    assert len(list((_private_cache / "accounting").glob("*.json"))) == 2


def test_cache_key_includes_the_package_version_and_the_accountant_code(
    monkeypatch, _private_cache
) -> None:
    """A σ computed by another userdp version, or by edited accountant code, is never served."""
    import userdp

    template = UlsMechanism(1.0, 0.05)
    calibrate_noise_multiplier(template, 2.0, 1e-6, 100, **FAST)
    monkeypatch.setattr(userdp, "__version__", "0.0.0-other")
    calibrate_noise_multiplier(template, 2.0, 1e-6, 100, **FAST)
    assert len(list((_private_cache / "accounting").glob("*.json"))) == 2
    monkeypatch.setattr(calibration, "accountant_code_sha256", lambda: "0" * 64)
    calibrate_noise_multiplier(template, 2.0, 1e-6, 100, **FAST)
    assert len(list((_private_cache / "accounting").glob("*.json"))) == 3


def test_calibration_errors_are_value_errors_naming_the_parameter() -> None:
    with pytest.raises(InvalidMechanismError, match="target_epsilon=0"):
        calibrate_noise_multiplier(UlsMechanism(1.0, 0.1), 0, 1e-6, 10)
    with pytest.raises(InvalidMechanismError, match="delta=1.5"):
        calibrate_noise_multiplier(UlsMechanism(1.0, 0.1), 1.0, 1.5, 10)
    with pytest.raises(CalibrationError, match="steps=0"):
        calibrate_noise_multiplier(UlsMechanism(1.0, 0.1), 1.0, 1e-6, 0)
    assert issubclass(CalibrationError, ValueError)


def test_max_steps_is_the_last_step_within_budget() -> None:
    mech = UlsMechanism(1.0, 0.02)
    kwargs = {"value_discretization_interval": 1e-3}
    steps = max_steps(mech, 1.0, 1e-6, **kwargs)
    assert steps > 0
    assert epsilon(mech, steps, 1e-6, **kwargs) <= 1.0
    assert epsilon(mech, steps + 1, 1e-6, **kwargs) > 1.0


def test_max_steps_zero_and_limit() -> None:
    assert max_steps(UlsMechanism(0.3, 1.0), 0.5, 1e-6, value_discretization_interval=1e-3) == 0
    assert max_steps(UlsMechanism(50.0, 0.001), 10.0, 1e-6, limit=64) == 64


def test_largest_true_search() -> None:
    for cut in (0, 1, 2, 7, 64, 1000):
        assert calibration._largest_true(lambda n, c=cut: n <= c, 5000) == cut
    assert calibration._largest_true(lambda n: True, 77) == 77


def test_max_steps_for_balls_in_bins_counts_whole_epochs() -> None:
    # C = I, fixed bins: E epochs at σ are one epoch at σ/√E, so the certified ε grows with the
    # epochs, and a target between ε(2 epochs) and ε(3 epochs) allows 2 whole epochs.
    mech = BallsInBinsMechanism(1.0, 10, 8, "fixed")
    one, two, three = (epsilon(mech, 10 * e, 1e-3) for e in (1, 2, 3))
    assert one < two < three
    target = (two + three) / 2
    steps = max_steps(mech, target, 1e-3, use_cache=False)
    assert steps == 20
    assert epsilon(mech, steps, 1e-3) <= target < epsilon(mech, 21, 1e-3)
    assert max_steps(mech, one / 2, 1e-3, use_cache=False) == 0
    # Capped at bins × epochs, and at the whole epochs below ``limit``.
    assert max_steps(mech, 1e3, 1e-3, use_cache=False) == 80
    assert max_steps(mech, 1e3, 1e-3, limit=35, use_cache=False) == 30


def test_template_may_be_a_dict_without_sigma() -> None:
    as_dict = calibrate_noise_multiplier(
        {"kind": "uls", "sampling_prob": 0.05}, 2.0, 1e-6, 100, **FAST
    )
    as_value = calibrate_noise_multiplier(UlsMechanism(1.0, 0.05), 2.0, 1e-6, 100, **FAST)
    assert as_dict == as_value


@pytest.mark.parametrize(
    ("group", "p", "target", "expected"),
    [(32, 1 / 64, 1.0, 66.965), (32, 1 / 64, 4.0, 18.955), (16, 1 / 256, 4.0, 2.5282),
     (8, 1 / 128, 4.0, 2.5264)],
)  # fmt: skip
def test_els_calibration_reference_table(group, p, target, expected) -> None:
    # The Conjecture 1 / Fig. 2(a) settings of "Fine-Tuning Large Language Models with User-Level
    # Differential Privacy" (§3): T=1000, δ=1e-6, vdi 1e-3, the reference calibrated with
    # dp_accounting at tol 1e-3.
    sigma = calibrate_noise_multiplier(
        ElsMechanism(1.0, p, group), target, 1e-6, 1000, value_discretization_interval=1e-3
    )
    assert sigma == pytest.approx(expected, rel=5e-4)


@pytest.mark.parametrize(("target", "uls_expected"), [(1.0, 2.2608), (4.0, 0.9282)])
def test_conjecture_1_spot_check(target, uls_expected) -> None:
    # Conjecture 1 of "Fine-Tuning Large Language Models with User-Level Differential Privacy"
    # (§3): σ_ELS(K=32, p=1/64) ≤ K·σ_ULS(q=1/64), T=1000, δ=1e-6.
    uls = calibrate_noise_multiplier(UlsMechanism(1.0, 1 / 64), target, 1e-6, 1000)
    els = calibrate_noise_multiplier(
        ElsMechanism(1.0, 1 / 64, 32), target, 1e-6, 1000, value_discretization_interval=1e-3
    )
    assert uls == pytest.approx(uls_expected, abs=2e-4)
    assert els <= 32 * uls


def test_balls_in_bins_calibration_is_the_smallest_sigma_whose_certified_epsilon_fits() -> None:
    # σ is calibrated on the certified bound itself, the value every place states: at σ it is
    # within the target, a relative 2·rtol lower it is not.
    template = BallsInBinsMechanism(1.0, 8, 4, "fixed")
    rtol = 1e-3

    def calibrate(target: float, steps: int) -> float:
        return calibrate_noise_multiplier(
            template, target, BIB_DELTA, steps, rtol=rtol, use_cache=False
        )

    def eps(sigma: float) -> float:
        return epsilon(dataclasses.replace(template, noise_multiplier=sigma), 24, BIB_DELTA)

    sigma = calibrate(1.0, 24)
    assert eps(sigma) <= 1.0 < eps(sigma * (1 - 2 * rtol))
    # 17 to 24 steps are 3 whole epochs of 8 bins; with C = I and fixed bins, 3 epochs at σ are
    # 1 epoch at σ/√3, so the 3-epoch σ is √3 times the 1-epoch σ.
    assert calibrate(1.0, 17) == sigma
    assert sigma / calibrate(1.0, 8) == pytest.approx(math.sqrt(3), rel=2 * rtol)
    assert calibrate(2.0, 24) < sigma
    with pytest.raises(ValueError, match="do not apply"):
        calibrate_noise_multiplier(template, 1.0, BIB_DELTA, 24, num_samples=2**12)


def test_correlated_balls_in_bins_calibration_fits_its_certified_epsilon() -> None:
    # Banded C: the search starts at the Monte Carlo estimate's σ and ends on the certified bound
    # (Estimate-Verify-Release on query-seeded samples, or the bound without amplification).
    template = BallsInBinsMechanism(
        1.0, 4, 2, "fixed", {"name": "banded", "params": {"coefs": [1, 0.5]}}
    )
    sigma = calibrate_noise_multiplier(template, 2.0, 1e-2, 8, rtol=1e-2, use_cache=False)
    stated = epsilon(dataclasses.replace(template, noise_multiplier=sigma), 8, 1e-2)
    assert (
        stated
        <= 2.0
        < epsilon(dataclasses.replace(template, noise_multiplier=0.97 * sigma), 8, 1e-2)
    )


@pytest.mark.parametrize("semantics", ["fixed", "per-epoch"])
def test_one_bin_calibration_agrees_with_the_gaussian_accountant(semantics) -> None:
    # One bin puts every user in every step: the Gaussian mechanism composed T times, which
    # dp_accounting accounts for independently. At the calibrated σ its ε is within the target
    # (the bound is an upper bound) and close to it (the bound is tight for one bin).
    steps, target = 4, 1.0
    sigma = calibrate_noise_multiplier(
        BallsInBinsMechanism(1.0, 1, steps, semantics), target, BIB_DELTA, steps, use_cache=False
    )
    accountant = PLDAccountant()
    accountant.compose(
        dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma), steps)
    )
    assert 0.95 * target <= accountant.get_epsilon(BIB_DELTA) <= target
