"""``userdp audit --config F``: one-run canary audit of a config (see :mod:`userdp.audit`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def _audit(args: argparse.Namespace) -> int:
    from userdp.audit import run_audit, write_audit
    from userdp.cli_simulate import demo_config_path
    from userdp.config import load_config

    if args.demo == bool(args.config):
        raise ValueError("give exactly one of --config FILE or --demo")
    config = load_config(demo_config_path() if args.demo else args.config)
    logging.basicConfig(level=logging.WARNING)
    result = run_audit(
        config,
        canaries=args.canaries,
        canary_norm_multiple=args.canary_norm_multiple,
        confidence=args.confidence,
        seed=args.seed,
    )
    out = Path(args.output or config.output.dir)
    path = write_audit(result, out)
    print(json.dumps({**result.to_dict(), "written": str(path)}))
    if result.flagged:
        print(
            f"userdp audit: FLAGGED: empirical ε ≥ {result.epsilon_lower_bound:.3f} "
            f"({result.confidence:.0%} confidence) exceeds the accountant's ε = "
            f"{result.claimed_epsilon:.3f}: the implementation leaks more than it claims",
            file=sys.stderr,
        )
        return 4
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "audit",
        help="empirical ε lower bound from one training run with canary users",
        description=(
            "Train the config once in the in-process simulator with canary users, each included "
            "with probability 1/2 and carrying a gradient of norm (canary-norm-multiple x C) on a "
            "coordinate of its own; guess membership from the released noisy sums and turn the "
            "correct guesses into an ε lower bound (Steinke, Nasr, Jagielski 2023). Exit 4 when "
            "the lower bound exceeds the accountant's ε. With r guesses the bound cannot exceed "
            "about ln(r) - 1, so it catches gross bugs; audit at a small ε (e.g. 1-2) and δ."
        ),
    )
    parser.add_argument("--config", help="the run's TOML config (user-unit strategies)")
    parser.add_argument("--demo", action="store_true", help="audit the embedded default config")
    parser.add_argument("--canaries", type=int, default=200, help="canary users (default 200)")
    parser.add_argument(
        "--canary-norm-multiple",
        type=float,
        default=100.0,
        help="canary gradient norm as a multiple of the clip norm (default 100)",
    )
    parser.add_argument("--confidence", type=float, default=0.95, help="default 0.95")
    parser.add_argument("--seed", type=int, help="canary membership/coordinate seed")
    parser.add_argument("--output", help="folder for audit.json (default: output.dir)")
    parser.set_defaults(handler=_audit)
