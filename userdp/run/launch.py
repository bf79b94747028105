"""One run from a config to a model and a privacy report, through the transport a mode names.

- ``grpc`` (``simulate``): the real coordinator serves the ``userdp.v1`` protocol on loopback and
  ``workers.count`` worker processes (``userdp worker``) hold the shards
  (:mod:`userdp.run.grpc_workers`).
- ``in-process`` (``simulate --in-process``): the same strategy hooks and worker compute in one
  process, without gRPC or retries (:mod:`userdp.run.in_process`).
- ``external`` (``train``): the coordinator serves ``coordinator.host:port`` and waits for an
  already running deployment's workers (:mod:`userdp.run.grpc_workers`).

The run loop (:class:`userdp.run.loop.RunLoop`) owns setup, outputs and progress; a transport
drives its steps. This module is where the test-only noise switch of :func:`run` is bound into
the coordinator and the in-process step; the transports never see it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from userdp.clients.shard_store import check_present
from userdp.config import Config
from userdp.run.grpc_workers import serve_workers
from userdp.run.in_process import run_in_process
from userdp.run.loop import RunLoop, RunResult
from userdp.run.registry import check_strategy
from userdp.server.runtime import start_coordinator
from userdp.strategies.local_step import run_local_step

__all__ = ["MODES", "RunResult", "run"]

MODES = ("grpc", "in-process", "external")


def run(
    config: Config,
    output: str | Path | None = None,
    *,
    mode: str = "grpc",
    quiet: bool = False,
    test_only_disable_noise: bool = False,
) -> RunResult:
    """Run ``config`` (see the module docstring); ``output`` overrides ``output.dir``.

    ``test_only_disable_noise`` (NOT PRIVATE) exists for the test that compares the grpc and
    in-process paths; no config key or CLI flag reaches it."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    check_strategy(config)  # a plugin's errors before any output is written
    out = Path(output or config.output.dir)
    loop = RunLoop(config, out, quiet=quiet, test_only_disable_noise=test_only_disable_noise)
    loop.start(mode)
    stopped = "interrupted"
    params = loop.setup.trainable
    try:
        if mode == "in-process":
            step = functools.partial(run_local_step, test_only_disable_noise=loop.no_noise)
            params, stopped = run_in_process(loop, step)
        else:
            params, stopped = serve_workers(
                loop, start_coordinator_for(loop), spawn=(mode == "grpc")
            )
    except KeyboardInterrupt:
        stopped = "interrupted"
    except Exception:
        loop.abandon()
        raise
    try:
        return loop.finish(params, stopped)
    except Exception:
        loop.abandon()
        raise


def start_coordinator_for(loop: RunLoop) -> Any:
    """The coordinator of the ``grpc`` and ``external`` modes, serving ``loop``'s components
    (:func:`userdp.server.runtime.start_coordinator`), not yet waiting for workers."""
    setup = loop.setup
    return start_coordinator(
        loop.run_config,
        strategy=setup.strategy,
        ledger=loop.ledger,
        params=setup.trainable,
        frozen=setup.frozen,
        population=setup.population,
        checkpoint_dir=loop.out / "checkpoints",
        options=setup.options,
        test_only_disable_noise=loop.no_noise,
        data_check=functools.partial(check_present, setup.shard_dir, setup.manifest.shards),
    )
