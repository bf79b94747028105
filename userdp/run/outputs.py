"""What a run leaves in its folder (``userdp report`` re-renders the report and plots from it:
:mod:`userdp.run.report`).

::

    RUN_DIR/
      config.toml            the config as run (data.shards resolved, σ as calibrated)
      ledger.jsonl           fsync'd privacy ledger (the source of truth for ε)
      metrics.jsonl          one JSON object per step (+ "eval" rows)
      privacy_report.json    ε(δ) recomputed from the ledger, mechanism, assumptions, caveats,
      privacy_report.md        and the held-out evaluation
      plots/*.png            loss (train, held-out, no-fine-tuning baseline), ε by step, clip fraction
      model/                 safetensors weights + config.json (transformers format), and
                             userdp_release.json: the ledger state and ε the weights match
      checkpoints/           resumable coordinator state
"""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from userdp.accounting.durable import atomic_write_text
from userdp.accounting.ledger import ledger_state, read_ledger
from userdp.clients.model import load_parameters
from userdp.config import Config
from userdp.run.components import RunSetup
from userdp.run.export import export_model


def _atomic_write_text(path: Path, text: str) -> None:
    """A run output that replaces its previous version durably (:func:`atomic_write_text`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, text)


# ---- config.toml -------------------------------------------------------------------------------


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string for everything json escapes
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")


def _toml_table(name: str, values: Mapping[str, Any]) -> list[str]:
    """``[name]`` with its keys, then one sub-table per dict value (``[strategy.params]``)."""
    lines = [f"[{name}]"]
    lines += [
        f"{json.dumps(key) if not key.isidentifier() else key} = {_toml_value(v)}"
        for key, v in values.items()
        if v is not None and not isinstance(v, Mapping)
    ]
    lines.append("")
    for key, v in values.items():
        if isinstance(v, Mapping) and v:
            lines += _toml_table(f"{name}.{key}", v)
    return lines


def config_toml(config: Config) -> str:
    """The config as TOML (keys with value None are left out: None means 'the default')."""
    lines: list[str] = []
    for section, values in config.model_dump().items():
        lines += _toml_table(section, values)
    return "\n".join(lines)


RESUME_SECTIONS = ("data", "model", "strategy", "privacy")
"""The config sections a resumed run must share with the run it continues."""


def resume_conflicts(run_dir: Path, config: Config, given: Config) -> list[str]:
    """The keys of ``RESUME_SECTIONS`` on which ``config`` (as it would be run) differs from the
    run already in ``run_dir`` (its ``config.toml``, once its ledger file is written: the header
    alone counts, the run has begun): a run resumed under another config would continue one
    mechanism with another and report the old result.
    σ and δ count only when ``given`` (the user's config) sets them: derived, they follow from
    the rest."""
    previous, ledger = run_dir / "config.toml", run_dir / "ledger.jsonl"
    if not previous.is_file() or not ledger.is_file() or ledger.stat().st_size == 0:
        return []
    old = tomllib.loads(previous.read_text(encoding="utf-8"))
    new = tomllib.loads(config_toml(config))
    derived = {
        f"privacy.{key}"
        for key in ("noise_multiplier", "delta")
        if getattr(given.privacy, key) is None
    }
    conflicts = []
    for section in RESUME_SECTIONS:
        before, after = old.get(section, {}), new.get(section, {})
        for key in sorted(set(before) | set(after)):
            name = f"{section}.{key}"
            if name not in derived and before.get(key) != after.get(key):
                conflicts.append(f"{name} {before.get(key)!r} -> {after.get(key)!r}")
    return conflicts


def write_config(config: Config, run_dir: Path) -> Path:
    path = run_dir / "config.toml"
    _atomic_write_text(path, config_toml(config))
    return path


# ---- metrics -----------------------------------------------------------------------------------


class MetricsLog:
    """Append-only ``metrics.jsonl`` (a resumed run appends to it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, row: Mapping[str, Any]) -> None:
        clean = {
            k: (None if isinstance(v, float) and not math.isfinite(v) else v)
            for k, v in row.items()
        }
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(clean, sort_keys=True) + "\n")
            f.flush()


# ---- report ------------------------------------------------------------------------------------


RELEASE_STATE = "userdp_release.json"


def export_release(model: Any, params: Any, run_dir: Path, setup: RunSetup, epsilon: Any) -> Path:
    """The trained weights ``params`` loaded into ``model`` and exported to ``RUN/model`` with
    their release state (:func:`write_release_state` at ε, the setup's δ); returns the folder."""
    load_parameters(model, params)
    model_dir = export_model(model, run_dir, setup.manifest.tokenizer, setup.shard_dir)
    write_release_state(model_dir, run_dir / "ledger.jsonl", epsilon, setup.delta)
    return model_dir


def write_release_state(model_dir: Path, ledger_path: Path, epsilon: Any, delta: float) -> Path:
    """``model/userdp_release.json``: the ledger state (step count, last record hash) and ε, δ
    of the exported weights, so a reader can tell exported weights from a ledger that moved on
    (``userdp ledger verify`` compares them)."""
    header, records = read_ledger(ledger_path)
    state = {"ledger": ledger_state(records, header), "epsilon": epsilon, "delta": delta}
    path = model_dir / RELEASE_STATE
    _atomic_write_text(path, json.dumps(state, indent=2, sort_keys=True) + "\n")
    return path


def write_facts(
    strategy_facts: Any,
    run_dir: Path,
    training_users: int | None = None,
    data_plane: str | None = None,
) -> None:
    """The strategy's own caveats, N (training users) and the data plane its sums travelled
    (``in-process``, ``grpc``, ``collective``), kept so ``userdp report`` can re-render without
    the run."""
    facts = {
        **strategy_facts.to_dict(),
        "training_users": training_users,
        "data_plane": data_plane,
    }
    _atomic_write_text(run_dir / "strategy_facts.json", json.dumps(facts))


# ---- plots -------------------------------------------------------------------------------------
