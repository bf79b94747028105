"""One validation module for every layer: a bool is never a number, an integral float is not an
integer, and the config, the mechanisms, the samplers and the strategies agree on it."""

from __future__ import annotations

import pytest
from userdp.accounting.mechanisms import BallsInBinsMechanism, InvalidMechanismError, UlsMechanism
from userdp.accounting.validation import in_interval, interval_text, positive_int, probability
from userdp.strategies.base import StrategyError
from userdp.strategies.builtins import UserLevelSampling
from userdp.strategies.samplers import BallsInBinsSampler, PoissonSampler, SamplerError

from userdp.config import ConfigError, parse_config


def test_the_shared_checks() -> None:
    assert in_interval(0.5, 0.0, 1.0) and in_interval(1.0, 0.0, 1.0, hi_open=False)
    assert not in_interval(True, 0.0, 2.0)
    assert not in_interval(float("nan"), 0.0, 1.0)
    assert not in_interval(0.0, 0.0, 1.0) and in_interval(0.0, 0.0, 1.0, lo_open=False)
    assert interval_text(0.0, float("inf"), lo_open=False) == "[0, inf)"
    with pytest.raises(ValueError, match="expected an integer >= 1"):
        positive_int("bins", 2.0, ValueError)
    with pytest.raises(ValueError, match=r"expected a float in \(0, 1\]"):
        probability("q", True, ValueError, upper_open=False)


def test_every_layer_refuses_a_bool_for_a_number() -> None:
    with pytest.raises(ConfigError, match="strategy.sampling_prob"):
        parse_config({"strategy": {"sampling_prob": True}})
    with pytest.raises(InvalidMechanismError, match="sampling_prob=True"):
        UlsMechanism(noise_multiplier=1.0, sampling_prob=True)
    with pytest.raises(SamplerError, match="True"):
        PoissonSampler(True)
    with pytest.raises(StrategyError, match="clip_norm=True"):
        UserLevelSampling(noise_multiplier=1.0, clip_norm=True, sampling_prob=0.1)


def test_every_layer_refuses_an_integral_float_for_an_integer() -> None:
    with pytest.raises(ConfigError, match="strategy.steps must be an integer"):
        parse_config({"strategy": {"steps": 80.0}})
    with pytest.raises(InvalidMechanismError, match="bins=2.0"):
        BallsInBinsMechanism(noise_multiplier=1.0, bins=2.0, epochs=1)
    with pytest.raises(SamplerError, match="2.0"):
        BallsInBinsSampler(2.0)
