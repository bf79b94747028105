"""What a run leaves in its folder, and how ``userdp report`` re-renders it.

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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from userdp.accounting.durable import atomic_write_text
from userdp.accounting.ledger import ledger_state, read_ledger
from userdp.accounting.report import build_report, public_model_selection_caveat
from userdp.clients.model import load_parameters
from userdp.clients.selection import PERPLEXITY_SELECTIONS
from userdp.clients.shard_format import read_manifest

from userdp.config import Config
from userdp.run.components import RunSetup
from userdp.run.export import export_model
from userdp.run.samples import samples_appendix

METRICS_CAVEAT = (
    "metrics.jsonl and plots/ hold statistics of the TRAINING users computed without noise "
    "(realized cohort sizes, sampled users' training loss, clip fractions): they are NOT covered "
    "by ε. Share the model and this report; keep the metrics and plots inside the trust boundary."
)
EVAL_CAVEAT = (
    "Evaluation losses are computed on held-out users and published without noise: those users "
    "are not covered by ε (they never contribute to training)."
)


TRAINED_TOKENIZER_CAVEAT = (
    "The tokenizer (userdp shard --tokenizer bpe:N) was trained on the users' raw text, without "
    "noise, and is exported with the model (model/tokenizer.json): its vocabulary is not covered "
    "by ε. Use a public tokenizer (--tokenizer DIR) to publish the model."
)


def _tokenizer_kind(config: Config) -> str | None:
    """The shards' tokenizer kind (``byte``, ``bpe``, ``transformers``, ``tokenizers``)."""
    try:
        return read_manifest(config.data.shards).tokenizer.kind if config.data.shards else None
    except (OSError, ValueError):
        return None


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


def read_metrics(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{number} is not JSON (a truncated write?)") from None
    return rows


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


def write_facts(strategy_facts: Any, run_dir: Path, training_users: int | None = None) -> None:
    """The strategy's own caveats and N (training users), kept so ``userdp report`` can
    re-render without the run."""
    facts = {**strategy_facts.to_dict(), "training_users": training_users}
    _atomic_write_text(run_dir / "strategy_facts.json", json.dumps(facts))


def clipping_summary(steps: list[Mapping[str, Any]], clip_norm: float) -> str | None:
    """One neutral paragraph on the per-step clip fractions (not privatized, like the metrics)."""
    fractions = [r["clip_fraction"] for r in steps if r.get("clip_fraction") is not None]
    if not fractions:
        return None
    mean, low, high = sum(fractions) / len(fractions), min(fractions), max(fractions)
    text = (
        f"Over {len(fractions)} steps, {mean:.0%} of the sampled units had an update norm above "
        f"C = {clip_norm:g} and were scaled down to it (per step: {low:.0%} to {high:.0%})."
    )
    if low == 1.0:
        text += (
            " Every unit was clipped in every step: each contributed a direction of norm C, "
            "whatever its size. The noise is calibrated to C, so the guarantee is unaffected; "
            "a larger C would keep more of the updates' relative sizes."
        )
    elif high == 0.0:
        text += (
            " No unit was clipped: C is above every update norm seen, so the noise "
            "(proportional to C) is larger than the updates needed; a smaller C would add less."
        )
    return text


def render_report(run_dir: Path, config: Config, delta: float) -> dict:
    """Recompute the privacy report from ``ledger.jsonl`` and add the held-out evaluation from
    ``metrics.jsonl``; write ``privacy_report.{json,md}``. Returns the report dict."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in rows if r.get("kind") == "step"]
    evals = [r for r in rows if r.get("kind") == "eval"]
    facts_path = run_dir / "strategy_facts.json"
    facts = json.loads(facts_path.read_text()) if facts_path.is_file() else {}
    caveats = list(facts.get("caveats", [])) + [METRICS_CAVEAT, EVAL_CAVEAT]
    training_users = facts.get("training_users")
    if _tokenizer_kind(config) == "bpe":
        caveats.append(TRAINED_TOKENIZER_CAVEAT)
    if config.data.selection in PERPLEXITY_SELECTIONS:
        caveats.append(public_model_selection_caveat(config.data.selection))
    expected = steps[-1]["expected_cohort_size"] if steps else None
    report = build_report(
        run_dir / "ledger.jsonl",
        delta,
        unit="user",
        sampling=facts.get("sampling", config.strategy.sampling),  # what the sampler ran
        clip_norm=config.strategy.clip_norm,
        expected_cohort_size=expected,
        curve_points=10,
        extra_caveats=tuple(caveats),
        training_users=training_users,
        secure_noise=facts.get("secure_noise"),
    )
    data = report.to_dict()
    baseline = next((r for r in evals if r["step"] == 0), None)
    final = evals[-1] if evals else None
    data["evaluation"] = {
        "held_out_users": final.get("users") if final else None,
        "baseline_eval_loss": baseline["eval_loss"] if baseline else None,
        "final_eval_loss": final["eval_loss"] if final else None,
        "final_step": final["step"] if final else None,
        "strategy": config.strategy.name,
    }
    data["target_epsilon"] = config.privacy.epsilon
    markdown = report.to_markdown()
    if final:
        markdown += (
            "\n## Held-out evaluation (user-level split)\n\n| | eval loss |\n|---|---|\n"
            f"| no fine-tuning (0 steps) | {_fmt(data['evaluation']['baseline_eval_loss'])} |\n"
            f"| after {final['step']} steps | {_fmt(final['eval_loss'])} |\n"
        )
    clipping = clipping_summary(steps, config.strategy.clip_norm)
    if clipping:
        data["clipping_summary"] = clipping
        markdown += f"\n## Clipping (training metrics, not covered by ε)\n\n{clipping}\n"
    data["initial_model_seed"] = config.output.seed
    markdown += f"\n## Initial model\n\n{initial_model_note(config.output.seed)}\n"
    samples_path = run_dir / "samples.jsonl"
    if samples_path.is_file():
        rows = [json.loads(line) for line in samples_path.read_text().splitlines() if line]
        markdown += samples_appendix(rows)
    _atomic_write_text(run_dir / "privacy_report.json", json.dumps(data, indent=2, sort_keys=True))
    _atomic_write_text(run_dir / "privacy_report.md", markdown)
    return data


def initial_model_note(seed: int | None) -> str:
    """What ``output.seed`` means for comparing this run with another (report and ``simulate``)."""
    if seed is not None:
        return (
            f"Initialized with output.seed = {seed}: a run with the same seed and model section "
            "starts from the same weights (a preset's, or the LoRA adapters' on model.path)."
        )
    return (
        "output.seed is not set: the initial weights (a preset's, or the LoRA adapters' on "
        "model.path) are random, so a run compared with this one (ULS vs ELS, another clip "
        "norm) also starts from another model; set output.seed to the same value in both."
    )


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.4f}"


# ---- plots -------------------------------------------------------------------------------------


def render_plots(run_dir: Path) -> list[Path]:
    """PNG plots from ``metrics.jsonl``: loss, ε by step, clip fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(run_dir / "metrics.jsonl")
    steps = [r for r in rows if r.get("kind") == "step"]
    evals = [r for r in rows if r.get("kind") == "eval" and r.get("eval_loss") is not None]
    out = run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    written = []

    def save(fig: Any, name: str) -> None:
        path = out / name
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)

    # metrics' "step" is the 0-based index of a released step, an eval row's the number of steps
    # done before it: the plots put both on "steps done" (step index + 1 for step rows)
    def done(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
        return [(r["step"] + 1, r[key]) for r in rows if r.get(key) is not None]

    def finish(ax: Any, title: str, ylabel: str) -> None:
        ax.set_xlabel("steps done")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        if ax.get_legend_handles_labels()[0]:  # nothing to label before the first step
            ax.legend()

    fig, ax = plt.subplots(figsize=(6.4, 4))
    train = done(steps, "loss")
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss (sampled users)", alpha=0.6)
    if evals:
        ax.plot(
            [r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="held-out loss"
        )
        base = next((r["eval_loss"] for r in evals if r["step"] == 0), None)
        if base is not None:
            ax.axhline(base, color="gray", linestyle="--", label="no fine-tuning")
    finish(ax, "Loss", "mean token cross-entropy")
    save(fig, "loss.png")

    fig, ax = plt.subplots(figsize=(6.4, 4))
    eps = done(steps, "epsilon")
    if eps:
        ax.plot(*zip(*eps, strict=True), "-", label="ε spent (from the ledger)")
    if steps and steps[-1].get("target_epsilon"):
        ax.axhline(steps[-1]["target_epsilon"], color="red", linestyle="--", label="budget")
    finish(ax, "Privacy spent", "ε")
    save(fig, "epsilon.png")

    fig, ax = plt.subplots(figsize=(6.4, 4))
    frac = done(steps, "clip_fraction")
    if frac:
        ax.plot(*zip(*frac, strict=True), "-")
    ax.set_ylim(-0.02, 1.02)
    finish(ax, "Clip fraction", "fraction of units clipped")
    save(fig, "clip_fraction.png")
    return written
