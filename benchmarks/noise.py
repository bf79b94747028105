"""Benchmark the coordinator's noise path: secure noise (AES-256-CTR keystream, float64
Box–Muller, release rounded onto a grid) next to the fast floating-point path
(``privacy.secure_noise = false``) on the same model-sized tensor, in the same run.

Figures, each the median of ``--repeats`` runs, wall seconds for one step's ``noise.add`` on
``--params`` float32 parameters (one CPU tensor, like the coordinator's):

* ``secure`` / ``fast``: iid Gaussian noise (DP-SGD); goal: secure ≤ 2× fast.
* ``secure BLT`` / ``fast BLT``: BLT-correlated noise with 2 buffers (DP-FTRL); same goal.
* anchors: the AES-256-CTR keystream alone for the 8 bytes per parameter the secure draw uses,
  and ``torch.randn`` alone (the fast generator without the add).

Prints JSON, then a markdown table.

    .venv/bin/python benchmarks/noise.py [--params 100000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

GOAL_RATIO = 2.0


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: allocator, first-touch pages
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import torch
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
    from userdp.strategies.blt import Blt, BltNoise
    from userdp.strategies.noise import GaussianNoise, NoiseRng

    n = args.params
    summed = {"w": torch.randn(n, generator=torch.Generator().manual_seed(0))}
    std = 1.7
    blt = Blt(buf_decay=(0.9, 0.5), output_scale=(0.3, 0.1))

    def add(mechanism) -> Callable[[], object]:
        step = iter(range(10**9))
        return lambda: mechanism.add(next(step), summed, std=std)

    zeros, out = bytearray(1 << 24), bytearray((1 << 24) + 15)
    encryptor = Cipher(algorithms.AES(os.urandom(32)), modes.CTR(bytes(16))).encryptor()

    def keystream() -> None:
        for _ in range(0, 8 * n, len(zeros)):
            encryptor.update_into(zeros, out)

    generator = torch.Generator().manual_seed(1)
    cases = [
        ("fast", add(GaussianNoise(NoiseRng(secure=False))), None),
        ("secure", add(GaussianNoise(NoiseRng())), "fast"),
        ("fast BLT", add(BltNoise(blt, NoiseRng(secure=False))), None),
        ("secure BLT", add(BltNoise(blt, NoiseRng())), "fast BLT"),
        ("AES-256-CTR keystream, 8 B/param (anchor)", keystream, None),
        ("torch.randn alone (anchor)", lambda: torch.randn(n, generator=generator), None),
    ]
    seconds = {name: timed(fn, args.repeats) for name, fn, _ in cases}
    rows = []
    for name, _, versus in cases:
        ratio = seconds[name] / seconds[versus] if versus else None
        rows.append(
            {
                "case": name,
                "seconds": round(seconds[name], 4),
                "ratio_to": versus,
                "ratio": None if ratio is None else round(ratio, 2),
                "goal_ratio": GOAL_RATIO if versus else None,
                "goal_met": None if ratio is None else ratio <= GOAL_RATIO,
            }
        )
    result = {
        "benchmark": "noise",
        "params": n,
        "repeats": args.repeats,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }
    print(json.dumps(result))
    print()
    print(
        f"Noise for one step on {n:,} float32 parameters (CPU, {torch.get_num_threads()} threads)"
    )
    print()
    print("| case | s (median) | ratio | goal |")
    print("|---|---|---|---|")
    for row in rows:
        ratio = f"{row['ratio']}× {row['ratio_to']}" if row["ratio"] is not None else "anchor"
        goal = "anchor" if row["goal_ratio"] is None else f"≤ {row['goal_ratio']}×"
        if row["goal_met"] is not None:
            goal += " ✓" if row["goal_met"] else " ✗"
        print(f"| {row['case']} | {row['seconds']:.3f} | {ratio} | {goal} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
