"""``userdp.simulate``: one training run from Python, as ``userdp simulate`` runs it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from userdp.config import Config, ConfigError, check_local_files, load_config, parse_config
from userdp.environment import use_environment_caches
from userdp.run.launch import RunResult, run

__all__ = ["WORKERS", "simulate"]

WORKERS = ("grpc", "in-process")

ConfigSource = str | Path | Mapping[str, Any] | Config
"""A TOML path, a dict of its sections, or a validated :class:`~userdp.config.Config`."""


def _as_config(config: ConfigSource) -> Config:
    if isinstance(config, Config):
        return config
    if isinstance(config, str | Path):
        return load_config(config)
    if isinstance(config, Mapping):
        parsed = parse_config(dict(config))
        check_local_files(parsed)
        return parsed
    raise ConfigError(
        f"config={type(config).__name__} is not allowed; expected a TOML path, a dict of its "
        "sections or a userdp.Config"
    )


def simulate(
    config: ConfigSource,
    output_dir: str | Path | None = None,
    *,
    workers: str = "grpc",
    quiet: bool = True,
) -> RunResult:
    """Train ``config`` and return its :class:`~userdp.run.loop.RunResult` (run folder, steps
    done, ε, δ, σ, held-out loss before and after, why it stopped).

    ``workers="grpc"`` starts the coordinator and ``workers.count`` worker processes on loopback
    (the deployment's code path); ``"in-process"`` runs the same strategy and worker compute in
    this process. ``output_dir`` overrides ``output.dir``; an existing run folder is resumed.
    A plugin strategy in a dict config is imported from ``strategy.plugin_path`` or
    ``sys.path``. Bad input raises :class:`userdp.ConfigError` (a ValueError)."""
    if workers not in WORKERS:
        raise ConfigError(f"workers={workers!r} is not allowed; expected one of {WORKERS}")
    use_environment_caches()  # the environment's prebuilt DeepSpeed op, as the CLI finds it
    return run(_as_config(config), output_dir, mode=workers, quiet=quiet)
