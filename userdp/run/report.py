"""The run folder's privacy report and plots, rendered from what the run wrote (ledger.jsonl,
metrics.jsonl, strategy_facts.json, samples.jsonl, config.toml): ``userdp report RUN`` re-renders
them without loading a model."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from userdp.accounting.durable import atomic_write_text
from userdp.accounting.report import build_report, public_model_selection_caveat
from userdp.clients.selection import PERPLEXITY_SELECTIONS
from userdp.clients.shard_format import read_manifest
from userdp.config import Config

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
    reference = next(
        (r["token_frequency_loss"] for r in evals if "token_frequency_loss" in r), None
    )
    final_loss = final["eval_loss"] if final else None
    data["evaluation"] = {
        "held_out_users": final.get("users") if final else None,
        "baseline_eval_loss": baseline["eval_loss"] if baseline else None,
        "final_eval_loss": final_loss,
        "final_step": final["step"] if final else None,
        "token_frequency_loss": reference,
        "beats_token_frequencies": beats(final_loss, reference),
        "strategy": config.strategy.name,
    }
    data["target_epsilon"] = config.privacy.epsilon
    data["data_plane"] = data_plane_facts(facts.get("data_plane"))
    markdown = report.to_markdown()
    if final:
        markdown += (
            "\n## Held-out evaluation (user-level split)\n\n| | eval loss |\n|---|---|\n"
            f"| no fine-tuning (0 steps) | {_fmt(data['evaluation']['baseline_eval_loss'])} |\n"
            f"| after {final['step']} steps | {_fmt(final_loss)} |\n"
        )
        if reference is not None:
            markdown += (
                f"| reference: the held-out users' own token frequencies | {_fmt(reference)} |\n"
                f"\n{learning_verdict(final_loss, reference, final['step'])}\n"
            )
    if data["data_plane"] is not None:
        plane = data["data_plane"]
        markdown += f"\n## Data plane: {plane['name']}\n\n{plane['trust_boundary']}\n"
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
    atomic_write_text(run_dir / "privacy_report.json", json.dumps(data, indent=2, sort_keys=True))
    atomic_write_text(run_dir / "privacy_report.md", markdown)
    return data


def beats(final_loss: float | None, reference: float | None) -> bool | None:
    """Whether the final held-out loss is below the token-frequency reference (None: unknown)."""
    if final_loss is None or reference is None:
        return None
    return final_loss < reference  # a NaN loss beats nothing


def learning_verdict(final_loss: float | None, reference: float, step: int) -> str:
    """One plain sentence: did the model learn more than token frequencies?"""
    if beats(final_loss, reference):
        return (
            f"After {step} steps the model predicts the held-out users' text better than their "
            f"own token frequencies do ({_fmt(final_loss)} < {_fmt(reference)} nats per token): "
            "it uses context."
        )
    return (
        f"**The model did not learn beyond token frequencies**: after {step} steps its held-out "
        f"loss ({_fmt(final_loss)}) is not below the {_fmt(reference)} nats per token of a model "
        "that knows only the held-out users' own token frequencies, so its samples will be "
        "frequent tokens (spaces, common bytes). More steps, a larger strategy.server_lr or "
        "more users per step (strategy.sampling_prob, hence less noise per user) help; the "
        "privacy guarantee above holds either way."
    )


DATA_PLANES = {
    "in-process": (
        "in-process",
        "The coordinator's role and the worker compute ran in one process: no clipped sum left "
        "it, and the released model versions are what the guarantee covers.",
    ),
    "grpc": (
        "gRPC",
        "Each worker streamed its clipped sums to the coordinator over the gRPC channel "
        "(encrypted and authenticated with mTLS or a token when coordinator.tls_dir or "
        "auth_token_file is set); the coordinator summed them in float64, re-checked each "
        "task's sum against count x C before adding noise, and alone saw un-noised sums.",
    ),
    "collective": (
        "collective (gloo)",
        "The workers reduced their clipped sums among themselves over a torch.distributed gloo "
        "group: each member saw un-noised partial sums of other members' contributions (about "
        "1/(W + 1) of the coordinates of the cohort's sum); the coordinator checked the reduced "
        "total against the cohort's count x C and each worker's share (the norm the worker "
        "reported for its sum) against its own units' count x C before adding noise. gloo "
        "traffic and the rendezvous store are neither encrypted nor authenticated: the "
        "guarantee assumes the workers and the coordinator ran on a network only they reach "
        "(docs/privacy.md, 'Trust boundary of the collective data plane').",
    ),
}
"""The report's name and trust boundary of each data plane a run's sums can travel."""


def data_plane_facts(plane: str | None) -> dict[str, str] | None:
    """The report's ``data_plane`` entry (None for a run folder that did not record it)."""
    if plane is None:
        return None
    name, boundary = DATA_PLANES[plane]
    return {"plane": plane, "name": name, "trust_boundary": boundary}


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


HELD_OUT_CAVEAT = (
    "Prompts taken from held-out users are their text verbatim, and those users are not covered "
    "by ε (they never contribute to training): keep samples.jsonl inside the trust boundary, or "
    "set output.sample_prompts to public prompts."
)


def samples_appendix(rows: Sequence[dict[str, Any]]) -> str:
    """The report's appendix (markdown) for ``rows``. Continuations of configured prompts are
    shown; those of held-out users' prompts are only counted (their prompts are private text:
    they stay in ``samples.jsonl``), so the report stays publishable."""
    if not rows:
        return ""
    lines = ["", "## Appendix: generation samples", ""]
    held_out = [row for row in rows if row["source"].startswith("held-out user")]
    if held_out:
        lines += [
            f"{len(held_out)} continuation(s) of held-out users' first tokens are in "
            f"samples.jsonl, not here. {HELD_OUT_CAVEAT}",
            "",
        ]
    for row in rows:
        if row in held_out:
            continue
        lines += [
            f"- {row['source']} (greedy):",
            f"  - prompt: `{_inline(row['prompt'])}`",
            f"  - continuation: `{_inline(row['continuation'])}`",
        ]
    return "\n".join(lines) + "\n"


def _inline(text: str) -> str:
    return text.replace("`", "'").replace("\n", "\\n")
