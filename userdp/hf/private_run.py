"""The userdp side of a ``Trainer`` run, independent of the ``Trainer``: the components of a run
built from a :class:`~userdp.hf.arguments.UserDPArguments`, one private step on the Trainer's
model, the strategy's checkpoint state, and the run folder's outputs.

A step is userdp's step contract (:func:`userdp.strategies.step.run_step`) with the local gather
of ``simulate --in-process``: the strategy's sampler draws the cohort, userdp's clipping engine
computes the clipped sum on the Trainer's own model, the strategy adds noise from its generator
(the secure keystream by default), the ledger is appended (fsync'd) and only then does the
strategy's server update run. Here that update is :class:`TrainerGradient`: it puts the noisy
mean (the noisy sum over the expected cohort size) into each trainable parameter's ``.grad``,
and the Trainer's optimizer and schedule apply it, which is post-processing.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from userdp.accounting.ledger import BudgetExceededError, Ledger
from userdp.clients.batching import Unit
from userdp.clients.engine import ClippingEngine
from userdp.clients.perplexity import example_perplexities
from userdp.clients.selection import PERPLEXITY_SELECTIONS
from userdp.clients.shard_store import ShardStore
from userdp.clients.worker_service import EngineCompute
from userdp.config import Config
from userdp.proto.codec import task_proto
from userdp.run.components import strategy_from_config, training_data
from userdp.run.outputs import write_config, write_facts, write_release_state
from userdp.run.report import render_report
from userdp.server.checkpoint import load_latest, save_checkpoint
from userdp.server.resume_point import continue_after_lost_steps
from userdp.strategies.local_step import run_local_step
from userdp.strategies.optimizers import ServerOptimizer
from userdp.strategies.unit_stats import UnitStats

__all__ = ["PrivateRun", "StepOutcome", "TrainerGradient"]

log = logging.getLogger(__name__)

STATE_FOLDER = "userdp"
"""The folder of a Trainer checkpoint (``checkpoint-N/userdp``) that holds the strategy's state."""


class TrainerGradient(ServerOptimizer):
    """The strategy's server update handed to the Trainer: it keeps the noisy mean it is given
    (:meth:`take` returns it once) instead of moving the parameters; the Trainer's optimizer
    then applies it as each parameter's ``.grad`` (post-processing of the release)."""

    name = "hf-trainer"

    def __init__(self) -> None:
        super().__init__(1.0)
        self.pending: dict[str, Any] | None = None

    def step(self, params: Mapping[str, Any], gradient: Mapping[str, Any]) -> None:
        missing = sorted(set(params) - set(gradient))
        if missing:
            raise ValueError(f"gradient is missing parameter(s) {missing[:3]}")
        self.steps += 1
        self.pending = {name: gradient[name] for name in params}

    def take(self) -> dict[str, Any] | None:
        pending, self.pending = self.pending, None
        return pending

    def _delta(self, grad: Any, slots: dict[str, Any]) -> Any:  # pragma: no cover - unused
        raise NotImplementedError("TrainerGradient hands the gradient to the Trainer")


@dataclass(frozen=True)
class StepOutcome:
    """What one Trainer step did: ``released`` (False: nothing drawn, charged or applied),
    ``loss`` (mean next-token loss of the cohort's units, NaN without tokens), ``units``."""

    released: bool
    loss: float
    units: int
    stop: str | None = None
    cohort: tuple[str, ...] = ()
    """The units the step trained on (secret like the sampler seed: never logged)."""


class PrivateRun:
    """The components of one private Trainer run (module docstring).

    ``model`` is the Trainer's model (full or PEFT, on its device); its trainable parameters are
    the strategy's ``params`` (shared tensors: the Trainer's optimizer updates them in place)."""

    def __init__(self, config: Config, model: torch.nn.Module, output_dir: Path) -> None:
        self.config = config
        self.out = Path(output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        data = training_data(config)
        self.data = data
        self.strategy, self.options, self.delta = strategy_from_config(
            config, len(data.train_users)
        )
        self.strategy.optimizer = TrainerGradient()
        self.store = ShardStore(data.shard_dir)
        pad = data.manifest.tokenizer.pad_id
        engine = ClippingEngine(
            model,
            engine="loop" if config.strategy.engine == "loop" else "vectorized",
            probes=config.strategy.probes,
            token_budget=config.workers.token_budget,
            pad_id=pad if pad is not None else 0,
        )
        self.model = model
        self.params = engine.trainable_parameters()
        # the strategy's view of the parameters, on the host like the coordinator's: it reads
        # only their names, shapes and dtypes (the noisy mean goes to .grad), so it is made once
        # (a CPU model's tensors themselves; a GPU model's copied once, not every step)
        self.host_params = {name: p.detach().cpu() for name, p in self.params.items()}
        perplexities = None
        if config.data.selection in PERPLEXITY_SELECTIONS:  # under the initial model
            perplexities = example_perplexities(
                model,
                self.store,
                config.data.seq_len,
                cache_dir=config.workers.cache_dir,
                token_budget=config.workers.token_budget,
                pad_id=engine.pad_id,
            )
        self.compute = EngineCompute(self.store, engine, Unit, perplexities)
        self.ledger = Ledger.open(
            self.out / "ledger.jsonl",
            create=True,
            budget_epsilon=config.privacy.epsilon,
            delta=self.delta,
        )
        self.skip_until = 0
        self.last: StepOutcome | None = None
        self.test_only_disable_noise = False
        """NOT PRIVATE, tests only (as ``simulate``'s): no argument or setting reaches it."""

    # -- steps -----------------------------------------------------------------------------------

    def step(self, step: int) -> StepOutcome:
        """Step ``step`` on the model (eval mode: no dropout, as every userdp worker computes);
        a step the ledger already charged (lost after the checkpoint it resumed from) is skipped
        and never released again."""
        if step < self.skip_until:
            self.last = StepOutcome(released=False, loss=math.nan, units=0)
            return self.last
        stats = UnitStats()
        cohort: list[str] = []

        def gather(spec: Any, unit_ids: Any, params: dict[str, torch.Tensor]) -> Any:
            nonlocal stats
            cohort.extend(unit_ids)
            task = task_proto(spec, step, "trainer", 0, 0, list(unit_ids), 0.0)
            result = self.compute.compute(task)
            stats += result.stats
            sums = {name: value.detach().float().cpu() for name, value in result.sums.items()}
            return sums, result.stats

        was_training = self.model.training
        self.model.eval()
        try:
            record = run_local_step(
                self.strategy,
                step,
                self.host_params,
                self.data.population,
                gather,
                ledger=self.ledger,
                workers=1,
                options=self.options,
                test_only_disable_noise=self.test_only_disable_noise,
            )
        except BudgetExceededError as exc:
            log.warning("stopping before step %d: %s", step, exc)
            self.last = StepOutcome(released=False, loss=math.nan, units=0, stop="budget")
            return self.last
        finally:
            self.model.train(was_training)
        gradient = self.strategy.optimizer.take()  # the noisy mean, after the ledger append
        for name, param in self.params.items():
            param.grad = (
                None
                if gradient is None
                else torch.as_tensor(gradient[name]).to(param.device, param.dtype)
            )
        self.last = StepOutcome(
            released=True, loss=stats.loss_mean, units=record.units, cohort=tuple(cohort)
        )
        return self.last

    def epsilon(self) -> float | None:
        return self.ledger.spent(self.delta) if self.ledger.records else None

    # -- checkpoints -----------------------------------------------------------------------------

    def save_state(self, checkpoint_dir: Path, step: int) -> None:
        """The strategy's state (sampler and its secret seed, noise state; never the noise
        generator) into ``checkpoint_dir/userdp`` beside the Trainer's own checkpoint."""
        save_checkpoint(
            checkpoint_dir / STATE_FOLDER,
            step=step,
            model_version=step,
            ledger_entries=len(self.ledger.records),
            state={"strategy": self.strategy.state_dict()},
            keep=1,
        )

    def resume(self, checkpoint_dir: Path) -> int:
        """Restore the strategy's state saved with the Trainer checkpoint ``checkpoint_dir``;
        steps the ledger charged after it stay charged and are skipped
        (:func:`~userdp.server.resume_point.continue_after_lost_steps`). Returns the step the
        checkpoint holds."""
        saved = load_latest(checkpoint_dir / STATE_FOLDER)
        if saved is None:
            raise ValueError(
                f"{checkpoint_dir} holds no userdp state ({STATE_FOLDER}/): it was not written "
                "by UserDPTrainer; resume from one of its checkpoints"
            )
        self.strategy.load_state_dict(saved.state["strategy"])
        self.strategy.optimizer = TrainerGradient()
        charged = [int(r["step"]) for r in self.ledger.records]
        last = max(charged, default=-1)
        self.skip_until = saved.step
        if last >= saved.step:
            self.skip_until = continue_after_lost_steps(self.strategy, saved.step, last)
        return saved.step

    # -- outputs ---------------------------------------------------------------------------------

    def finish(self, save_model: Any) -> dict:
        """The run folder of ``simulate``: ``config.toml`` (σ and δ as run),
        ``strategy_facts.json``, ``model/`` (``save_model(folder)``, then its release record) and
        ``privacy_report.{json,md}``; returns the report."""
        run_config = self.config.model_copy(
            update={
                "privacy": self.config.privacy.model_copy(
                    update={"noise_multiplier": self.strategy.noise_multiplier, "delta": self.delta}
                )
            }
        )
        write_config(run_config, self.out)
        write_facts(
            self.strategy.facts(), self.out, len(self.data.train_users), data_plane="in-process"
        )
        epsilon = self.epsilon()
        model_dir = self.out / "model"
        save_model(str(model_dir))
        write_release_state(model_dir, self.out / "ledger.jsonl", epsilon, self.delta)
        report = render_report(self.out, run_config, self.delta) if self.ledger.records else {}
        return report

    def close(self) -> None:
        self.ledger.close()
        self.store.close()
