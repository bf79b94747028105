"""``userdp simulate``, ``userdp train`` and ``userdp report`` (see :mod:`userdp.run.loop`)."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any


def demo_config_path() -> Path:
    """The embedded default config (``userdp/defaults/demo.toml``)."""
    return Path(str(resources.files("userdp") / "defaults" / "demo.toml"))


def demo_config() -> Any:
    """The embedded default :class:`~userdp.config.Config`; its ``output.dir`` (``runs/demo``)
    is in the current directory."""
    from userdp.config import load_config

    return load_config(demo_config_path(), relative_to=Path.cwd())


def _interrupt(signum, frame):
    raise KeyboardInterrupt


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def stop_signals(handler: Callable[[int, object], object] = _interrupt) -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM both call ``handler`` (default: raise
    KeyboardInterrupt); the previous handlers come back after it. SIGINT is installed explicitly
    because a background job of a non-interactive shell starts with SIGINT ignored, and Python
    keeps it ignored. Used by ``simulate``, ``train``, ``coordinator`` and ``worker``."""
    previous = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    try:
        for signum in STOP_SIGNALS:
            signal.signal(signum, handler)
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old if old is not None else signal.SIG_DFL)


def _summary(result, quiet: bool) -> None:
    line = {
        "run_dir": str(result.run_dir),
        "stopped": result.stopped,
        "steps": result.steps_done,
        "epsilon": result.epsilon,
        "delta": result.delta,
        "noise_multiplier": result.noise_multiplier,
        "baseline_eval_loss": result.baseline_eval_loss,
        "final_eval_loss": result.final_eval_loss,
    }
    print(json.dumps(line), flush=True)
    if result.stopped == "interrupted":
        print(
            "userdp: interrupted; the ledger and checkpoint are consistent: run the same command "
            "to resume",
            file=sys.stderr,
        )
    elif result.stopped == "budget":
        print("userdp: stopped before a step that would exceed the ε budget", file=sys.stderr)


def _load(args: argparse.Namespace):
    from userdp.config import load_config
    from userdp.run.registry import check_strategy

    if getattr(args, "demo", False):
        if args.config:
            raise ValueError("give either --config or --demo, not both")
        return demo_config()
    if not args.config:
        raise ValueError("--config FILE is required (or --demo for the embedded default run)")
    config = load_config(args.config)
    check_strategy(config)  # a plugin's errors before anything else is said or started
    return config


def _logging(quiet: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if quiet else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def _run(args: argparse.Namespace) -> int:
    """``simulate`` (grpc, or in-process) and ``train`` (external workers)."""
    from userdp.config.local_files import run_folder_problem
    from userdp.proto.allocator import keep_freed_memory
    from userdp.run.launch import run

    keep_freed_memory()  # chunk messages reuse freed pages (see the module)
    config = _load(args)
    run_dir = args.output or config.output.dir
    problem = run_folder_problem(run_dir, "--output" if args.output else "output.dir")
    if problem:
        raise ValueError(problem)
    args.log_dir = Path(run_dir) / "logs"
    _logging(args.quiet)
    if config.output.seed is None:
        from userdp.run.report import initial_model_note

        print(f"userdp: {initial_model_note(None)}", file=sys.stderr)
    if args.command == "train":
        mode = "external"
    else:
        mode = "in-process" if args.in_process else "grpc"
    with stop_signals():
        result = run(config, args.output, mode=mode, quiet=args.quiet)
    _summary(result, args.quiet)
    return 130 if result.stopped == "interrupted" else 0


def _report(args: argparse.Namespace) -> int:
    from userdp.config import load_config
    from userdp.run.report import render_plots, render_report

    run_dir = Path(args.run_dir)
    config_path = run_dir / "config.toml"
    if not (run_dir / "ledger.jsonl").is_file() or not config_path.is_file():
        raise ValueError(f"{run_dir} is not a run folder (needs ledger.jsonl and config.toml)")
    config = load_config(config_path, local_files=False)  # the run's machine's paths
    if config.privacy.delta is None:
        raise ValueError(f"{config_path} has no privacy.delta (not written by a userdp run)")
    delta = args.delta if args.delta is not None else config.privacy.delta
    report = render_report(run_dir, config, delta)
    plots = render_plots(run_dir) if config.output.plots else []
    print(
        json.dumps(
            {
                "epsilon": report["epsilon"],
                "delta": report["delta"],
                "steps": report["steps"],
                "report": str(run_dir / "privacy_report.md"),
                "plots": [str(p) for p in plots],
            }
        )
    )
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    sim = subparsers.add_parser(
        "simulate",
        help="run a config end to end on this machine: coordinator + worker processes over gRPC",
        description=(
            "Start the coordinator and workers.count worker processes on loopback (each of "
            "workers.ranks ranks under torch's launcher), run "
            "strategy.steps DP steps (sigma calibrated to privacy.epsilon first), and write the "
            "run folder: model/, privacy_report.{json,md}, metrics.jsonl, plots/, config.toml, "
            "ledger.jsonl. Ctrl-C (SIGINT) or SIGTERM stops cleanly; the same command resumes."
        ),
    )
    sim.add_argument("--config", help="the run's TOML config")
    sim.add_argument("--demo", action="store_true", help="use the embedded default config")
    sim.add_argument("--output", help="run folder (default: output.dir of the config)")
    sim.add_argument(
        "--in-process",
        action="store_true",
        help="same strategy and worker compute in one process, without gRPC (checkpoints and resumes like the coordinator)",
    )
    sim.add_argument("--quiet", action="store_true", help="log lines instead of a progress bar")
    sim.set_defaults(handler=_run)

    train = subparsers.add_parser(
        "train",
        help="run a config against already running workers (a deployment)",
        description=(
            "Serve the coordinator on coordinator.host:port and run the config's steps with the "
            "workers of an existing deployment (`userdp worker --coordinator HOST:PORT ...`); "
            "writes the same run folder as simulate. Held-out evaluation runs when data.shards "
            "is readable here."
        ),
    )
    train.add_argument("--config", required=True, help="the run's TOML config")
    train.add_argument("--output", help="run folder (default: output.dir of the config)")
    train.add_argument("--quiet", action="store_true", help="log lines instead of a progress bar")
    train.set_defaults(handler=_run, demo=False)

    report = subparsers.add_parser(
        "report",
        help="re-render a run's privacy report and plots from its folder (ledger + metrics)",
    )
    report.add_argument("run_dir", metavar="RUN_DIR", help="a run folder written by simulate/train")
    report.add_argument("--delta", type=float, help="report ε at this δ (default: the run's δ)")
    report.set_defaults(handler=_report)
