"""The test-only noiseless mode cannot be reached from a config file or the command line."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from userdp.server import runtime

from userdp.cli import build_parser
from userdp.config import Config, ConfigError, parse_config

REPO = Path(__file__).resolve().parents[2]


def _fields(model, prefix=""):
    for name in type(model).model_fields:
        value = getattr(model, name)
        if hasattr(type(value), "model_fields"):
            yield from _fields(value, f"{prefix}{name}.")
        else:
            yield f"{prefix}{name}"


def test_no_config_key_or_cli_flag_disables_noise():
    keys = list(_fields(Config()))
    assert not [k for k in keys if "disable" in k or "no_noise" in k or "test_only" in k]
    with pytest.raises(ConfigError, match="noise_multiplier"):
        parse_config({"privacy": {"noise_multiplier": 0.0}})
    parser = build_parser()
    flags = [
        option
        for action in parser._subparsers._group_actions
        for sub in action.choices.values()
        for a in sub._actions
        for option in a.option_strings
    ]
    assert not [f for f in flags if "noise" in f and ("no" in f or "disable" in f)]


def test_only_the_coordinator_constructor_knows_the_switch():
    assert "test_only_disable_noise" not in inspect.signature(runtime.start_coordinator).parameters
    users = [
        p.relative_to(REPO)
        for folder in ("server", "userdp", "clients", "strategies", "accounting")
        for p in (REPO / folder).glob("*.py")
        if "test_only_disable_noise" in p.read_text()
    ]
    assert users == [Path("server/coordinator.py")]
