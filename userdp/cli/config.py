"""``userdp config check FILE`` and ``userdp config show [FILE]``."""

from __future__ import annotations

import argparse
import json


def _check(args: argparse.Namespace) -> int:
    from pathlib import Path

    from userdp.config import ConfigError, load_config
    from userdp.config.load import read_toml, relative_paths
    from userdp.run.registry import check_strategy
    from userdp.run.tracking import missing_backends

    config = load_config(args.file)
    try:  # the strategy (a plugin is imported from its folder) takes what the run would pass
        check_strategy(config)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    missing = missing_backends(config.output.report_to)
    if missing:  # the machine that runs simulate/train needs them; checked here too
        raise ConfigError("output.report_to: " + "; ".join(missing))
    print(f"{args.file}: ok")
    folder = Path(args.file).resolve().parent
    resolved = relative_paths(read_toml(args.file), folder)
    if resolved:
        print(f"relative paths are inside the config's folder, {folder}:")
        for key, (written, target) in resolved.items():
            print(f"  {key} = {written!r} -> {target}")
    return 0


def _show(args: argparse.Namespace) -> int:
    from userdp.config import Config, load_config

    config = load_config(args.file) if args.file else Config()
    print(json.dumps(config.model_dump(), indent=2))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("config", help="validate or show a userdp TOML config")
    sub = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="validate FILE; exit 2 with one line per problem")
    check.add_argument("file")
    check.set_defaults(handler=_check)
    show = sub.add_parser("show", help="print the full config (defaults filled in) as JSON")
    show.add_argument("file", nargs="?")
    show.set_defaults(handler=_show)
