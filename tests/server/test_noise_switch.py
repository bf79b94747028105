"""The test-only noiseless mode cannot be reached from a config file or the command line."""

from __future__ import annotations

from pathlib import Path

import pytest

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


# Python-API entry points that pass the test-only switches down to the coordinator / step loop;
# each documents the switch as test-only. Any other module mentioning one is a new path to it.
ALLOWED = {
    "test_only_disable_noise": {
        Path("server/coordinator.py"),
        Path("server/runtime.py"),
        Path("strategies/local_step.py"),
        Path("strategies/step.py"),
        Path("userdp/run/launch.py"),
        Path("userdp/run/loop.py"),
        Path("userdp/hf/private_run.py"),  # UserDPTrainer's attribute, set by its tests only
        Path("userdp/hf/trainer.py"),
    },
    "test_only_disable_clipping": {Path("userdp/run/audit.py")},
}


def _modules():
    for folder in ("server", "userdp", "clients", "strategies", "accounting", "proto"):
        yield from sorted((REPO / folder).rglob("*.py"))


@pytest.mark.parametrize("switch", sorted(ALLOWED))
def test_only_the_python_api_knows_the_switch(switch):
    users = {p.relative_to(REPO) for p in _modules() if switch in p.read_text()}
    assert users == ALLOWED[switch]
    for path in users:
        assert (
            "NOT PRIVATE" in (REPO / path).read_text() or "test-only" in (REPO / path).read_text()
        )


def test_no_command_line_module_mentions_a_test_only_switch():
    cli_modules = [p for p in _modules() if p.parent == REPO / "userdp" / "cli"]
    assert len(cli_modules) >= 8
    assert not [p.name for p in cli_modules if "test_only" in p.read_text()]
