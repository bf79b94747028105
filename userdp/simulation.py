"""``userdp simulate`` and ``userdp train``: one run from a config to a model and a privacy report.

Three ways to reach the workers, one run loop (:class:`RunLoop`) and one set of outputs
(:mod:`userdp.run_outputs`):

- ``grpc`` (``simulate``): the real coordinator serves the ``userdp.v1`` protocol on loopback and
  ``workers.count`` worker PROCESSES (``userdp worker``) hold the shards (``workers.replicas``
  copies of each) and compute with the DeepSpeed engine.
- ``in-process`` (``simulate --in-process``): the same strategy hooks
  (:func:`userdp.strategies.inprocess.run_step`) and the same worker compute
  (:class:`userdp.clients.worker_service.EngineCompute`, fed the same wire ``Task`` the
  coordinator would send) in one process, without gRPC or retries: fast research loops. It
  checkpoints like the coordinator (every ``coordinator.checkpoint_every`` steps and on exit,
  same format) and resumes from the checkpoint (:func:`_resume_in_process`).
- ``external`` (``train``): the coordinator serves ``coordinator.host:port`` and waits for an
  already running deployment's workers to connect.

Before step 1: σ is calibrated to the target (:mod:`userdp.run_components`), and the held-out
users' loss is measured on the initial model (the no-fine-tuning baseline). Ctrl-C (or SIGTERM)
stops cleanly: a checkpoint is saved and the same command resumes; the ledger, not the step
counter, says what was spent.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

MODES = ("grpc", "in-process", "external")
RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")


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


def resolved_config(config: Any, setup: Any, out: Path, mode: str) -> Any:
    """The config as run: shards, model folder and DeepSpeed file as absolute paths, σ and δ
    fixed, output dir set (written to ``config.toml``, which workers and ``userdp report``
    read)."""
    coordinator = config.coordinator
    if mode != "external":
        coordinator = coordinator.model_copy(update={"host": "127.0.0.1", "port": 0})
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

    def __init__(self, config: Any, out: Path, *, quiet: bool, test_only_disable_noise: bool):
        from userdp.run_components import prepare_run

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
        from userdp.run_components import open_ledger
        from userdp.run_outputs import MetricsLog, read_metrics, write_config
        from userdp.tracking import Trackers

        self.run_config = resolved_config(self.config, self.setup, self.out, mode)
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
            from tqdm import tqdm

            self._bar = tqdm(total=self.steps, initial=len(self.ledger.records), unit="step")

    def _model_and_evaluator(self) -> tuple[Any, Any]:
        """The launcher's copy of the model (evaluation and the saved model) holding the run's
        frozen tensors, and the held-out evaluator on it (None without held-out users)."""
        from userdp.clients.model import build_model, load_parameters, model_shape
        from userdp.clients.shard_store import ShardStore
        from userdp.evaluation import Evaluator, eval_examples

        setup = self.setup
        shape = model_shape(setup.manifest, self.config.data.seq_len)
        model = build_model(self.config.model, shape, seed=0)
        load_parameters(model, setup.frozen)
        if not setup.eval_users:
            return model, None
        with ShardStore(setup.shard_dir) as store:
            examples = eval_examples(store, setup.eval_users, self.config.data.seq_len)
        return model, Evaluator(model, examples, pad_id=shape.pad_id or 0)

    def evaluate(self, step: int, params: dict[str, torch.Tensor] | None = None) -> None:
        from userdp.clients.model import load_parameters

        if self.evaluator is None:
            return
        load_parameters(self.model, params if params is not None else self.setup.trainable)
        loss = self.evaluator.loss()
        self.eval_losses[step] = loss
        self._record(
            {"kind": "eval", "step": step, "eval_loss": loss, "users": len(self.setup.eval_users)}
        )

    def _record(self, row: dict[str, Any]) -> None:
        """A metrics.jsonl row, also sent to the trackers of ``output.report_to``."""
        self.metrics.write(row)
        self.trackers.log_row(row)

    def _write_samples(self) -> None:
        """Greedy continuations of the sample prompts (:mod:`userdp.samples`)."""
        from userdp.clients.shard_store import ShardStore
        from userdp.clients.tokenization import load_tokenizer
        from userdp.samples import generate_samples, sample_prompts, write_samples

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
        """After an error: close the progress bar and end the trackers' runs (flushed); a
        failure here (e.g. the same full disk) is logged, never raised over the run's error."""
        self.close_progress()
        _shut_down(("end the trackers' runs", lambda: self.trackers.finish(None, None)))

    def on_worker_progress(self, starting: list[Any]) -> None:
        """While the coordinator waits for workers: each starting worker's phase on the progress
        bar (or logged when quiet: on a change, else every 30 s); an empty list clears it."""
        from userdp.server.startup import progress_logger, summarize

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
        if done % self.eval_every == 0 or done == self.steps:
            self.evaluate(done, params)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(eps=f"{self.epsilon or 0:.3g}", loss=f"{loss:.3f}")
        else:
            log.info("step %d: loss %.4f, eps %s, %d units", step, loss, self.epsilon, units)

    def finish(self, params: dict[str, torch.Tensor], stopped: str) -> RunResult:
        from userdp.clients.model import load_parameters
        from userdp.export import export_model
        from userdp.run_outputs import (
            render_plots,
            render_report,
            write_facts,
            write_release_state,
        )

        self.close_progress()
        steps_done = len(self.ledger.records)
        if steps_done and steps_done not in self.eval_losses and stopped != "interrupted":
            self.evaluate(steps_done, params)
        self.epsilon = self._spent()
        self.ledger.close()
        write_facts(self.setup.strategy.facts(), self.out, len(self.setup.population.users))
        load_parameters(self.model, params)
        model_dir = export_model(
            self.model, self.out, self.setup.manifest.tokenizer, self.setup.shard_dir
        )
        write_release_state(model_dir, self.out / "ledger.jsonl", self.epsilon, self.setup.delta)
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


# ---- the three transports ----------------------------------------------------------------------


def _worker_assignments(shards: list[str], workers: int, replicas: int) -> list[list[str]]:
    """Shard j goes to workers j, j+1, … (mod W): ``replicas`` distinct holders per shard."""
    if replicas > workers:
        raise ValueError(f"workers.replicas = {replicas} > workers.count = {workers}")
    held: list[list[str]] = [[] for _ in range(workers)]
    for j, shard in enumerate(shards):
        for k in range(replicas):
            held[(j + k) % workers].append(shard)
    empty = [i for i, names in enumerate(held) if not names]
    if empty:
        raise ValueError(
            f"workers.count = {workers} exceeds what {len(shards)} shards x {replicas} replicas "
            "can keep busy; lower workers.count or raise workers.replicas"
        )
    return held


def _spawn_workers(loop: RunLoop, address: str) -> list[subprocess.Popen]:
    setup, config = loop.setup, loop.run_config
    shards = [entry.name for entry in setup.manifest.shards]
    held = _worker_assignments(shards, config.workers.count, config.workers.replicas)
    logs = loop.out / "logs"
    logs.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_ENV}
    env["PYTHONUNBUFFERED"] = "1"  # each worker is its own single-rank process group
    threads = max(1, (os.cpu_count() or 1) // len(held))
    env.setdefault("OMP_NUM_THREADS", str(threads))
    procs = []
    for i, names in enumerate(held):
        cmd = [
            sys.executable,
            "-m",
            "userdp.cli",
            "worker",
            "--coordinator",
            address,
            "--shards",
            str(setup.shard_dir),
            "--shard-names",
            ",".join(names),
            "--worker-id",
            f"sim-worker-{i}",
            "--config",
            str(loop.config_path),
        ]
        log_path = logs / f"worker-{i}.log"
        with open(log_path, "ab") as log_file:
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        proc.log_path = str(log_path)  # type: ignore[attr-defined]
        procs.append(proc)
    return procs


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][-300:] if lines else ""


def _check_workers_alive(procs: list[subprocess.Popen]) -> None:
    """Raise :class:`WorkerStartupError` naming the first worker process that has exited and
    the last line of its log (the wait for workers calls this while it waits)."""
    from userdp.server.startup import WorkerStartupError

    for proc in procs:
        if proc.poll() is not None:
            worker_id = proc.args[proc.args.index("--worker-id") + 1]
            log_path = Path(proc.log_path)
            last = _last_line(log_path)
            raise WorkerStartupError(
                f"worker {worker_id} exited with status {proc.returncode} before it was ready"
                + (f": {last}" if last else "")
                + f" (log: {log_path})"
            )


def _stop_workers(procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _run_coordinator(loop: RunLoop, spawn: bool) -> tuple[dict[str, torch.Tensor], str]:
    from userdp.server.runtime import start_coordinator

    setup = loop.setup
    running = start_coordinator(
        loop.run_config,
        strategy=setup.strategy,
        ledger=loop.ledger,
        params=setup.trainable,
        frozen=setup.frozen,
        population=setup.population,
        checkpoint_dir=loop.out / "checkpoints",
        options=setup.options,
        test_only_disable_noise=loop.no_noise,
    )
    coordinator = running.coordinator
    address = f"{loop.run_config.coordinator.host}:{running.server.port}"
    procs: list[subprocess.Popen] = []
    finished, stopped = False, "interrupted"

    def shutdown() -> list[BaseException]:
        return _shut_down(
            ("save the last checkpoint", coordinator.save),
            ("stop the coordinator", lambda: running.stop(finished)),
            ("stop the worker processes", lambda: _stop_workers(procs)),
        )

    try:
        if spawn:
            procs += _spawn_workers(loop, address)
        else:
            print(f"userdp train: coordinator listening on {address}", file=sys.stderr, flush=True)
        coordinator.wait_for_workers(
            on_progress=loop.on_worker_progress, check=lambda: _check_workers_alive(procs)
        )
        loop.on_worker_progress([])

        def on_step(report: Any) -> None:
            loop.on_step(
                report.step,
                report.units,
                report.expected_cohort_size,
                report.clipped,
                report.nonfinite,
                report.loss_mean,
                report.tokens,
                setup.trainable,
            )

        coordinator.run(loop.steps, on_step=on_step)
        finished = True
        stopped = "budget" if coordinator.budget_exhausted else "finished"
    except BaseException:
        shutdown()  # its own failures are logged; the run's error is the one raised
        raise
    errors = shutdown()
    if errors:
        raise errors[0]
    return setup.trainable, stopped


def _shut_down(*actions: tuple[str, Any]) -> list[BaseException]:
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


class InProcessWorker:
    """The worker compute (:class:`~userdp.clients.worker_service.EngineCompute` over the run's
    shards) called in this process with the wire ``Task`` the coordinator would send for the
    same step and units. Used by ``simulate --in-process`` and by ``userdp audit``."""

    def __init__(self, config: Any, setup: Any) -> None:
        from userdp.clients.shard_store import ShardStore
        from userdp.clients.worker_service import build_compute

        self.store = ShardStore(setup.shard_dir)
        self.compute = build_compute(config, self.store)
        self.compute.apply_model({k: LocalTensor(v) for k, v in setup.frozen.items()}, full=True)

    def __call__(
        self, spec: Any, step: int, unit_ids: Sequence[str], params: dict[str, torch.Tensor]
    ) -> Any:
        """The clipped sum of ``unit_ids`` at ``params`` (a :class:`ClippedSum`)."""
        from userdp.server.coordinator import task_proto

        self.compute.apply_model({k: LocalTensor(v) for k, v in params.items()}, full=False)
        return self.compute.compute(task_proto(spec, step, "in-process", 0, 0, unit_ids, 0.0))

    def close(self) -> None:
        self.store.close()


def _resume_in_process(
    checkpoint_dir: Path, params: dict[str, torch.Tensor], strategy: Any, ledger: Any
) -> int:
    """Load the latest in-process checkpoint into ``params`` and ``strategy``; return the next
    step. Steps the ledger charged after that checkpoint (a crash between checkpoints) are never
    re-run, as for the coordinator (:func:`~userdp.server.coordinator.continue_after_lost_steps`)."""
    from userdp.server.checkpoint import restore_latest
    from userdp.server.coordinator import continue_after_lost_steps

    checkpoint = restore_latest(checkpoint_dir, params, strategy)
    next_step = checkpoint.step if checkpoint is not None else 0
    last = ledger.last_step if ledger.records else -1
    if last >= next_step:
        return continue_after_lost_steps(strategy, next_step, last)
    return next_step


def _run_in_process(loop: RunLoop) -> tuple[dict[str, torch.Tensor], str]:
    from userdp.accounting.ledger import BudgetExceededError
    from userdp.server.checkpoint import save_checkpoint
    from userdp.strategies.base import ClipStatistics
    from userdp.strategies.inprocess import run_step

    setup, config = loop.setup, loop.run_config
    params = setup.trainable
    compute = InProcessWorker(config, setup)
    step_stats: dict[str, float] = {}

    def worker(spec: Any, unit_ids: Any, current: dict[str, torch.Tensor]) -> tuple[dict, Any]:
        result = compute(spec, int(step_stats["step"]), list(unit_ids), current)
        for key in ("loss_sum", "tokens", "nonfinite"):
            step_stats[key] += getattr(result, key)
        return dict(result.sums), ClipStatistics(result.count, result.clipped)

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
            step_stats.update(step=step, loss_sum=0.0, tokens=0, nonfinite=0)
            try:
                record = run_step(
                    setup.strategy,
                    step,
                    params,
                    setup.population,
                    worker,
                    ledger=loop.ledger,
                    workers=config.workers.count,
                    options=setup.options,
                    test_only_disable_noise=loop.no_noise,
                )
            except BudgetExceededError as exc:
                log.warning("stopping before step %d: %s", step, exc)
                stopped = "budget"
                break
            done = step + 1
            if done % config.coordinator.checkpoint_every == 0:
                save()
            tokens = int(step_stats["tokens"])
            loss = step_stats["loss_sum"] / tokens if tokens else math.nan
            loop.on_step(
                step,
                record.units,
                record.expected_size,
                record.clipped,
                int(step_stats["nonfinite"]),
                loss,
                tokens,
                params,
            )
        save()
    except KeyboardInterrupt:
        stopped = "interrupted"
        save()  # an unexpected error saves nothing: the last checkpoint and the ledger resume
    finally:
        compute.close()
    return params, stopped


@dataclass(frozen=True)
class LocalTensor:
    """A local tensor where :meth:`EngineCompute.apply_model` expects a received one."""

    tensor: torch.Tensor

    def torch(self) -> torch.Tensor:
        return self.tensor


def run(
    config: Any,
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
    out = Path(output or config.output.dir)
    loop = RunLoop(config, out, quiet=quiet, test_only_disable_noise=test_only_disable_noise)
    loop.start(mode)
    stopped = "interrupted"
    params = loop.setup.trainable
    try:
        if mode == "in-process":
            params, stopped = _run_in_process(loop)
        else:
            params, stopped = _run_coordinator(loop, spawn=(mode == "grpc"))
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
