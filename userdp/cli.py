"""The ``userdp`` command line: one parser, with each subcommand registered by its own module.

A command module exposes ``register(subparsers)``, which adds its parser and sets ``handler`` to a
function ``(args) -> int``. Convention: a handler raises ``ValueError`` (or a subclass, e.g.
``ConfigError``) for bad user input; ``main`` prints it as one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from userdp import __version__

# Modules that add subcommands, in the order ``--help`` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "userdp.cli_config",
    "userdp.cli_shard",
    "userdp.cli_simulate",
    "userdp.cli_audit",
    "userdp.accounting.cli",
    "userdp.cli_deploy",
    "userdp.cli_certs",
    "userdp.cli_coordinator",
    "userdp.cli_worker",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="userdp",
        description="Train and fine-tune language models with user-level differential privacy.",
    )
    parser.add_argument("--version", action="version", version=f"userdp {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        return int(handler(args) or 0)
    except ValueError as exc:
        print(f"userdp {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"userdp {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
