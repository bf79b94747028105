"""The ``userdp`` command line: one parser, with each subcommand registered by its own module.

A command module exposes ``register(subparsers)``, which adds its parser and sets ``handler`` to a
function ``(args) -> int``; ``register`` imports nothing heavy (``userdp --help`` stays fast), the
handler imports what it needs. Convention: a handler raises ``ValueError`` (or a subclass, e.g.
``ConfigError``) for bad user input; ``main`` prints it as one line and exits with status 2. Any
other error is also one line with status 2, naming the file that holds its traceback
(``args.log_dir`` when the handler set one, e.g. a run folder's ``logs/``, else the temp dir).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from userdp import __version__
from userdp.environment import use_environment_caches

# Modules that add subcommands, in the order ``--help`` lists them.
COMMAND_MODULES: tuple[str, ...] = (
    "userdp.cli.config",
    "userdp.cli.shard",
    "userdp.cli.plan",
    "userdp.cli.simulate",
    "userdp.cli.audit",
    "userdp.cli.account",
    "userdp.cli.ledger",
    "userdp.cli.deploy",
    "userdp.cli.certs",
    "userdp.cli.coordinator",
    "userdp.cli.worker",
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
    use_environment_caches()
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
    except Exception as exc:
        where = _save_traceback(args)
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"userdp {args.command}: error: {message} (traceback: {where})", file=sys.stderr)
        return 2


def _save_traceback(args: argparse.Namespace) -> Path | str:
    """Write the current exception's traceback to a log file; return its path."""
    directory = Path(getattr(args, "log_dir", None) or tempfile.gettempdir())
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = directory / f"userdp-{args.command}-error-{stamp}-{os.getpid()}.log"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(traceback.format_exc())
    except OSError as exc:  # e.g. the disk that failed the run is full: say so, not "unwritable"
        try:
            path.unlink(missing_ok=True)  # no empty or partial log left behind
        except OSError:
            pass
        return f"not saved: {exc.strerror or exc} in {directory}"
    return path
