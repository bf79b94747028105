"""Benchmark the strategy pieces the coordinator calls every step: cohort sampling, BLT noise.

Prints JSON, then a markdown table. Each row times the median of a few repeats.

    .venv/bin/python benchmarks/strategies.py            # includes D_sub for 1M users (~10 s)
    .venv/bin/python benchmarks/strategies.py --quick    # smaller populations and models
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from userdp.strategies import ExampleLevelSampling, UserLevelSampling
from userdp.strategies.base import PopulationCounts
from userdp.strategies.blt import BltNoise, optimize_blt
from userdp.strategies.samplers import BallsInBinsSampler, ExampleSubset


def _median_seconds(fn: Callable[[], Any], repeats: int = 5) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _once(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """(value, wall s, CPU s of this process): CPU time is the fairer number on a shared box."""
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    return value, time.perf_counter() - wall, time.process_time() - cpu


def run(quick: bool) -> list[dict[str, Any]]:
    n = 100_000 if quick else 1_000_000
    cohort = n // 100
    users = tuple(f"user{i}" for i in range(n))
    rows = []

    uls = UserLevelSampling(noise_multiplier=1.0, clip_norm=1.0, sampling_prob=cohort / n)
    step = iter(range(10**9))
    rows.append(
        {
            "name": "uls_sample_cohort",
            "setting": f"Poisson q={cohort / n:g}, N={n}, ~{cohort} users",
            "seconds": _median_seconds(lambda: uls.sample_cohort(next(step), users)),
        }
    )

    bins = BallsInBinsSampler(n // cohort, "balls-in-bins-fixed", seed=None)
    rows.append(
        {
            "name": "balls_in_bins_sample",
            "setting": f"b={n // cohort}, N={n} (assignment cached per epoch)",
            "seconds": _median_seconds(lambda: bins.sample(next(step) % (n // cohort), n)),
        }
    )

    counts = np.random.default_rng(0).integers(1, 400, size=n)
    subset, seconds, cpu = _once(lambda: ExampleSubset(counts, 16, seed=1))
    rows.append(
        {
            "name": "els_build_d_sub",
            "setting": f"N={n} users, 1..400 examples, G=16 (once per run)",
            "seconds": seconds,
            "cpu_seconds": cpu,
        }
    )
    els = ExampleLevelSampling(
        noise_multiplier=1.0, clip_norm=1.0, sampling_prob=cohort / len(subset), group_size=16
    )
    population = PopulationCounts(users, counts)
    els._subset, els._subset_key = subset, (n, int(counts.sum()))
    rows.append(
        {
            "name": "els_sample_cohort",
            "setting": f"Poisson p over |D_sub|={len(subset)}, ~{cohort} examples",
            "seconds": _median_seconds(lambda: els.sample_cohort(next(step), population)),
        }
    )

    (blt, loss), seconds, cpu = _once(lambda: optimize_blt(1000, 3))
    rows.append(
        {
            "name": "blt_optimize",
            "setting": "n=1000, single participation, 3 buffers (jax_privacy: 10.692, 112.6 s)",
            "seconds": seconds,
            "cpu_seconds": cpu,
            "value": loss,
        }
    )

    size = 1_000_000 if quick else 10_000_000
    noise = BltNoise(blt)
    like = {"w": torch.zeros(size)}
    counter = iter(range(10**9))
    rows.append(
        {
            "name": "blt_noise_step",
            "setting": f"{size:,} float32 params, 3 buffers, torch CPU",
            "seconds": _median_seconds(lambda: noise.sample(next(counter), like), repeats=3),
        }
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rows = run(args.quick)
    print(json.dumps({"machine": platform.machine(), "rows": rows}, indent=2))
    print("\n| benchmark | setting | seconds | CPU s | value |\n|---|---|---|---|---|")
    for row in rows:
        value = f"{row['value']:.4f}" if "value" in row else ""
        cpu = f"{row['cpu_seconds']:.3g}" if "cpu_seconds" in row else ""
        print(f"| {row['name']} | {row['setting']} | {row['seconds']:.3g} | {cpu} | {value} |")


if __name__ == "__main__":
    main()
