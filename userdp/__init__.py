"""userdp: language-model training with user-level differential privacy.

The Python API (the CLI's ``userdp simulate`` in one call)::

    import userdp

    result = userdp.simulate("run.toml", "runs/first", workers="in-process")
    print(result.epsilon, result.delta, result.steps_done, result.final_eval_loss)

``config`` may be a TOML path, a dict of the TOML's sections, or a :class:`userdp.Config`.
Strategies (built-in and the base class for plugins) are in :mod:`userdp.strategies`.
Attributes are imported on first use, so ``import userdp`` stays cheap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Config", "ConfigError", "RunResult", "load_config", "parse_config", "simulate"]

if TYPE_CHECKING:
    from userdp.api import simulate
    from userdp.config import Config, ConfigError, load_config, parse_config
    from userdp.run.launch import RunResult

_LAZY = {
    "Config": "userdp.config",
    "ConfigError": "userdp.config",
    "load_config": "userdp.config",
    "parse_config": "userdp.config",
    "RunResult": "userdp.run.launch",
    "simulate": "userdp.api",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'userdp' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
