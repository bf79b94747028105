"""Mechanism descriptions: stable JSON form, validation messages, dp_accounting events."""

from __future__ import annotations

import dataclasses
import json
import math

import dp_accounting
import pytest
from dp_accounting import dp_event as dpe
from scipy import stats
from userdp.accounting.mechanisms import (
    BallsInBinsMechanism,
    CorrelationSpec,
    ElsMechanism,
    GroupPrivacyMechanism,
    InvalidMechanismError,
    NoDpEventError,
    RandomizedClippingMechanism,
    UlsMechanism,
    dp_event,
    mechanism_from_dict,
)

ALL = [
    UlsMechanism(1.0, 0.01),
    ElsMechanism(0.8, 0.02, 16),
    GroupPrivacyMechanism(2.0, 0.5, 4),
    BallsInBinsMechanism(1.5, 128, 16, "fixed", CorrelationSpec.of("blt", theta=[0.9, 0.5])),
    BallsInBinsMechanism(1.5, 10, 2),
    RandomizedClippingMechanism(1.0, 0.01, 8, "hutch++"),
]


@pytest.mark.parametrize("mechanism", ALL, ids=lambda m: m.kind)
def test_round_trip_through_json(mechanism) -> None:
    text = json.dumps(mechanism.to_dict(), allow_nan=False)
    back = mechanism_from_dict(json.loads(text))
    assert back == mechanism
    assert hash(back) == hash(mechanism)
    assert back.to_dict()["kind"] == mechanism.kind


def test_json_form_is_stable() -> None:
    # A ledger written today must re-account identically later: these literals must not change.
    assert UlsMechanism(1, 0.01).to_dict() == {
        "kind": "uls",
        "noise_multiplier": 1.0,
        "sampling_prob": 0.01,
    }
    assert ElsMechanism(1.0, 0.01, 16).to_dict() == {
        "kind": "els",
        "noise_multiplier": 1.0,
        "sampling_prob": 0.01,
        "group_size": 16,
    }
    assert BallsInBinsMechanism(1.0, 4, 2).to_dict() == {
        "kind": "balls-in-bins",
        "noise_multiplier": 1.0,
        "bins": 4,
        "epochs": 2,
        "bin_semantics": "per-epoch",
        "correlation": None,
    }


def test_mechanisms_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        UlsMechanism(1.0, 0.1).noise_multiplier = 2.0  # type: ignore[misc]


@pytest.mark.parametrize(
    ("build", "needle"),
    [
        (lambda: UlsMechanism(1.0, 0.0), "sampling_prob=0.0"),
        (lambda: UlsMechanism(1.0, 1.5), "sampling_prob=1.5"),
        (lambda: UlsMechanism(1.0, math.nan), "sampling_prob=nan"),
        (lambda: UlsMechanism(0.0, 0.1), "noise_multiplier=0.0"),
        (lambda: UlsMechanism(-1.0, 0.1), "noise_multiplier=-1.0"),
        (lambda: UlsMechanism(math.inf, 0.1), "noise_multiplier=inf"),
        (lambda: UlsMechanism("1", 0.1), "noise_multiplier='1'"),
        (lambda: ElsMechanism(1.0, 0.1, 0), "group_size=0"),
        (lambda: ElsMechanism(1.0, 0.1, 1.5), "group_size=1.5"),
        (lambda: ElsMechanism(1.0, 0.1, True), "group_size=True"),
        (lambda: GroupPrivacyMechanism(1.0, 0.1, -2), "group_size=-2"),
        (lambda: BallsInBinsMechanism(1.0, 0, 1), "bins=0"),
        (lambda: BallsInBinsMechanism(1.0, 2, 0), "epochs=0"),
        (lambda: BallsInBinsMechanism(1.0, 2, 1, "sometimes"), "bin_semantics='sometimes'"),
        (lambda: BallsInBinsMechanism(1.0, 2, 1, correlation="blt"), "correlation='blt'"),
        (lambda: RandomizedClippingMechanism(1.0, 0.1, 0), "probes=0"),
        (lambda: RandomizedClippingMechanism(1.0, 0.1, 4, "exact"), "estimator='exact'"),
    ],
)
def test_invalid_parameters_name_parameter_value_and_range(build, needle) -> None:
    with pytest.raises(InvalidMechanismError) as info:
        build()
    message = str(info.value)
    assert message.startswith(needle)
    assert "expected" in message and "\n" not in message
    assert isinstance(info.value, ValueError)


def test_from_dict_rejects_unknown_kind_unknown_key_and_missing_key() -> None:
    with pytest.raises(InvalidMechanismError, match="kind='dp-sgd'"):
        mechanism_from_dict({"kind": "dp-sgd"})
    with pytest.raises(InvalidMechanismError, match="'clip_norm'"):
        mechanism_from_dict(
            {"kind": "uls", "noise_multiplier": 1.0, "sampling_prob": 0.1, "clip_norm": 1.0}
        )
    with pytest.raises(InvalidMechanismError, match="uls mechanism"):
        mechanism_from_dict({"kind": "uls", "noise_multiplier": 1.0})
    with pytest.raises(InvalidMechanismError):
        mechanism_from_dict({"noise_multiplier": 1.0})


def test_dp_event_uls_is_poisson_subsampled_gaussian() -> None:
    event = dp_event(UlsMechanism(1.25, 0.03))
    assert event == dp_accounting.PoissonSampledDpEvent(0.03, dp_accounting.GaussianDpEvent(1.25))


def test_dp_event_els_is_binomial_mixture_of_gaussians() -> None:
    event = dp_event(ElsMechanism(2.0, 0.1, 5))
    assert isinstance(event, dpe.MixtureOfGaussiansDpEvent)
    assert event.standard_deviation == 2.0
    assert list(event.sensitivities) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert event.sampling_probs == pytest.approx(stats.binom.pmf(range(6), 5, 0.1), abs=1e-15)
    assert sum(event.sampling_probs) == pytest.approx(1.0)


@pytest.mark.parametrize("mechanism", ALL[2:], ids=lambda m: m.kind)
def test_whole_run_mechanisms_have_no_dp_event(mechanism) -> None:
    with pytest.raises(NoDpEventError):
        dp_event(mechanism)


def test_correlation_spec_is_canonical() -> None:
    a = CorrelationSpec.of("banded", bands=4, scale=0.5)
    b = CorrelationSpec.from_dict({"name": "banded", "params": {"scale": 0.5, "bands": 4}})
    assert a == b and hash(a) == hash(b)
    assert a.to_dict() == {"name": "banded", "params": {"bands": 4, "scale": 0.5}}
    with pytest.raises(InvalidMechanismError):
        CorrelationSpec("")


def test_accounting_never_imports_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, userdp.accounting, userdp.cli.account\n"
        "assert 'torch' not in sys.modules, 'userdp.accounting imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("build", "name"),
    [
        (lambda: UlsMechanism(True, 0.01), "noise_multiplier"),
        (lambda: UlsMechanism(1.0, True), "sampling_prob"),
        (lambda: ElsMechanism(1.0, 0.01, 2.0), "group_size"),
        (lambda: BallsInBinsMechanism(1.0, 8.0, 2, "fixed"), "bins"),
    ],
)
def test_booleans_are_not_numbers_and_integral_floats_are_not_integers(build, name):
    """The mechanisms take the checks every accountant and sampler takes (one module)."""
    with pytest.raises(InvalidMechanismError, match=rf"^{name}=(True|2\.0|8\.0) is "):
        build()
