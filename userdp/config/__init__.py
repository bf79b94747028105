"""The one TOML config shared by ``train``, ``simulate``, ``coordinator``, ``worker`` and ``audit``.

Every section is a frozen pydantic model that forbids unknown keys, so a typo is an error, not a
silently ignored setting; values are strict (``true``/``false`` only for booleans, unquoted numbers
for numbers: ``"yes"``, ``1`` or ``"80"`` are errors naming the key, never coerced).
:func:`load_config` turns validation failures into :class:`ConfigError`
whose message names the key, the bad value and the allowed range, e.g.
``privacy.delta must be in (0, 1), got 1.5``; an unknown key gets the closest known one. The
files a config names are checked by :mod:`userdp.config.local_files`.
"""

from __future__ import annotations

from userdp.clients.deepspeed_config import (
    PARTITIONING,
    deepspeed_json_problem,
    read_deepspeed_json,
)
from userdp.config.load import PRESET_MAX_SEQ_LEN, check_local_files, load_config, parse_config
from userdp.config.schema import (
    Config,
    ConfigError,
    CoordinatorConfig,
    DataConfig,
    ModelConfig,
    OutputConfig,
    PrivacyConfig,
    StrategyConfig,
    WorkersConfig,
)

__all__ = [
    "PARTITIONING",
    "PRESET_MAX_SEQ_LEN",
    "Config",
    "ConfigError",
    "CoordinatorConfig",
    "DataConfig",
    "ModelConfig",
    "OutputConfig",
    "PrivacyConfig",
    "StrategyConfig",
    "WorkersConfig",
    "check_local_files",
    "deepspeed_json_problem",
    "load_config",
    "parse_config",
    "read_deepspeed_json",
]
