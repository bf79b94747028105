"""Experiment tracking, as Hugging Face Trainer's ``report_to``: ``[output] report_to =
["tensorboard", "mlflow", "wandb"]`` (default none).

Each backend is an optional extra, imported only when named; a named backend whose package is
missing is a one-line error naming the extra (:func:`missing_backends`), from ``userdp config
check`` and when ``simulate``/``train`` start. ``userdp coordinator`` (deployments) does not
track: use the run folder's metrics.jsonl there. Every backend receives the same scalars as ``metrics.jsonl`` (step rows: loss, ε spent,
cohort size, clip fraction, tokens/s; eval rows: eval loss) and, at the end, the privacy report.
Like the metrics, these are NOT privatized (the report says so).

Where each writes, inside the run folder unless the backend's own environment says otherwise:

* ``tensorboard``: event files in ``RUN/tensorboard/``;
* ``mlflow``: ``$MLFLOW_TRACKING_URI`` if set, else a SQLite store ``RUN/mlflow/mlflow.db`` with
  artifacts in ``RUN/mlflow/artifacts`` (MLflow's file store is in maintenance mode), experiment
  ``userdp``, one MLflow run per invocation (a resumed run starts another, named after the folder);
* ``wandb``: offline (``$WANDB_MODE`` overrides), files in ``RUN/wandb/``.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

BACKENDS: dict[str, tuple[str, str]] = {
    # name -> (module that must be importable, the userdp extra that installs it)
    "tensorboard": ("tensorboard", "tracking"),
    "mlflow": ("mlflow", "tracking"),
    "wandb": ("wandb", "wandb"),
}
STEP_SCALARS = ("loss", "epsilon", "cohort_size", "clip_fraction", "tokens_per_s", "step_time_s")


def missing_backends(names: Iterable[str]) -> list[str]:
    """One message per named backend whose package is not installed."""
    problems = []
    for name in names:
        module, extra = BACKENDS[name]
        if importlib.util.find_spec(module) is None:
            problems.append(f"{name!r} needs the {module} package: pip install 'userdp[{extra}]'")
    return problems


def _scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The numeric, finite values of a metrics row, under their metrics.jsonl names."""
    keys = STEP_SCALARS if row.get("kind") == "step" else ("eval_loss",)
    out = {}
    for key in keys:
        value = row.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            out[key] = float(value)
    return out


class _TensorBoard:
    def __init__(self, run_dir: Path, run_config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.writer.add_text("config", f"```\n{run_config}\n```")

    def log(self, step: int, scalars: Mapping[str, float], kind: str) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(f"{kind}/{key}", value, step)

    def finish(self, report: Mapping[str, Any], report_md: Path | None) -> None:
        for key in ("epsilon", "delta", "steps"):
            if isinstance(report.get(key), int | float):
                self.writer.add_scalar(f"privacy/{key}", report[key], int(report.get("steps", 0)))
        if report_md is not None:
            self.writer.add_text("privacy_report", report_md.read_text())
        self.writer.close()


class _MLflow:
    def __init__(self, run_dir: Path, run_config: Mapping[str, Any]) -> None:
        import mlflow

        self.mlflow = mlflow
        store = run_dir / "mlflow"
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            store.mkdir(parents=True, exist_ok=True)
            mlflow.set_tracking_uri(f"sqlite:///{(store / 'mlflow.db').resolve()}")
        client = mlflow.tracking.MlflowClient()
        experiment = client.get_experiment_by_name("userdp")
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else client.create_experiment(
                "userdp", artifact_location=(store / "artifacts").resolve().as_uri()
            )
        )
        self.run = mlflow.start_run(experiment_id=experiment_id, run_name=run_dir.resolve().name)
        flat = {
            f"{section}.{k}": v for section, values in run_config.items() for k, v in values.items()
        }
        mlflow.log_params({k: str(v)[:500] for k, v in flat.items()})

    def log(self, step: int, scalars: Mapping[str, float], kind: str) -> None:
        self.mlflow.log_metrics({f"{kind}/{k}": v for k, v in scalars.items()}, step=step)

    def finish(self, report: Mapping[str, Any], report_md: Path | None) -> None:
        self.mlflow.log_dict(dict(report), "privacy_report.json")
        if report_md is not None:
            self.mlflow.log_artifact(str(report_md))
        self.mlflow.end_run()


class _WandB:
    def __init__(self, run_dir: Path, run_config: Mapping[str, Any]) -> None:
        import wandb

        self.run = wandb.init(
            mode=os.environ.get("WANDB_MODE", "offline"),
            dir=str(run_dir),
            project=os.environ.get("WANDB_PROJECT", "userdp"),
            name=run_dir.resolve().name,
            config=dict(run_config),
        )

    def log(self, step: int, scalars: Mapping[str, float], kind: str) -> None:
        self.run.log({f"{kind}/{k}": v for k, v in scalars.items()}, step=step)

    def finish(self, report: Mapping[str, Any], report_md: Path | None) -> None:
        for key in ("epsilon", "delta", "steps"):
            if key in report:
                self.run.summary[f"privacy/{key}"] = report[key]
        self.run.finish()


_CLASSES = {"tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _WandB}


class Trackers:
    """The backends of ``output.report_to`` for one run (none: every call is a no-op)."""

    def __init__(self, names: Iterable[str], run_dir: Path, run_config: Mapping[str, Any]) -> None:
        names = list(names)
        problems = missing_backends(names)
        if problems:
            raise ValueError("output.report_to: " + "; ".join(problems))
        self.backends = [_CLASSES[name](Path(run_dir), run_config) for name in names]

    def log_row(self, row: Mapping[str, Any]) -> None:
        """One metrics.jsonl row (a step or an evaluation)."""
        if not self.backends:
            return
        scalars = _scalars(row)
        if not scalars:
            return
        kind = "train" if row.get("kind") == "step" else "eval"
        for backend in self.backends:  # an eval row's step counts the updates it has seen
            backend.log(int(row["step"]), scalars, kind)

    def finish(self, report: Mapping[str, Any] | None, report_md: Path | None) -> None:
        for backend in self.backends:
            backend.finish(report or {}, report_md if report_md and report_md.is_file() else None)
        self.backends = []
