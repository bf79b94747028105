"""The language-model finding of Charles et al., "Fine-Tuning Large Language Models with
User-Level Differential Privacy" (§5): at matched ε and compute budget, ULS beats ELS at strict
privacy (ε ≈ 1), on real user-partitioned data.

* Data: the fortunes corpus (docs/data.md; ``userdp shard --fortunes``): quotations by author,
  3,782 authors with a heavy tail (median 1 quotation, maximum 112), byte tokens, sequences of
  64. Its ``public`` split (unattributed quotations) pre-trains the model without privacy; the
  ``private`` split is fine-tuned with user-level DP, 10 % of its users held out for evaluation.
* Model: the ``gpt2-tiny`` preset (2 layers, width 64), pre-trained for ``--pretrain-steps``
  AdamW steps on the public split, then saved with ``save_pretrained``. ``--gpu``: GPT-2 small
  (12 layers, width 768) pre-trained and fine-tuned on one CUDA device (``workers.device``).
* Methods, at B examples per step in expectation: ULS with G = 1 and G = 4 (q = B/(G·N)); ELS with
  G = 1 and G = 4 (at most G examples of each user in D_sub, p = B/|D_sub|). The better setting of
  each method is compared. σ is calibrated to (ε, δ) over T
  steps by each strategy's own accountant, δ = the default 1/(10·N).
* Every run is ``userdp simulate --in-process`` through the run API: the same sampler, engine,
  noise, ledger and evaluation as a real run. The metric is the held-out loss after T steps (and
  its perplexity), mean ± standard error over ``--seeds`` repeats, which differ in the secret
  cohorts and noise.

    .venv/bin/python benchmarks/papers_lm.py --out benchmarks/results/cpu-2c-papers
    .venv/bin/python benchmarks/papers_lm.py --quick --out /tmp/papers   # one setting, 1 seed
    python benchmarks/papers_lm.py --gpu --out benchmarks/results/gpu-papers  # one CUDA device
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from papers import summary, tied_or_better
from userdp.clients.model import build_model, model_shape
from userdp.clients.shard_store import ShardStore

from userdp.cli import main as userdp_main
from userdp.config import parse_config
from userdp.run.launch import run

SEQ_LEN = 64
STEPS = 40
ELS_GROUP = 4
SETTINGS = ({"epsilon": 1.0, "budget": 128}, {"epsilon": 8.0, "budget": 128})
METHODS = (("uls", 1), ("uls", 4), ("els", 1), ("els", ELS_GROUP))
LEARNING_RATE = 3e-3


@dataclass(frozen=True)
class Scale:
    """The model and device of a reproduction: ``CPU`` (the results files) or ``GPU``."""

    preset: str
    device: str
    pretrain_steps: int


CPU = Scale("gpt2-tiny", "cpu", 600)
GPU = Scale("gpt2-small", "cuda", 3000)
"""GPT-2 small (12 layers, width 768) on one CUDA device: the papers' fine-tuning of a
pre-trained transformer at a size a 2-core CPU cannot run in hours."""


def scale_of(gpu: bool) -> Scale:
    """GPU when asked for and present (a clear exit otherwise), else CPU."""
    if not gpu:
        return CPU
    if not torch.cuda.is_available():
        print(
            "--gpu: no CUDA device is visible to torch; run without --gpu on CPU", file=sys.stderr
        )
        raise SystemExit(2)
    return GPU


def corpus(folder: Path) -> tuple[Path, Path]:
    """The private and public splits as shards under ``folder`` (written once)."""
    out = []
    for split in ("private", "public"):
        target = folder / split
        if not (target / "manifest.json").is_file():
            argv = ["shard", "--fortunes", str(target), "--fortunes-split", split, "--quiet"]
            if userdp_main(argv) != 0:
                raise SystemExit(f"userdp {' '.join(argv)} failed")
        out.append(target)
    return out[0], out[1]


def sequences(store: ShardStore, eos: int, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every example as one sequence of SEQ_LEN ids (example + eos, cut or padded) and its
    labels (-100 on padding)."""
    rows = []
    for user in store.users():
        for tokens in store.user_examples(user):
            ids = np.append(tokens[: SEQ_LEN - 1], eos)
            rows.append(np.pad(ids, (0, SEQ_LEN - ids.size), constant_values=pad))
    ids = torch.as_tensor(np.stack(rows), dtype=torch.long)
    labels = ids.clone()
    labels[ids == pad] = -100
    return ids, labels


def pretrain(
    public: Path, private: Path, out: Path, steps: int, seed: int, scale: Scale = CPU
) -> dict:
    """The scale's preset trained without privacy on the public split, on its device; saved to
    ``out``."""
    torch.manual_seed(seed)
    with ShardStore(private) as store:
        shape = model_shape(store.manifest, SEQ_LEN)
    config = parse_config({"model": {"preset": scale.preset}}).model
    model = build_model(config, shape, seed=seed).to(scale.device)
    with ShardStore(public) as store:
        ids, labels = (t.to(scale.device) for t in sequences(store, shape.eos_id, shape.pad_id))
    order = torch.randperm(len(ids), generator=torch.Generator().manual_seed(seed))
    held, train = order[:500], order[500:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    model.train()
    rng = torch.Generator().manual_seed(seed + 1)
    for _ in range(steps):
        batch = train[torch.randint(len(train), (64,), generator=rng)]
        loss = model(input_ids=ids[batch], labels=labels[batch]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        held_loss = float(model(input_ids=ids[held], labels=labels[held]).loss)
    model.to("cpu").save_pretrained(out)
    return {"steps": steps, "public_examples": len(ids), "public_held_out_loss": held_loss}


def d_sub_size(private: Path, group: int) -> int:
    """|D_sub|: each user's examples capped at ``group``."""
    with ShardStore(private) as store:
        return sum(min(c.n_examples, group) for c in store.user_counts().values())


NOTES = (
    "Notes. A verdict is reproduced when the better ULS has a lower held-out loss than ELS by more "
    "than two combined standard errors, not reproduced when it is higher by as much. Each method "
    "runs at G = 1 and 4 and its better setting is compared; at G = 1 the two are one mechanism "
    "(one example per sampled user, the same σ). Most authors have one quotation (median 1), so the methods differ mainly on the "
    "881 authors with two or more. The model is tiny (2 layers, width 64), fine-tuned for 40 "
    "steps; the compute axis is the per-step budget B (a larger B: more users or examples per "
    "step at the same T, and a smaller σ for the same ε). Repeats differ in the secret cohorts "
    "and noise only: the pre-trained model and the held-out users are fixed."
)


def run_dir(
    work: Path, setting: dict, method: tuple[str, int], seed: int, selection: str = "random"
) -> Path:
    """A fresh folder for one run (an existing one would be resumed, not run again)."""
    name = f"eps{setting['epsilon']:g}-B{setting['budget']}-{method[0]}{method[1]}-s{seed}"
    name += "" if selection == "random" else f"-{selection}"
    folder = work / "runs" / name
    shutil.rmtree(folder, ignore_errors=True)
    return folder


def run_once(
    private: Path,
    model: Path,
    setting: dict,
    method: tuple[str, int],
    steps: int,
    out: Path,
    seed: int,
    selection: str = "random",
    scale: Scale = CPU,
) -> dict:
    """One in-process run of ``method`` = (strategy name, G) at ``setting`` (ε, budget B);
    ``selection`` is ``data.selection``."""
    name, group = method
    with ShardStore(private) as store:
        users = len(store.users())
    prob = setting["budget"] / (group * users if name == "uls" else d_sub_size(private, group))
    config = parse_config(
        {
            "data": {
                "shards": str(private),
                "eval_fraction": 0.1,
                "seq_len": SEQ_LEN,
                "selection": selection,
            },
            "model": {"path": str(model)},
            "strategy": {
                "name": name,
                "sampling_prob": prob,
                "group_size": group,
                "clip_norm": 1.0,
                "steps": steps,
                "server_optimizer": "adam",
                "server_lr": LEARNING_RATE,
            },
            "privacy": {"epsilon": setting["epsilon"], "secure_noise": False},
            "workers": {
                "count": 1,
                "cache_dir": str(out.parent / "cache"),
                "device": scale.device,
            },
            "output": {"dir": str(out), "seed": seed, "sample_count": 0},
        }
    )
    result = run(config, out, mode="in-process", quiet=True)
    return {
        "final_eval_loss": result.final_eval_loss,
        "baseline_eval_loss": result.baseline_eval_loss,
        "noise_multiplier": result.noise_multiplier,
        "epsilon": result.epsilon,
    }


def _compare(here: list[dict]) -> tuple[dict, dict, str]:
    """(best ULS, best ELS, verdict of "ULS beats ELS") among rows of one ε and budget."""
    best = min((r for r in here if r["method"].startswith("ULS")), key=lambda r: r["mean"])
    row = min((r for r in here if r["method"].startswith("ELS")), key=lambda r: r["mean"])
    if not tied_or_better(row, best):  # ELS higher by more than two standard errors
        return best, row, "reproduced"
    if not tied_or_better(best, row):
        return best, row, "not reproduced"
    return best, row, "inconclusive: within 2 s.e."


def _evidence(best: dict, row: dict) -> str:
    return (
        f"best {best['method']} {best['mean']:.4f} ± {best['stderr']:.2g} vs best "
        f"{row['method']} {row['mean']:.4f} ± {row['stderr']:.2g} held-out loss"
    )


def verdicts(rows: list[dict]) -> list[dict]:
    """Per ε at the smallest budget: the better ULS against the better ELS (each over its G);
    then the same at the largest budget, for the large-compute finding."""
    out = []
    budgets = sorted({r["budget"] for r in rows})
    for epsilon in sorted({r["epsilon"] for r in rows}):
        here = [r for r in rows if r["epsilon"] == epsilon and r["budget"] == budgets[0]]
        best, row, verdict = _compare(here)
        out.append(
            {
                "finding": f"ULS beats ELS at ε = {epsilon:g}, B = {budgets[0]}"
                + (" (strict privacy)" if epsilon <= 1 else ""),
                "evidence": _evidence(best, row),
                "verdict": verdict,
            }
        )
    if len(budgets) == 1:
        out.append(
            {
                "finding": "ULS beats ELS at large compute",
                "evidence": f"not swept: one budget (B = {budgets[0]})",
                "verdict": "inconclusive",
            }
        )
        return out
    for epsilon in sorted({r["epsilon"] for r in rows}):
        here = [r for r in rows if r["epsilon"] == epsilon and r["budget"] == budgets[-1]]
        if not here:
            continue
        best, row, verdict = _compare(here)
        out.append(
            {
                "finding": f"ULS beats ELS at large compute (B = {budgets[-1]}, ε = {epsilon:g})",
                "evidence": _evidence(best, row),
                "verdict": verdict,
            }
        )
    return out


def markdown_head(record: dict, runs: str) -> list[str]:
    """Title, machine, data and model, ``runs`` (the run settings) and the verdict table."""
    pre = record["pretraining"]
    return [
        f"# {record['claim']}",
        "",
        f"- Machine: {record['machine']}; {record['seconds']:.0f} s in all.",
        f"- Data: fortunes corpus, private split {record['private_users']} authors; model "
        f"{record.get('model', CPU.preset)} pre-trained for {pre['steps']} steps on "
        f"{pre['public_examples']} public quotations (held-out public loss "
        f"{pre['public_held_out_loss']:.3f}).",
        f"- {runs}, seq_len {SEQ_LEN}, Adam server lr {LEARNING_RATE:g}, C = 1, δ = 1/(10·N); "
        f"{len(record['seeds'])} repeats per entry (mean ± standard error).",
        "",
        "| finding | evidence | verdict |",
        "|---|---|---|",
        *(f"| {v['finding']} | {v['evidence']} | {v['verdict']} |" for v in record["verdicts"]),
        "",
    ]


def markdown(record: dict) -> str:
    lines = [
        *markdown_head(
            record,
            f"T = {record['steps']} steps, B ∈ "
            f"{{{', '.join(str(b) for b in sorted({r['budget'] for r in record['rows']}))}}}",
        ),
        NOTES,
        "",
        "| ε | B | method | σ | held-out loss before | after (mean ± s.e.) | perplexity |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in record["rows"]:
        lines.append(
            f"| {r['epsilon']:g} | {r['budget']} | {r['method']} | {r['noise_multiplier']:.4g} | "
            f"{r['baseline_eval_loss']:.4f} | {r['mean']:.4f} ± {r['stderr']:.2g} | "
            f"{math.exp(r['mean']):.3f} |"
        )
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    lines = sorted({(r["budget"], r["method"]) for r in record["rows"]})
    for offset, (budget, method) in enumerate(lines):
        mine = [r for r in record["rows"] if (r["budget"], r["method"]) == (budget, method)]
        ax.errorbar(
            [r["epsilon"] * (1 + 0.03 * (offset - len(lines) / 2)) for r in mine],
            [r["mean"] for r in mine],
            yerr=[r["stderr"] for r in mine],
            marker="o" if budget == lines[0][0] else "s",
            capsize=3,
            label=f"{method}, B = {budget}",
            linestyle="--" if method.startswith("ELS") else "-",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ε")
    ax.set_ylabel("held-out loss after fine-tuning")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    model = record.get("model", CPU.preset)
    ax.set_title(f"Fortunes corpus, {model}: ULS vs ELS, mean ± s.e.", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def add_arguments(parser: argparse.ArgumentParser, claim: str) -> None:
    """The options both language-model reproductions take."""
    parser.add_argument("--seeds", type=int, default=3, help="repeats per entry")
    parser.add_argument(
        "--pretrain-steps", type=int, help="non-private steps (default: 600 on CPU, 3000 on GPU)"
    )
    parser.add_argument(
        "--gpu", action="store_true", help="GPT-2 small on one CUDA device instead of gpt2-tiny"
    )
    parser.add_argument("--work", type=Path, default=Path("runs/papers_lm"), help="scratch folder")
    parser.add_argument("--out", type=Path, required=True, help=f"writes PREFIX-{claim}.*")


@dataclass(frozen=True)
class Prepared:
    """The corpus and the pre-trained model every run of a reproduction fine-tunes."""

    private: Path
    model_dir: Path
    scale: Scale
    pretraining: dict
    start: float


def prepare(args: argparse.Namespace) -> Prepared:
    """Shard the corpus (once) and pre-train the model on its public split."""
    start = time.perf_counter()
    scale = scale_of(args.gpu)
    private, public = corpus(args.work / "data")
    model_dir = args.work / f"pretrained-{scale.preset}"
    steps = 20 if args.quick else (args.pretrain_steps or scale.pretrain_steps)
    pretraining = pretrain(public, private, model_dir, steps, 0, scale)
    return Prepared(private, model_dir, scale, pretraining, start)


def entry(runs: list[dict]) -> dict:
    """One table entry from its repeats: held-out loss mean ± s.e., the start and σ."""
    losses = np.array([r["final_eval_loss"] for r in runs])
    return {
        **summary(losses),
        "losses": losses.tolist(),
        "baseline_eval_loss": runs[0]["baseline_eval_loss"],
        "noise_multiplier": runs[0]["noise_multiplier"],
    }


def publish(record: dict, prepared: Prepared, prefix: str, render, draw) -> None:
    """Add the machine, model and corpus facts to ``record``; write PREFIX.json, .md (``render``)
    and .png (``draw``)."""
    with ShardStore(prepared.private) as store:
        private_users = len(store.users())
    record.update(
        machine=platform.platform(),
        model=prepared.scale.preset,
        device=prepared.scale.device,
        private_users=private_users,
        pretraining=prepared.pretraining,
        seconds=time.perf_counter() - prepared.start,
    )
    record["seconds"] += record.pop("earlier_seconds", 0.0)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{prefix}.json").write_text(json.dumps(record, indent=1) + "\n")
    Path(f"{prefix}.md").write_text(render(record) + "\n")
    draw(record, Path(f"{prefix}.png"))
    print(render(record))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, "language_model")
    parser.add_argument(
        "--budgets", type=int, nargs="+", default=[128], help="examples per step (B) to sweep"
    )
    parser.add_argument(
        "--extend",
        action="store_true",
        help="keep the rows of an existing PREFIX-language_model.json made with the same "
        "pre-trained model, and run only the settings it lacks",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: one setting, 1 repeat, 5 steps"
    )
    args = parser.parse_args()
    settings = [{"epsilon": e["epsilon"], "budget": b} for b in args.budgets for e in SETTINGS]
    seeds, steps = list(range(args.seeds)), STEPS
    if args.quick:
        settings, seeds, steps = settings[:1], [0], 5
    prefix = f"{args.out}-language_model"
    prepared = prepare(args)
    rows, earlier = _kept_rows(prefix, prepared, seeds, steps) if args.extend else ([], 0.0)
    done = {(r["epsilon"], r["budget"], r["method"]) for r in rows}
    for setting in settings:
        for method in METHODS:
            label = f"{method[0].upper()} G={method[1]}"
            if (setting["epsilon"], setting["budget"], label) in done:
                continue
            runs = [
                run_once(
                    prepared.private,
                    prepared.model_dir,
                    setting,
                    method,
                    steps,
                    run_dir(args.work, setting, method, seed),
                    seed,
                    scale=prepared.scale,
                )
                for seed in seeds
            ]
            rows.append({**setting, "method": label, **entry(runs)})
            print(json.dumps(rows[-1]), flush=True)
    record = {
        "claim": "Charles et al., Fine-Tuning LLMs with User-Level DP, §5: ULS vs ELS on a "
        "language model (fortunes corpus)",
        "seeds": seeds,
        "steps": steps,
        "rows": rows,
        "verdicts": verdicts(rows),
        "earlier_seconds": earlier,
    }
    rows.sort(key=lambda r: (r["budget"], r["epsilon"]))
    publish(record, prepared, prefix, markdown, plot)


def _kept_rows(
    prefix: str, prepared: Prepared, seeds: list[int], steps: int
) -> tuple[list[dict], float]:
    """The rows and seconds of an earlier run of this claim, when it used the same pre-trained
    model (same pre-training steps and held-out public loss), seeds and steps; else a clear
    exit."""
    path = Path(f"{prefix}.json")
    if not path.is_file():
        return [], 0.0
    old = json.loads(path.read_text())
    same = (
        old["pretraining"]["steps"] == prepared.pretraining["steps"]
        and math.isclose(
            old["pretraining"]["public_held_out_loss"],
            prepared.pretraining["public_held_out_loss"],
            rel_tol=1e-6,
        )
        and old["seeds"] == seeds
        and old["steps"] == steps
    )
    if not same:
        print(f"--extend: {path} was made with another model, seeds or steps", file=sys.stderr)
        raise SystemExit(2)
    return old["rows"], float(old["seconds"])


if __name__ == "__main__":
    main()
