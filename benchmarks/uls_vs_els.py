"""ULS vs ELS at the same user-level ε and the same compute budget, on the embedded corpus.

Seed 000's comparison: the budget is B gradients per step. ULS samples users with probability q
and averages up to G_ULS examples per user (B = G_ULS·qN, an upper bound when users have fewer
examples); ELS fixes D_sub (≤ G_ELS examples per user, G_ELS ≈ the median user size) and samples
examples with p = B/|D_sub|. Both calibrate σ to the same (ε, δ) for the same T and run the same
model, optimizer and engine in the in-process simulator; the held-out users' loss says which wins.

    python benchmarks/uls_vs_els.py [--steps 60] [--epsilon 8] [--seeds 1]

Prints JSON, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--uls-group-size", type=int, default=4)
    parser.add_argument("--uls-sampling-prob", type=float, default=0.08)
    parser.add_argument(
        "--els-group-size", type=int, default=0, help="0 = median user size, as a power of 2"
    )
    parser.add_argument(
        "--seeds", type=int, default=1, help="runs per strategy (sampler/model seeds)"
    )
    args = parser.parse_args()

    from userdp.clients.shard_store import ShardStore

    from userdp.cli.simulate import demo_config
    from userdp.run.components import shard_directory, split_users
    from userdp.run.launch import run

    base = demo_config()
    with ShardStore(shard_directory(base)) as store:
        counts = {u: c.n_examples for u, c in store.user_counts().items()}
    train, _ = split_users(list(counts), base.data.eval_fraction)
    sizes = np.array([counts[u] for u in train])
    g_uls, q = args.uls_group_size, args.uls_sampling_prob
    budget = float(np.minimum(sizes, g_uls).sum() * q)  # expected gradients per ULS step
    g_els = args.els_group_size or int(2 ** round(np.log2(np.median(sizes))))
    d_sub = int(np.minimum(sizes, g_els).sum())
    p = budget / d_sub

    rows = []
    for name, group, prob in (("uls", g_uls, q), ("els", g_els, p)):
        for seed in range(args.seeds):
            config = base.model_copy(
                update={
                    "strategy": base.strategy.model_copy(
                        update={
                            "name": name,
                            "group_size": group,
                            "sampling_prob": prob,
                            "steps": args.steps,
                        }
                    ),
                    "privacy": base.privacy.model_copy(update={"epsilon": args.epsilon}),
                    "output": base.output.model_copy(update={"seed": seed, "plots": False}),
                }
            )
            with tempfile.TemporaryDirectory() as tmp:
                started = time.perf_counter()
                result = run(config, Path(tmp) / name, mode="in-process", quiet=True)
                seconds = time.perf_counter() - started
            rows.append(
                {
                    "strategy": name,
                    "seed": seed,
                    "group_size": group,
                    "sampling_prob": prob,
                    "gradients_per_step": budget,
                    "noise_multiplier": result.noise_multiplier,
                    "epsilon": result.epsilon,
                    "delta": result.delta,
                    "steps": result.steps_done,
                    "baseline_eval_loss": result.baseline_eval_loss,
                    "final_eval_loss": result.final_eval_loss,
                    "seconds": seconds,
                }
            )
    print(json.dumps({"benchmark": "uls_vs_els", "rows": rows}, indent=2))
    print()
    print("| strategy | seed | G | q or p | grads/step | σ | ε | δ | baseline loss | final loss |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['strategy']} | {r['seed']} | {r['group_size']} | {r['sampling_prob']:.4f} | "
            f"{r['gradients_per_step']:.1f} | {r['noise_multiplier']:.3f} | {r['epsilon']:.3f} | "
            f"{r['delta']:.2e} | {r['baseline_eval_loss']:.4f} | {r['final_eval_loss']:.4f} |"
        )


if __name__ == "__main__":
    main()
