"""Reading a config: TOML to validated sections (:func:`parse_config`), the checks that span keys,
and the files it names on this machine (:func:`load_config`)."""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from userdp.clients.deepspeed_config import read_deepspeed_json
from userdp.clients.presets import PRESETS
from userdp.config.local_files import local_file_problems
from userdp.config.schema import Config, ConfigError
from userdp.strategies.catalogue import (
    BUILTIN_STRATEGIES,
    PluginError,
    check_config_rules,
    check_strategy_keys,
    strategy_class,
)


def _known_keys(loc: tuple[Any, ...]) -> list[str]:
    """The keys of the config section at ``loc`` (a validation error's location, minus its
    last part)."""
    model: Any = Config
    for part in loc:
        field = getattr(model, "model_fields", {}).get(part)
        if field is None or not isinstance(field.annotation, type):
            return []
        model = field.annotation
    return list(getattr(model, "model_fields", {}))


def _format_error(err: dict[str, Any]) -> str:
    key = ".".join(str(part) for part in err["loc"])
    kind = err["type"]
    value = err.get("input")
    if kind == "extra_forbidden":
        close = difflib.get_close_matches(str(err["loc"][-1]), _known_keys(err["loc"][:-1]), n=1)
        hint = f"did you mean {close[0]!r}? " if close else "check the spelling; "
        return f"{key}: unknown key ({hint}see `userdp config show` for all keys)"
    if kind == "missing":
        return f"{key}: required key is missing"
    if kind == "bool_type":
        return f"{key} must be true or false (an unquoted TOML boolean), got {value!r}"
    if kind in ("int_type", "float_type") and isinstance(value, str):
        what = "an integer" if kind == "int_type" else "a number"
        return f"{key} must be {what}, not a string: write it unquoted, got {value!r}"
    if kind == "int_type":
        return f"{key} must be an integer, got {value!r}"
    if kind == "float_type":
        return f"{key} must be a number, got {value!r}"
    message = err["msg"]
    if message.startswith("Value error, "):
        return f"{key} {message.removeprefix('Value error, ')}"
    return f"{key}: {message[0].lower() + message[1:]}, got {value!r}"


def parse_config(raw: dict[str, Any]) -> Config:
    """Validate a parsed TOML document; raise ConfigError naming every bad key."""
    try:
        config = Config.model_validate(raw)
    except ValidationError as exc:
        lines = [_format_error(err) for err in exc.errors()]
        raise ConfigError("; ".join(lines)) from None
    strategy = config.strategy
    if strategy.name in BUILTIN_STRATEGIES and (strategy.params or strategy.plugin_path):
        key = "params" if strategy.params else "plugin_path"
        raise ConfigError(
            f"strategy.{key} is for plugin strategies (name = 'package.module:ClassName'); the "
            f"built-in {strategy.name!r} takes the [strategy] keys"
        )

    if strategy.name in BUILTIN_STRATEGIES:  # a plugin is checked once its folder is known
        cls = strategy_class(strategy.name)
        try:
            check_strategy_keys(cls, strategy)
            check_config_rules(cls, strategy, config.data.selection)
        except PluginError as exc:
            raise ConfigError(str(exc)) from None
    if config.model.path is None:
        _check_preset_seq_len(config.model.preset, config.data.seq_len)
    coordinator = config.coordinator
    if coordinator.data_plane == "collective" and coordinator.group_port == coordinator.port != 0:
        raise ConfigError(
            f"coordinator.group_port = {coordinator.group_port} is coordinator.port too: the "
            "rendezvous store needs a port of its own; set another coordinator.group_port"
        )
    workers = config.workers
    if workers.token_budget < config.data.seq_len:
        raise ConfigError(
            f"workers.token_budget = {workers.token_budget:,} is less than one example window "
            f"(data.seq_len = {config.data.seq_len:,} tokens): a micro-batch must hold at least "
            f"one example; set workers.token_budget >= {config.data.seq_len:,} (the default is "
            "8192) or lower data.seq_len"
        )
    if workers.replicas > workers.count:
        raise ConfigError(
            f"workers.replicas = {workers.replicas} > workers.count = {workers.count}: each shard "
            "needs that many distinct workers; lower workers.replicas or raise workers.count"
        )
    if strategy.sampling == "cyclic-poisson" and strategy.bands is None:
        raise ConfigError(
            "strategy.sampling = 'cyclic-poisson' samples group t mod b̂ at step t: set "
            "strategy.bands = b̂ (the groups, and the bands of the banded C it is accounted with)"
        )
    if config.strategy.sampling == "shuffle" and not config.privacy.allow_unaccounted_sampling:
        raise ConfigError(
            "strategy.sampling = 'shuffle' has no tight accountant: set "
            "privacy.allow_unaccounted_sampling = true to run it anyway (the report will say so)"
        )
    return config


PRESET_MAX_SEQ_LEN = 8192
"""The longest ``data.seq_len`` a preset is built for (its position table has that many rows)."""


def _check_preset_seq_len(preset: str | None, seq_len: int) -> None:
    """A preset sizes its positions from ``data.seq_len``: bound it, with the memory it implies."""
    if seq_len <= PRESET_MAX_SEQ_LEN:
        return
    family, layers, width, heads = PRESETS[preset or "gpt2-tiny"]
    table = (
        f"a position table of {seq_len:,} x {width} float32 ({seq_len * width * 4 / 1e9:.3g} GB)"
    )
    scores = heads * seq_len**2 * 4 / 1e9
    raise ConfigError(
        f"data.seq_len = {seq_len:,} is more than {PRESET_MAX_SEQ_LEN}, the longest the presets "
        f"are built for: model.preset = {preset!r} would get "
        + (f"{table} and " if family == "gpt2" else "")
        + f"attention scores of {heads} heads x {seq_len:,}² float32 per layer and example "
        f"({scores:.3g} GB); set data.seq_len <= {PRESET_MAX_SEQ_LEN}"
    )


def check_local_files(config: Config) -> None:
    """The files ``config`` names on THIS machine (:mod:`userdp.config.local_files`) and its
    DeepSpeed JSON; :class:`ConfigError` naming every problem (a plugin strategy is imported and
    checked by the run that builds it, and by ``config check``:
    :func:`userdp.run.registry.check_strategy`). Checked by :func:`load_config`,
    not by :func:`parse_config` nor ``deploy render``, whose config names paths that exist only
    inside the pods."""
    problems = local_file_problems(config)
    if config.model.deepspeed_config is not None:
        try:
            read_deepspeed_json(config.model.deepspeed_config)
        except ValueError as exc:
            problems.append(str(exc))
    if problems:
        raise ConfigError("; ".join(problems))


PATH_KEYS = (
    ("data", "shards"),
    ("model", "path"),
    ("model", "deepspeed_config"),
    ("strategy", "plugin_path"),
    ("coordinator", "auth_token_file"),
    ("coordinator", "tls_dir"),
    ("workers", "cache_dir"),
    ("output", "dir"),
)
"""The keys that name a file or folder. In a config file, a relative one means a path inside the
file's folder (``~`` is expanded): the file can be used from any current directory."""


def read_toml(path: str | Path) -> dict[str, Any]:
    """A config file's TOML document; :class:`ConfigError` when it is missing or unreadable."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path} is not UTF-8 text") from None


def relative_paths(raw: dict[str, Any], folder: Path) -> dict[str, tuple[str, str]]:
    """``section.key`` -> (the path as written, the absolute path it means) for every path key
    of ``raw`` written relative (:data:`PATH_KEYS`), resolved against ``folder``."""
    resolved = {}
    for section, key in PATH_KEYS:
        value = raw.get(section, {}).get(key) if isinstance(raw.get(section), dict) else None
        if not isinstance(value, str) or Path(value).is_absolute():
            continue
        expanded = Path(value).expanduser()
        target = expanded if expanded.is_absolute() else folder.resolve() / expanded
        resolved[f"{section}.{key}"] = (value, str(target))
    return resolved


def load_config(
    path: str | Path,
    *,
    local_files: bool = True,
    relative_to: str | Path | None = None,
) -> Config:
    """Read and validate a TOML config file, and (``local_files``) the files it names on this
    machine (:func:`check_local_files`). A relative path in it is a path inside ``relative_to``,
    by default the file's folder (:data:`PATH_KEYS`). A plugin strategy with no
    ``plugin_path`` is looked up in that folder."""
    path = Path(path)
    raw = read_toml(path)
    config = parse_config(raw)
    folder = Path(relative_to) if relative_to is not None else path.resolve().parent
    updates: dict[str, dict[str, str]] = {}
    for dotted, (_, target) in relative_paths(raw, folder).items():
        section, key = dotted.split(".")
        updates.setdefault(section, {})[key] = target
    if config.strategy.name not in BUILTIN_STRATEGIES and config.strategy.plugin_path is None:
        updates.setdefault("strategy", {})["plugin_path"] = str(folder.resolve())
    config = config.model_copy(
        update={
            section: getattr(config, section).model_copy(update=values)
            for section, values in updates.items()
        }
    )
    if local_files:
        check_local_files(config)
    return config
