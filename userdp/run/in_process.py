"""The ``in-process`` transport of :func:`userdp.run.launch.run` (``simulate --in-process``).

The same strategy hooks (:func:`userdp.strategies.local_step.run_local_step`) and the same worker
compute (:class:`userdp.clients.worker_service.EngineCompute`, fed the wire ``Task`` the coordinator
would send) in one process, without gRPC or retries. It checkpoints like the coordinator (every
``coordinator.checkpoint_every`` steps and on exit, same format) and resumes from the checkpoint
(:func:`_resume_in_process`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from userdp.accounting.ledger import BudgetExceededError
from userdp.clients.shard_store import ShardStore
from userdp.clients.worker_service import build_compute
from userdp.config import Config
from userdp.proto.codec import task_proto
from userdp.run.components import RunSetup
from userdp.run.loop import RunLoop
from userdp.server.checkpoint import save_checkpoint
from userdp.server.resume_point import continue_after_lost_steps, restore_resume_point
from userdp.strategies.unit_stats import UnitStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalTensor:
    """A local tensor where :meth:`EngineCompute.apply_model` expects a received one."""

    tensor: torch.Tensor

    def torch(self) -> torch.Tensor:
        return self.tensor


class InProcessWorker:
    """The worker compute (:class:`~userdp.clients.worker_service.EngineCompute` over the run's
    shards) called in this process with the wire ``Task`` the coordinator would send for the
    same step and units. Used by ``simulate --in-process`` and by ``userdp audit``."""

    def __init__(self, config: Config, setup: RunSetup) -> None:
        self.store = ShardStore(setup.shard_dir)
        self.compute = build_compute(config, self.store)
        self.compute.apply_model({k: LocalTensor(v) for k, v in setup.frozen.items()}, full=True)

    def __call__(
        self, spec: Any, step: int, unit_ids: Sequence[str], params: dict[str, torch.Tensor]
    ) -> Any:
        """The :class:`~userdp.proto.results.TaskSum` of ``unit_ids`` at ``params``."""
        self.compute.apply_model({k: LocalTensor(v) for k, v in params.items()}, full=False)
        return self.compute.compute(task_proto(spec, step, "in-process", 0, 0, unit_ids, 0.0))

    def close(self) -> None:
        self.store.close()


def _resume_in_process(
    checkpoint_dir: Path, params: dict[str, torch.Tensor], strategy: Any, ledger: Any
) -> int:
    """Load the newest in-process checkpoint that verifies
    (:func:`~userdp.server.resume_point.restore_resume_point`) into ``params`` and ``strategy``;
    return the next step. Steps the ledger charged after that checkpoint (a crash between
    checkpoints, or a newer checkpoint that did not verify) are never re-run, as for the
    coordinator (:func:`~userdp.server.resume_point.continue_after_lost_steps`)."""
    charged = [int(record["step"]) for record in ledger.records]
    checkpoint = restore_resume_point(checkpoint_dir, params, strategy, charged)
    next_step = checkpoint.step if checkpoint is not None else 0
    last = max(charged, default=-1)
    if last >= next_step:
        return continue_after_lost_steps(strategy, next_step, last)
    return next_step


def run_in_process(
    loop: RunLoop, run_local_step: Callable[..., Any]
) -> tuple[dict[str, torch.Tensor], str]:
    """Run ``loop``'s steps in this process; returns the trained parameters and why it stopped
    ("finished", "budget" or "interrupted").

    ``run_local_step`` is :func:`userdp.strategies.local_step.run_local_step`, with any run-wide
    keyword arguments already bound by the caller."""
    setup, config = loop.setup, loop.run_config
    params = setup.trainable
    compute = InProcessWorker(config, setup)
    step_stats: dict[str, Any] = {}

    def worker(spec: Any, unit_ids: Any, current: dict[str, torch.Tensor]) -> tuple[dict, Any]:
        result = compute(spec, step_stats["step"], list(unit_ids), current)
        step_stats["stats"] += result.stats
        return dict(result.sums), result.stats

    checkpoint_dir = loop.out / "checkpoints"
    start = _resume_in_process(checkpoint_dir, params, setup.strategy, loop.ledger)
    done = start

    def save() -> None:
        save_checkpoint(
            checkpoint_dir,
            step=done,
            model_version=done,
            ledger_entries=len(loop.ledger.records),
            state={"params": params, "strategy": setup.strategy.state_dict()},
        )

    stopped = "finished"
    try:
        for step in range(start, loop.steps):
            step_stats.update(step=step, stats=UnitStats())
            try:
                record = run_local_step(
                    setup.strategy,
                    step,
                    params,
                    setup.population,
                    worker,
                    ledger=loop.ledger,
                    workers=config.workers.count,
                    options=setup.options,
                )
            except BudgetExceededError as exc:
                log.warning("stopping before step %d: %s", step, exc)
                stopped = "budget"
                break
            done = step + 1
            if done % config.coordinator.checkpoint_every == 0:
                save()
            stats = step_stats["stats"]
            loop.on_step(
                step,
                record.units,
                record.expected_size,
                record.clipped,
                stats.nonfinite,
                stats.loss_mean,
                stats.tokens,
                params,
            )
        save()
    except KeyboardInterrupt:
        stopped = "interrupted"
        save()  # an unexpected error saves nothing: the last checkpoint and the ledger resume
    finally:
        compute.close()
    return params, stopped
