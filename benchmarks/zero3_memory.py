"""Memory per rank of a ZeRO-3 worker against ZeRO-2, for N = 1, 2, 4 CPU ranks (gloo).

Each configuration starts N processes that build the worker engine exactly as ``userdp worker``
does (``build_engine``: Llama-shaped preset, DeepSpeed), compute one task's clipped sum (whole
users split over the ranks) and report, per rank:

- ``param_mb``: parameter bytes this rank holds at rest (its ZeRO-3 partitions; the whole model at
  stage 2), measured from the tensors;
- ``sums_mb``: its clipped-sum accumulator during the task, measured from its tensors (stage 2:
  float32 for every trainable parameter, all-reduced at the end; stage 3: this rank's shard of
  each parameter's sum, reduce-scattered as each pass ends, ``clients/sharded_sums.py``);
- ``sent_mb``: the whole sum in host memory for the coordinator stream, which at stage 3 only
  rank 0 holds (gathered at the end of the task; every rank returns it at stage 2);
- ``built_rss_mb``: resident memory once the engine is built (the model partitioned at stage 3),
  before any task;
- ``rss_mb``: resident memory after the task, and ``peak_rss_mb``: the process's peak (at
  stage 3 with N > 1 the model is built partitioned, ``deepspeed.zero.Init``; at stage 2 whole).

Goal (docs/models.md, "ZeRO-3"): at stage 3, parameters + clipped-sum accumulator per rank ≤
(model + its float32 sums)/N + one element per parameter of padding. The anchor is stage 2 on the
same N in the same run (the whole model and whole sums on every rank). Rank 0's host copy of the
whole sum (``sent_mb``) does not fall with N: it is what the gRPC data plane sends.

    python benchmarks/zero3_memory.py [--preset llama-small] [--ranks 1 2 4] [--quick]

Prints JSON, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20


def rank_main(out: str, preset: str, stage: int, seq_len: int) -> None:
    """One rank: build the worker engine, run one task, write this rank's figures."""
    sys.path.insert(0, str(ROOT))
    import numpy as np
    import psutil
    import torch
    from userdp.clients.engine import Unit, build_engine

    from tests.clients.engine_fixtures import VOCAB, byte_manifest
    from userdp.config import parse_config

    config = parse_config(
        {
            "data": {"seq_len": seq_len},
            "model": {"preset": preset, "zero_stage": stage},
            "strategy": {"engine": "vectorized"},
            "workers": {"token_budget": 4 * seq_len},
        }
    )
    engine = build_engine(config, byte_manifest())
    built_rss = psutil.Process().memory_info().rss
    from userdp.clients.clipping import Accumulator

    accumulators = []
    result_of = Accumulator.result

    def kept(self):  # the accumulator the task used, measured from its own tensors
        accumulators.append(self)
        return result_of(self)

    Accumulator.result = kept
    rng = np.random.default_rng(0)
    units = [
        Unit(f"u{i}", [rng.integers(3, VOCAB, size=seq_len) for _ in range(2)]) for i in range(8)
    ]
    result = engine.clipped_sum(units, 1.0)
    params = list(engine.module.parameters())
    held = sum(
        p.ds_tensor.numel() * p.ds_tensor.element_size()
        if getattr(p, "ds_tensor", None) is not None
        else p.numel() * p.element_size()
        for p in params
    )
    model = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in params)
    sums = sum(t.numel() * t.element_size() for t in accumulators[-1].sums.values())
    sent = sum(t.numel() * t.element_size() for t in result.sums.values())
    rank = torch.distributed.get_rank()
    figures = {
        "rank": rank,
        "param_mb": held / MB,
        "model_mb": model / MB,
        "parameters": len(params),
        "sums_mb": sums / MB,
        "sent_mb": sent / MB,
        "trainable_mb": sum(4 * getattr(p, "ds_numel", p.numel()) for p in params) / MB,
        "built_rss_mb": built_rss / MB,
        "rss_mb": psutil.Process().memory_info().rss / MB,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "units": result.stats.count,
    }
    Path(out, f"rank-{rank}.json").write_text(json.dumps(figures))
    from userdp.clients.ranks import leave_process_group

    leave_process_group()


def run_case(preset: str, stage: int, ranks: int, seq_len: int) -> list[dict]:
    from userdp.clients.distributed import free_port

    with tempfile.TemporaryDirectory() as out:
        port = str(free_port())
        procs = []
        for rank in range(ranks):
            env = dict(
                os.environ,
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                OMP_NUM_THREADS="1",
            )
            argv = [sys.executable, __file__, "--rank-main", out, preset, str(stage), str(seq_len)]
            procs.append(
                subprocess.Popen(
                    argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
                )
            )
        for proc in procs:
            output, _ = proc.communicate(timeout=1800)
            if proc.returncode != 0:
                raise RuntimeError(f"stage {stage}, {ranks} ranks failed:\n{output[-3000:]}")
        return [json.loads(Path(out, f"rank-{r}.json").read_text()) for r in range(ranks)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama-small")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="llama-tiny, 1 and 2 ranks")
    parser.add_argument("--rank-main", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_main:
        out, preset, stage, seq_len = args.rank_main
        rank_main(out, preset, int(stage), int(seq_len))
        return 0
    preset, ranks = ("llama-tiny", [1, 2]) if args.quick else (args.preset, args.ranks)
    rows = []
    for n in ranks:
        for stage in (2, 3):
            per_rank = run_case(preset, stage, n, args.seq_len)
            worst = max(per_rank, key=lambda r: r["param_mb"])
            model_mb = worst["model_mb"]
            held = max(per_rank, key=lambda r: r["param_mb"] + r["sums_mb"])
            whole = model_mb + held["trainable_mb"]
            goal_mb = whole / n + worst["parameters"] * 2 * 4 / MB
            rows.append(
                {
                    "preset": preset,
                    "stage": stage,
                    "ranks": n,
                    "model_mb": model_mb,
                    "param_mb_per_rank": worst["param_mb"],
                    "sums_mb_per_rank": max(r["sums_mb"] for r in per_rank),
                    "held_mb_per_rank": held["param_mb"] + held["sums_mb"],
                    "sent_mb_rank0": per_rank[0]["sent_mb"],
                    "built_rss_mb_per_rank": max(r["built_rss_mb"] for r in per_rank),
                    "rss_mb_per_rank": max(r["rss_mb"] for r in per_rank),
                    "peak_rss_mb_per_rank": max(r["peak_rss_mb"] for r in per_rank),
                    "goal_held_mb": goal_mb if stage == 3 else None,
                    "met": held["param_mb"] + held["sums_mb"] <= goal_mb if stage == 3 else None,
                }
            )
    print(json.dumps({"benchmark": "zero3_memory", "rows": rows}))
    print()
    print(
        "| stage | ranks | params / rank MB | clipped sums / rank MB | params + sums / rank MB "
        "| goal | rank 0's sum to send MB | RSS after build MB | RSS after task MB | peak RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        goal = (
            f"≤ {row['goal_held_mb']:.1f} ({'met' if row['met'] else 'not met'})"
            if row["stage"] == 3
            else "anchor (whole model)"
        )
        print(
            f"| {row['stage']} | {row['ranks']} | {row['param_mb_per_rank']:.1f} | "
            f"{row['sums_mb_per_rank']:.1f} | {row['held_mb_per_rank']:.1f} | {goal} | "
            f"{row['sent_mb_rank0']:.1f} | {row['built_rss_mb_per_rank']:.0f} | "
            f"{row['rss_mb_per_rank']:.0f} | "
            f"{row['peak_rss_mb_per_rank']:.0f} |"
        )
    print(f"\nModel: {preset}, {rows[0]['model_mb']:.1f} MB of parameters (fp32).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
