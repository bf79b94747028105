"""The source papers' findings, reproduced with userdp's own strategies, samplers and accountants.

Claim reproduced here: the synthetic mean estimation of Charles et al., "Fine-Tuning Large
Language Models with User-Level Differential Privacy", §4 and Fig. 3.

* Data: μ ~ N(0, I_d), d = 32; N = 256 users, user means μ_u ~ N(μ, σ₁²I) with σ₁ = 1; K = 16
  points per user, x_{u,j} ~ N(μ_u, σ₂²I) (σ₂: the within-user spread).
* Task: minimize the square distance f(θ, x) = ½‖θ − x‖² from θ₀ = 0 for T = 256 steps at
  δ = 1e-6; the metric is the final squared error ‖θ_T − μ‖².
* Methods, at a per-step compute budget B (examples per step): ELS with G_ELS = K = 16 (every
  example of a user in D_sub) and p = B/(G_ELS·N); ULS with G_ULS ∈ {1, 2, 4, 8, 16}, expected
  cohort M = B/G_ULS, q = M/N, each sampled user's gradient the mean over G_ULS of its points
  drawn afresh each step.
* Each method runs through the production path: the config is bound by the strategy registry, σ
  is calibrated on the strategy's mechanism to (ε, δ) over T steps, and every step is the step
  contract (:func:`userdp.strategies.local_step.run_local_step`): sample, clip per unit, noise,
  normalize by the expected cohort, SGD update at the server learning rate.
* Tuning (the paper's "best setting"): a learning-rate × clip-norm grid; the cell with the lowest
  mean error over ``--tune-seeds`` seeds is picked, and the entry reported is that cell's error
  on ``--seeds`` other seeds (mean ± standard error). A seed fixes the data and the workers'
  example choices; the cohorts and the noise come from secret generators, as in a run.
* Sweeps (Fig. 3 a/b/c): ε at B = 64, σ₂ = 1; B at ε = 1, σ₂ = 1; σ₂ at ε = 1, B = 64.

The paper's findings to check: ULS with G = 1 is comparable to or better than ELS everywhere; a
larger G_ULS wins when σ₂ is large, when B is large, or when ε is small. The JSON, a markdown table
(mean ± standard error over seeds, the ELS anchor in the same run) and a plot with error bars are
written to ``--out`` (the table is also printed).

    .venv/bin/python benchmarks/papers.py --out benchmarks/results/cpu-2c-papers
    .venv/bin/python benchmarks/papers.py --quick --out /tmp/papers   # small grid, 1 seed
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from userdp.strategies.base import TaskSpec
from userdp.strategies.local_step import run_local_steps
from userdp.strategies.population import parse_example_unit_id
from userdp.strategies.unit_stats import UnitStats

from userdp.config import parse_config
from userdp.run.components import strategy_from_config

DIM, USERS, POINTS, STEPS, DELTA, SIGMA_1 = 32, 256, 16, 256, 1e-6, 1.0
ELS_GROUP = POINTS
ULS_GROUPS = (1, 2, 4, 8, 16)
DEFAULTS = {"epsilon": 1.0, "budget": 64, "sigma_2": 1.0}
SWEEPS = {
    "epsilon": (0.5, 1.0, 2.0, 4.0, 8.0),
    "budget": (16, 64, 256),
    "sigma_2": (0.25, 1.0, 4.0),
}
LEARNING_RATES = (0.01, 0.02, 0.05, 0.2, 1.0)
CLIP_NORMS = (1.0, 2.0, 4.0, 8.0)


@dataclass(frozen=True)
class Setting:
    epsilon: float
    budget: int
    sigma_2: float


@dataclass(frozen=True)
class Method:
    name: str  # "els" or "uls"
    group_size: int

    @property
    def label(self) -> str:
        return f"ELS G={self.group_size}" if self.name == "els" else f"ULS G={self.group_size}"

    def sampling_prob(self, budget: int) -> float:
        per_unit = self.group_size if self.name == "uls" else 1
        units = USERS * (ELS_GROUP if self.name == "els" else 1)
        return budget / per_unit / units


def methods(budget: int) -> list[Method]:
    """ELS, and ULS for every G whose cohort M = B/G is a positive number of users ≤ N."""
    uls = [Method("uls", g) for g in ULS_GROUPS if budget / g <= USERS and budget % g == 0]
    return [Method("els", ELS_GROUP), *uls]


def user_data(seed: int, sigma_2: float) -> tuple[np.ndarray, np.ndarray]:
    """(μ, points[N, K, d]) of the paper's generative model."""
    rng = np.random.default_rng(seed)
    mu = rng.standard_normal(DIM)
    user_means = mu + SIGMA_1 * rng.standard_normal((USERS, DIM))
    points = user_means[:, None, :] + sigma_2 * rng.standard_normal((USERS, POINTS, DIM))
    return mu, points


def user_ids() -> list[str]:
    return [f"user-{u:03d}" for u in range(USERS)]


def make_compute(points: np.ndarray, seed: int):
    """One worker of the in-process step: each unit's gradient of ½‖θ − x‖² at θ (a user's mean
    over G fresh points, or one example of D_sub), clipped to the task's C, summed."""
    rng = np.random.default_rng(seed)
    index = {user: u for u, user in enumerate(user_ids())}

    def compute(
        task: TaskSpec, unit_ids: Sequence[str], params: Mapping[str, Any]
    ) -> tuple[dict[str, Any], UnitStats]:
        theta = np.asarray(params["theta"])
        if task.unit == "example":
            pairs = [parse_example_unit_id(unit) for unit in unit_ids]
            targets = np.stack([points[index[user], j] for user, j in pairs])
        else:
            rows = np.array([index[user] for user in unit_ids])
            chosen = np.argsort(rng.random((len(rows), POINTS)), axis=1)[:, : task.group_size]
            targets = points[rows[:, None], chosen].mean(axis=1)
        grads = theta[None, :] - targets
        norms = np.linalg.norm(grads, axis=1)
        scale = np.minimum(1.0, task.clip_norm / np.maximum(norms, 1e-300))
        stats = UnitStats(
            count=len(norms),
            clipped=int(np.sum(norms > task.clip_norm)),
            norm_min=float(norms.min()) if len(norms) else 0.0,
            norm_max=float(norms.max()) if len(norms) else 0.0,
            norm_sum=float(norms.sum()),
            norm_sum_sq=float(np.sum(norms**2)),
        )
        return {"theta": (grads * scale[:, None]).sum(axis=0)}, stats

    return compute


def config_for(setting: Setting, method: Method, lr: float, clip: float) -> Any:
    return parse_config(
        {
            "strategy": {
                "name": method.name,
                "sampling_prob": method.sampling_prob(setting.budget),
                "group_size": method.group_size,
                "clip_norm": clip,
                "steps": STEPS,
                "server_optimizer": "sgd",
                "server_lr": lr,
            },
            "privacy": {"epsilon": setting.epsilon, "delta": DELTA, "secure_noise": False},
        }
    )


def population(method: Method) -> Any:
    users = user_ids()
    return {user: POINTS for user in users} if method.name == "els" else users


def run_once(setting: Setting, method: Method, lr: float, clip: float, seed: int) -> dict:
    """Final ‖θ_T − μ‖² of one run, and the run's σ."""
    mu, points = user_data(seed, setting.sigma_2)
    strategy, _, _ = strategy_from_config(config_for(setting, method, lr, clip), USERS)
    params = {"theta": np.zeros(DIM)}
    run_local_steps(
        strategy, params, population(method), make_compute(points, seed + 1), STEPS, workers=1
    )
    return {
        "error": float(np.sum((params["theta"] - mu) ** 2)),
        "noise_multiplier": strategy.noise_multiplier,
    }


def errors_of(setting: Setting, method: Method, lr: float, clip: float, seeds) -> dict:
    runs = [run_once(setting, method, lr, clip, seed) for seed in seeds]
    errors = np.array([r["error"] for r in runs])
    return {
        "mean": float(errors.mean()),
        "stderr": float(errors.std(ddof=1) / math.sqrt(len(errors))) if len(errors) > 1 else 0.0,
        "errors": errors.tolist(),
        "noise_multiplier": runs[0]["noise_multiplier"],
    }


def best_cell(setting: Setting, method: Method, tune_seeds, eval_seeds, grid) -> dict:
    """The learning-rate × clip cell with the lowest mean error over ``tune_seeds``, measured
    again on the disjoint ``eval_seeds`` (the reported figure: no winner's curse)."""
    tuned = [
        (errors_of(setting, method, lr, clip, tune_seeds)["mean"], lr, clip) for lr, clip in grid
    ]
    _, lr, clip = min(tuned)
    return {
        "learning_rate": lr,
        "clip_norm": clip,
        **errors_of(setting, method, lr, clip, eval_seeds),
    }


def sweep_settings(quick: bool) -> list[tuple[str, float, Setting]]:
    out = []
    for axis, values in SWEEPS.items():
        if quick:
            values = values[:: max(1, len(values) - 1)]
        for value in values:
            out.append((axis, value, Setting(**{**DEFAULTS, axis: value})))
    return out


def findings(rows: list[dict]) -> list[dict]:
    """The paper's qualitative findings, judged on this run's rows."""
    by_setting: dict[tuple[str, float], dict[str, dict]] = {}
    for row in rows:
        by_setting.setdefault((row["axis"], row["value"]), {})[row["method"]] = row
    checks = []
    for (axis, value), entries in sorted(by_setting.items()):
        els, uls1 = entries["ELS G=16"], entries.get("ULS G=1")
        best = min((r for k, r in entries.items() if k.startswith("ULS")), key=lambda r: r["mean"])
        tie = math.hypot(els["stderr"], uls1["stderr"]) * 2 if uls1 else 0.0
        checks.append(
            {
                "axis": axis,
                "value": value,
                "uls1_vs_els": None if uls1 is None else uls1["mean"] / els["mean"],
                "uls1_comparable_or_better": None
                if uls1 is None
                else uls1["mean"] <= els["mean"] + tie,
                "best_uls_group": int(best["method"].split("=")[1]),
                "best_uls_vs_els": best["mean"] / els["mean"],
            }
        )
    return checks


def markdown(record: dict) -> str:
    setup = record["setup"]
    lines = [
        f"# {record['claim']}",
        "",
        f"- Machine: {record['machine']}; {record['seconds']:.0f} s for the whole sweep.",
        f"- d = {setup['d']}, N = {setup['N']}, K = {setup['K']}, T = {setup['T']}, "
        f"δ = {setup['delta']:g}, σ₁ = {setup['sigma_1']:g}; defaults {setup['defaults']}.",
        f"- Best lr × C cell picked on {len(setup['tune_seeds'])} tuning seeds over "
        f"{len(setup['grid'])} cells; the figures are that cell on {len(setup['eval_seeds'])} other "
        "seeds (mean ± standard error). σ is calibrated by userdp's accountant for each method.",
        "- Anchor: ELS (G = 16) in the same run; `vs ELS` < 1 means lower error than ELS.",
        "",
        "| sweep | value | method | best lr | best C | σ | ‖θ_T − μ‖² (mean ± s.e.) | vs ELS |",
        "|---|---|---|---|---|---|---|---|",
    ]
    rows = record["rows"]
    for row in rows:
        els = next(
            r
            for r in rows
            if r["axis"] == row["axis"] and r["value"] == row["value"] and r["method"] == "ELS G=16"
        )
        lines.append(
            f"| {row['axis']} | {row['value']:g} | {row['method']} | {row['learning_rate']:g} | "
            f"{row['clip_norm']:g} | {row['noise_multiplier']:.4g} | {row['mean']:.4g} ± "
            f"{row['stderr']:.2g} | {row['mean'] / els['mean']:.3f} |"
        )
    lines += [
        "",
        "| sweep | value | ULS G=1 / ELS | ULS G=1 ≤ ELS (2 s.e.) | best G_ULS | best ULS / ELS |",
    ]
    lines.append("|---|---|---|---|---|---|")
    for check in record["findings"]:
        ratio = check["uls1_vs_els"]
        lines.append(
            f"| {check['axis']} | {check['value']:g} | "
            + ("—" if ratio is None else f"{ratio:.3f}")
            + f" | {check['uls1_comparable_or_better']} | {check['best_uls_group']} | "
            f"{check['best_uls_vs_els']:.3f} |"
        )
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_names = list(SWEEPS)
    fig, axes = plt.subplots(1, len(axes_names), figsize=(5 * len(axes_names), 4))
    for ax, axis in zip(axes, axes_names, strict=True):
        rows = [r for r in record["rows"] if r["axis"] == axis]
        labels = {r["method"] for r in rows}
        for method in sorted(labels, key=lambda m: (m[:3], int(m.split("=")[1]))):
            mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["value"])
            ax.errorbar(
                [r["value"] for r in mine],
                [r["mean"] for r in mine],
                yerr=[r["stderr"] for r in mine],
                marker="o",
                capsize=3,
                label=method,
                linestyle="--" if method.startswith("ELS") else "-",
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel({"epsilon": "ε", "budget": "compute budget B", "sigma_2": "σ₂"}[axis])
        ax.set_ylabel("final ‖θ_T − μ‖²")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Mean estimation (Charles et al. §4): best of the lr × C grid, mean ± s.e.")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10, help="evaluation seeds per entry")
    parser.add_argument("--tune-seeds", type=int, default=5, help="seeds that pick the lr × C cell")
    parser.add_argument("--quick", action="store_true", help="end points of each sweep, 1 seed")
    parser.add_argument("--out", type=Path, required=True, help="prefix of .json/.md/.png")
    parser.add_argument(
        "--render", action="store_true", help="rewrite .md and .png from the existing .json"
    )
    args = parser.parse_args()
    if args.render:
        record = json.loads(Path(f"{args.out}.json").read_text())
        Path(f"{args.out}.md").write_text(markdown(record) + "\n")
        plot(record, Path(f"{args.out}.png"))
        return
    tune_seeds = list(range(1 if args.quick else args.tune_seeds))
    eval_seeds = list(range(1000, 1000 + (1 if args.quick else args.seeds)))
    grid = [(lr, clip) for lr in LEARNING_RATES for clip in CLIP_NORMS]
    if args.quick:
        grid = [(0.2, 2.0), (0.2, 8.0)]
    start = time.perf_counter()
    rows, done = [], {}
    for axis, value, setting in sweep_settings(args.quick):
        for method in methods(setting.budget):
            key = (setting, method)
            if key not in done:  # the default setting is a point of every sweep: run it once
                done[key] = best_cell(setting, method, tune_seeds, eval_seeds, grid)
            rows.append({"axis": axis, "value": value, "method": method.label, **done[key]})
    record = {
        "claim": "Charles et al., Fine-Tuning LLMs with User-Level DP, §4 (synthetic mean estimation)",
        "machine": platform.platform(),
        "setup": {
            "d": DIM,
            "N": USERS,
            "K": POINTS,
            "T": STEPS,
            "delta": DELTA,
            "sigma_1": SIGMA_1,
            "defaults": DEFAULTS,
            "tune_seeds": tune_seeds,
            "eval_seeds": eval_seeds,
            "grid": grid,
        },
        "rows": rows,
        "seconds": time.perf_counter() - start,
    }
    record["findings"] = findings(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(record, indent=1) + "\n")
    table = markdown(record)
    Path(f"{args.out}.md").write_text(table + "\n")
    plot(record, Path(f"{args.out}.png"))
    print(json.dumps({k: record[k] for k in ("claim", "findings", "seconds")}, indent=1))
    print(table)


if __name__ == "__main__":
    main()
