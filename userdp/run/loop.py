"""The run loop of ``userdp simulate`` and ``userdp train``: one run from a config to a model
and a privacy report, whichever transport drives its steps (:mod:`userdp.run.launch` picks it).

:class:`RunLoop` owns the run's setup (:mod:`userdp.run.components`: σ calibrated to the target
before step 1), the held-out users' loss on the initial model (the no-fine-tuning baseline), the
progress bar, the metrics, the evaluations and the outputs (:mod:`userdp.run.outputs`,
:mod:`userdp.run.report`). A transport calls :meth:`RunLoop.on_step` after each step and
:meth:`RunLoop.finish` at the end. Ctrl-C (or SIGTERM) stops cleanly: a checkpoint is saved and
the same command resumes; the ledger, not the step counter, says what was spent.

``test_only_disable_noise`` (NOT PRIVATE) is carried for :mod:`userdp.run.launch`, which binds it
into the coordinator or the in-process step; no config key or CLI flag reaches it.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from userdp.clients.model import build_model, load_parameters, model_shape
from userdp.clients.shard_store import ShardStore
from userdp.clients.tokenization import load_tokenizer
from userdp.config import Config
from userdp.run.components import NoTargetTokensError, RunSetup, open_ledger, prepare_run
from userdp.run.evaluation import Evaluator, eval_examples, token_frequency_loss
from userdp.run.outputs import (
    MetricsLog,
    export_release,
    resume_conflicts,
    write_config,
    write_facts,
)
from userdp.run.report import read_metrics, render_plots, render_report
from userdp.run.samples import generate_samples, sample_prompts, write_samples
from userdp.run.tracking import Trackers
from userdp.server.startup import progress_logger, summarize

__all__ = ["RunLoop", "RunResult", "resolved_config", "shut_down"]

log = logging.getLogger(__name__)


@dataclass
class RunResult:
    run_dir: Path
    steps_done: int
    epsilon: float | None
    delta: float
    noise_multiplier: float
    baseline_eval_loss: float | None
    final_eval_loss: float | None
    stopped: str  # "finished", "budget", "interrupted"
    params: dict[str, torch.Tensor] = field(repr=False, default_factory=dict)


def resolved_config(config: Config, setup: RunSetup, out: Path, mode: str) -> Any:
    """The config as run: shards, model folder and DeepSpeed file as absolute paths, σ and δ
    fixed, output dir set (written to ``config.toml``, which workers and ``userdp report``
    read)."""
    coordinator = config.coordinator
    if mode != "external":  # the workers are local; a configured port is kept (0: a free one)
        coordinator = coordinator.model_copy(update={"host": "127.0.0.1"})
    files = {
        key: str(Path(value).expanduser().resolve())
        for key in ("path", "deepspeed_config")
        if (value := getattr(config.model, key))
    }
    return config.model_copy(
        update={
            "data": config.data.model_copy(update={"shards": str(setup.shard_dir.resolve())}),
            "model": config.model.model_copy(update=files),
            "privacy": config.privacy.model_copy(
                update={"noise_multiplier": setup.noise_multiplier, "delta": setup.delta}
            ),
            "output": config.output.model_copy(update={"dir": str(out)}),
            "coordinator": coordinator,
        }
    )


class RunLoop:
    """Metrics, evaluation, progress and outputs around the steps of one run."""

    def __init__(self, config: Config, out: Path, *, quiet: bool, test_only_disable_noise: bool):
        self.out = out
        self.quiet = quiet
        self.no_noise = test_only_disable_noise
        out.mkdir(parents=True, exist_ok=True)
        self.setup = prepare_run(config, quiet=quiet)
        self.config = config
        self.steps = config.strategy.steps
        self.eval_every = max(1, self.steps // 10)
        self.epsilon_every = max(1, self.steps // 50)
        self.epsilon: float | None = None
        self.eval_losses: dict[int, float] = {}
        self._bar: Any = None
        self._log_progress: Any = None
        self._last_time = time.perf_counter()

    # -- components ------------------------------------------------------------------------------

    def start(self, mode: str) -> None:
        self.mode = mode
        self.run_config = resolved_config(self.config, self.setup, self.out, mode)
        conflicts = resume_conflicts(self.out, self.run_config, self.config)
        if conflicts:
            raise ValueError(
                f"{self.out} holds a run of another config ({'; '.join(conflicts[:3])}): resume "
                f"it with {self.out / 'config.toml'}, or pass a new --output (output.dir)"
            )
        self.config_path = write_config(self.run_config, self.out)
        self.ledger = open_ledger(self.setup, self.out)
        self.metrics = MetricsLog(self.out / "metrics.jsonl")
        self.trackers = Trackers(
            self.run_config.output.report_to, self.out, self.run_config.model_dump()
        )
        self.model, self.evaluator = self._model_and_evaluator()
        earlier = [r for r in read_metrics(self.metrics.path) if r.get("kind") == "eval"]
        self.eval_losses.update({r["step"]: r["eval_loss"] for r in earlier})  # a resumed run's
        done = {r["step"] for r in earlier}
        if 0 not in done and not self.ledger.records:
            self.evaluate(0)  # the no-fine-tuning baseline, before any privacy is spent
        self.epsilon = self._spent()
        if not self.quiet:
            self._bar = tqdm(total=self.steps, initial=len(self.ledger.records), unit="step")

    def _model_and_evaluator(self) -> tuple[Any, Any]:
        """The launcher's copy of the model (evaluation and the saved model) holding the run's
        frozen tensors, and the held-out evaluator on it (None without held-out users)."""
        setup = self.setup
        shape = model_shape(setup.manifest, self.config.data.seq_len)
        model = build_model(self.config.model, shape, seed=0)
        load_parameters(model, setup.frozen)
        if not setup.eval_users:
            return model, None
        with ShardStore(setup.shard_dir) as store:
            examples = eval_examples(store, setup.eval_users, self.config.data.seq_len)
        self.token_frequency_loss = token_frequency_loss(examples)
        return model, Evaluator(model, examples, pad_id=shape.pad_id or 0)

    def evaluate(self, step: int, params: dict[str, torch.Tensor] | None = None) -> None:
        if self.evaluator is None:
            return
        load_parameters(self.model, params if params is not None else self.setup.trainable)
        loss = self.evaluator.loss()
        self.eval_losses[step] = loss
        self._record(
            {
                "kind": "eval",
                "step": step,
                "eval_loss": loss,
                "users": len(self.setup.eval_users),
                "token_frequency_loss": finite_or_none(self.token_frequency_loss),
            }
        )

    def _record(self, row: dict[str, Any]) -> None:
        """A metrics.jsonl row, also sent to the trackers of ``output.report_to``."""
        self.metrics.write(row)
        self.trackers.log_row(row)

    def _write_samples(self) -> None:
        """Greedy continuations of the sample prompts (:mod:`userdp.run.samples`)."""
        output = self.run_config.output
        if output.sample_prompts is None and (not output.sample_count or not self.setup.eval_users):
            return
        tokenizer = load_tokenizer(self.setup.shard_dir)
        with ShardStore(self.setup.shard_dir) as store:
            prompts = sample_prompts(self.run_config, tokenizer, store, self.setup.eval_users)
        pad = self.setup.manifest.tokenizer.pad_id
        rows = generate_samples(
            self.model,
            tokenizer,
            prompts,
            output.sample_max_new_tokens,
            pad if pad is not None else 0,
        )
        write_samples(rows, self.out)

    def close_progress(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def abandon(self) -> None:
        """After an error: close the progress bar, end the trackers' runs (flushed) and release
        the ledger's writer lock (the same process may run the folder again, e.g. once the
        error is fixed); a failure here (e.g. the same full disk) is logged, never raised over
        the run's error."""
        self.close_progress()
        shut_down(
            ("end the trackers' runs", lambda: self.trackers.finish(None, None)),
            ("close the ledger", self.ledger.close),
        )

    def on_worker_progress(self, starting: list[Any]) -> None:
        """While the coordinator waits for workers: each starting worker's phase on the progress
        bar (or logged when quiet: on a change, else every 30 s); an empty list clears it."""
        if self._bar is not None:
            text = summarize(starting)
            self._bar.set_description_str(f"workers: {text}" if text else "", refresh=True)
            return
        if self._log_progress is None:
            self._log_progress = progress_logger(log)
        self._log_progress(starting)

    def _spent(self) -> float | None:
        return self.ledger.spent(self.setup.delta) if self.ledger.records else None

    # -- per step --------------------------------------------------------------------------------

    def on_step(
        self,
        step: int,
        units: int,
        expected: float,
        clipped: int,
        nonfinite: int,
        loss: float,
        tokens: int,
        params: dict[str, torch.Tensor],
    ) -> None:
        now = time.perf_counter()
        seconds, self._last_time = now - self._last_time, now
        done = step + 1
        if done % self.epsilon_every == 0 or done == self.steps:
            self.epsilon = self._spent()
        self._record(
            {
                "kind": "step",
                "step": step,
                "loss": loss,
                "epsilon": self.epsilon,
                "target_epsilon": self.config.privacy.epsilon,
                "cohort_size": units,
                "expected_cohort_size": expected,
                "clip_fraction": clipped / units if units else None,
                "nonfinite": nonfinite,
                "step_time_s": seconds,
                "tokens_per_s": tokens / seconds if seconds > 0 else None,
            }
        )
        if units and not tokens:
            raise NoTargetTokensError(_no_tokens_message(step, units, nonfinite, self._spent()))
        if done % self.eval_every == 0 or done == self.steps:
            self.evaluate(done, params)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(eps=f"{self.epsilon or 0:.3g}", loss=f"{loss:.3f}")
        else:
            log.info("step %d: loss %.4f, eps %s, %d units", step, loss, self.epsilon, units)

    def finish(self, params: dict[str, torch.Tensor], stopped: str) -> RunResult:
        self.close_progress()
        steps_done = len(self.ledger.records)
        if steps_done and steps_done not in self.eval_losses and stopped != "interrupted":
            self.evaluate(steps_done, params)
        self.epsilon = self._spent()
        self.ledger.close()
        plane = "in-process" if self.mode == "in-process" else self.config.coordinator.data_plane
        write_facts(self.setup.strategy.facts(), self.out, len(self.setup.population.users), plane)
        export_release(self.model, params, self.out, self.setup, self.epsilon)
        if stopped != "interrupted":
            self._write_samples()
        report = render_report(self.out, self.run_config, self.setup.delta) if steps_done else None
        if self.run_config.output.plots:
            render_plots(self.out)
        self.trackers.finish(report, self.out / "privacy_report.md")
        losses = sorted(self.eval_losses.items())
        return RunResult(
            run_dir=self.out,
            steps_done=steps_done,
            epsilon=self.epsilon,
            delta=self.setup.delta,
            noise_multiplier=self.setup.noise_multiplier,
            baseline_eval_loss=self.eval_losses.get(0),
            final_eval_loss=losses[-1][1] if losses else None,
            stopped=stopped,
            params=params,
        )


def finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _no_tokens_message(step: int, units: int, nonfinite: int, epsilon: float | None) -> str:
    """Why a step that trained on no target token stops the run, and what to change."""
    if nonfinite == units:
        cause = (
            f"the loss of all {units} units of its cohort was not finite (the model diverged): "
            "lower strategy.server_lr or strategy.clip_norm"
        )
    else:
        cause = (
            f"none of the {units} units of its cohort had an example of 2 or more tokens within "
            "data.seq_len: shard longer examples"
        )
    spent = f"ε = {epsilon:.4g}" if epsilon is not None else "what was"
    return (
        f"step {step} trained on no token, so the run stops rather than spend its budget on "
        f"nothing (the ledger records {spent} spent so far): {cause}"
    )


def shut_down(*actions: tuple[str, Any]) -> list[BaseException]:
    """Run every shutdown action even when one fails (a full disk must not leave the gRPC server
    or the worker processes running, which would keep the process alive): each failure is
    logged in one line and returned."""
    errors: list[BaseException] = []
    for what, action in actions:
        try:
            action()
        except Exception as exc:
            log.error("could not %s: %s", what, " ".join(str(exc).split()) or type(exc).__name__)
            errors.append(exc)
    return errors
