"""``userdp coordinator --config F``: serve workers and run the DP training steps of the config.

Reads the shard manifest (user -> shard, shard sha256; never rows), holds out the evaluation
users, builds the strategy (σ calibrated to the target when not given), the ledger
(``<output.dir>/ledger.jsonl``) and the initial model (:func:`userdp.run.components.prepare_run`), resumes from
``<output.dir>/checkpoints`` when it exists (the ledger decides what was spent), serves the
``userdp.v1`` protocol on ``coordinator.host:port`` (see :mod:`userdp.server.runtime` for the
security choice) and runs until ``strategy.steps`` steps are done or the budget is exhausted;
then it drains the workers (they exit 0). Interrupted (SIGTERM or SIGINT, also when started as a
background job with SIGINT ignored), it saves a checkpoint and leaves the workers waiting for a
restart (each for at most its ``workers.reconnect_timeout_s``). A shard folder deleted or moved
during the run stops it before the step under way releases anything. A run that took steps leaves, beside the
ledger and checkpoints in ``output.dir``, the config as run, the privacy report and the exported
model (:func:`_write_outputs`).
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
from pathlib import Path

from userdp.cli.simulate import stop_signals


def _run(args: argparse.Namespace) -> int:
    with stop_signals():
        return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    from userdp.config import load_config
    from userdp.proto.allocator import keep_freed_memory
    from userdp.server.startup import progress_logger

    keep_freed_memory()  # chunk messages reuse freed pages (see the module)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = load_config(args.config)
    if config.data.shards is None:
        raise ValueError("data.shards must name a shard directory for `userdp coordinator`")
    from userdp.clients.shard_store import check_present
    from userdp.run.components import open_ledger, prepare_run
    from userdp.server.runtime import start_coordinator

    setup = prepare_run(config)  # user split, population, sigma calibrated to the target
    out = Path(config.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    running = start_coordinator(
        config,
        strategy=setup.strategy,
        ledger=open_ledger(setup, out),
        params=setup.trainable,
        frozen=setup.frozen,
        population=setup.population,
        checkpoint_dir=out / "checkpoints",
        allowed_workers=[w for w in (args.allow_workers or "").split(",") if w] or None,
        options=setup.options,
        data_check=functools.partial(check_present, setup.shard_dir, setup.manifest.shards),
    )
    coordinator = running.coordinator
    finished = False
    try:
        address = f"{config.coordinator.host}:{running.server.port}"
        print(json.dumps({"listening": address, "step": coordinator.step}), flush=True)
        coordinator.wait_for_workers(
            on_progress=progress_logger(logging.getLogger("userdp.coordinator"))
        )
        coordinator.run(config.strategy.steps)
        finished = True
    finally:
        coordinator.save()
        running.stop(finished)
    if coordinator.step:
        _write_outputs(setup, out, coordinator.params)
    return 0


def _write_outputs(setup, out: Path, params) -> None:
    """What a finished run leaves beside its ledger and checkpoints: ``config.toml`` (as run, σ
    and δ resolved), ``strategy_facts.json``, the exported model with its release state, and
    ``privacy_report.{json,md}`` recomputed from the ledger."""
    from userdp.clients.model import build_model, load_parameters, model_shape
    from userdp.run.loop import resolved_config
    from userdp.run.outputs import export_release, write_config, write_facts
    from userdp.run.report import render_report

    run_config = resolved_config(setup.config, setup, out, "external")
    write_config(run_config, out)
    plane = setup.config.coordinator.data_plane
    write_facts(setup.strategy.facts(), out, len(setup.population.users), plane)
    report = render_report(out, run_config, setup.delta)
    model = build_model(setup.config.model, model_shape(setup.manifest, setup.config.data.seq_len))
    load_parameters(model, setup.frozen)
    model_dir = export_release(model, params, out, setup, report["epsilon"])
    logging.getLogger("userdp.coordinator").info(
        "privacy report: %s (epsilon %.4g at delta %.3g); model: %s",
        out / "privacy_report.md",
        report["epsilon"],
        setup.delta,
        model_dir,
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "coordinator", help="serve workers and run the DP training steps of a config"
    )
    parser.add_argument("--config", required=True, help="the run's TOML config")
    parser.add_argument(
        "--allow-workers", help="comma-separated worker ids allowed to register (default: any)"
    )
    parser.set_defaults(handler=_run)
