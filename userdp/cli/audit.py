"""``userdp audit --config F``: one-run canary audit of a config (see :mod:`userdp.run.audit`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

PHASES = {
    "preparing": "preparing the run (data, σ calibration, model)",
    "training": "training once with canary users",
    "accounting": "turning the canaries' scores into a lower bound",
}


def _audit(args: argparse.Namespace) -> int:
    from userdp.cli.simulate import demo_config, stop_signals
    from userdp.config import load_config
    from userdp.run.audit import largest_lower_bound, run_audit, write_audit

    if args.demo == bool(args.config):
        raise ValueError("give exactly one of --config FILE or --demo")
    config = demo_config() if args.demo else load_config(args.config)
    logging.basicConfig(level=logging.WARNING)
    reach = largest_lower_bound(args.canaries, args.confidence)
    target = config.privacy.epsilon
    print(
        f"userdp audit: {args.canaries} canaries at {args.confidence:.0%} confidence can show an "
        f"ε lower bound of at most {reach:.2f}; the config targets ε = {target:g}"
        + (
            f": above that reach, the audit catches only gross bugs here (audit at ε <= "
            f"{reach:.1f}, or give more --canaries)"
            if target > reach
            else ""
        ),
        file=sys.stderr,
        flush=True,
    )
    bar = None

    def on_phase(phase: str) -> None:
        nonlocal bar
        if bar is not None:
            bar.close()
            bar = None
        print(f"userdp audit: {PHASES[phase]}", file=sys.stderr, flush=True)
        if phase == "training":
            from tqdm import tqdm

            bar = tqdm(total=config.strategy.steps, unit="step", file=sys.stderr)

    def on_step(done: int) -> None:
        if bar is not None:
            bar.update(done - bar.n)

    try:
        with stop_signals():
            result = run_audit(
                config,
                canaries=args.canaries,
                canary_norm_multiple=args.canary_norm_multiple,
                confidence=args.confidence,
                seed=args.seed,
                on_phase=on_phase,
                on_step=on_step,
            )
    finally:
        if bar is not None:
            bar.close()
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
