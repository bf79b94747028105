"""Benchmark the accountants: userdp's fast ELS path next to dp_accounting, in one run.

Each row is one function returning a dict (name, setting, seconds, value, reference, ...), so a
new accountant adds a row by adding a function to ROWS. Prints JSON, then a markdown table.

    .venv/bin/python benchmarks/accounting.py            # full (dp_accounting ELS at 1e-4: ~100 s)
    .venv/bin/python benchmarks/accounting.py --quick    # reference at vdi 1e-3, smaller settings
    .venv/bin/python benchmarks/accounting.py --rows els_epsilon els_calibration

Calibrations run with the on-disk cache off, so they measure the search, not a cache hit.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from typing import Any

import dp_accounting
from dp_accounting import pld as dp_pld
from userdp.accounting import (
    ElsMechanism,
    UlsMechanism,
    calibrate_noise_multiplier,
    dp_event,
    epsilon,
    pld_accountant,
)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def _cpu_timed(fn: Callable[[], Any]) -> tuple[Any, float, float]:
    """(value, wall s, CPU s of this process). CPU time is the fairer number on a shared box."""
    wall, cpu = time.perf_counter(), time.process_time()
    value = fn()
    return value, time.perf_counter() - wall, time.process_time() - cpu


def els_epsilon(quick: bool) -> dict[str, Any]:
    """ELS ε, G=16, T=2000, p=0.01, σ=1, δ=1e-6: fast path vs dp_accounting's PLDAccountant.

    The fast path runs 3 times (median reported); the reference once (about a minute).
    """
    vdi = 1e-3 if quick else 1e-4
    mech, steps, delta = ElsMechanism(1.0, 0.01, 16), 2000, 1e-6
    # Warm up imports and numpy/scipy code paths on a tiny problem.
    epsilon(ElsMechanism(1.0, 0.5, 2), 1, delta, value_discretization_interval=1e-2)

    def fast_once() -> float:
        pld_accountant.single_step_pld.cache_clear()
        return epsilon(mech, steps, delta, value_discretization_interval=vdi)

    runs = sorted((_cpu_timed(fast_once) for _ in range(3)), key=lambda r: r[1])
    fast, fast_s, fast_cpu = runs[1]

    def reference() -> float:
        accountant = dp_pld.PLDAccountant(value_discretization_interval=vdi)
        accountant.compose(dp_accounting.SelfComposedDpEvent(dp_event(mech), steps))
        return accountant.get_epsilon(delta)

    ref, ref_s, ref_cpu = _cpu_timed(reference)
    return {
        "name": "els_epsilon",
        "setting": f"G=16 T=2000 p=0.01 σ=1 δ=1e-6 vdi={vdi:g}",
        "value": fast,
        "reference": ref,
        "rel_diff": (fast - ref) / ref,
        "seconds": fast_s,
        "reference_seconds": ref_s,
        "speedup": ref_s / fast_s,
        "cpu_seconds": fast_cpu,
        "reference_cpu_seconds": ref_cpu,
        "cpu_speedup": ref_cpu / fast_cpu,
        "goal": "≥20× faster, rel. diff ≤ 1e-3 (vdi 1e-4)",
    }


def els_calibration(quick: bool) -> dict[str, Any]:
    """σ for ELS G=64, T=10,000, δ=1e-6, rtol 1e-4; p=1e-4, ε=8 is the hard case (σ ≈ 0.76)."""
    out = []
    settings = [(0.01, 4.0)] if quick else [(0.01, 4.0), (1 / 64, 8.0), (1e-4, 8.0)]
    for p, target in settings:
        pld_accountant.single_step_pld.cache_clear()
        template = ElsMechanism(1.0, p, 64)
        sigma, seconds = _timed(
            lambda t=template, e=target: calibrate_noise_multiplier(
                t, e, 1e-6, 10_000, use_cache=False
            )
        )
        check = epsilon(ElsMechanism(sigma, p, 64), 10_000, 1e-6)
        out.append(
            {
                "name": "els_calibration",
                "setting": f"G=64 T=10000 p={p:g} ε={target:g} δ=1e-6 vdi=1e-4",
                "value": sigma,
                "epsilon_at_value": check,
                "seconds": seconds,
                "goal": "≤ 30 s on 2 CPU cores; ε(σ) ≤ target",
            }
        )
    return out  # type: ignore[return-value]


def uls_calibration(quick: bool) -> dict[str, Any]:
    """σ for ULS in the Stack Overflow setting of "Fine-Tuning Large Language Models with
    User-Level Differential Privacy" (§5: N = 342,477 users, T = 10,000, δ = 1.13e-9) at M = 512,
    ε = 4; reference 0.68945 (dp_accounting PLD, calibration tolerance 1e-4)."""
    steps = 2_000 if quick else 10_000
    template = UlsMechanism(1.0, 512 / 342_477)
    sigma, seconds = _timed(
        lambda: calibrate_noise_multiplier(template, 4.0, 1.13e-9, steps, use_cache=False)
    )
    return {
        "name": "uls_calibration",
        "setting": f"q=512/342477 T={steps} ε=4 δ=1.13e-9 vdi=1e-4",
        "value": sigma,
        "reference": None if quick else 0.68945,
        "seconds": seconds,
        "goal": "matches the dp_accounting reference 0.68945 within its tol 1e-4",
    }


def balls_in_bins_delta(quick: bool) -> list[dict[str, Any]] | None:
    """Balls-in-bins Monte Carlo ε, b=128, E=16, σ=1, 2^20 samples, both bin semantics (when the
    module is installed). ε from δ̂ includes sampling; "per-epoch" samples E one-epoch losses."""
    try:
        from userdp.accounting import balls_in_bins
    except ImportError:
        return None
    samples = 2**16 if quick else 2**20
    rows = []
    for semantics in ("fixed", "per-epoch"):
        value, seconds = _timed(
            lambda s=semantics: balls_in_bins.epsilon(
                1.0, 128, 16, 1e-6, bin_semantics=s, correlation=None, num_samples=samples, seed=0
            )
        )
        rows.append(
            {
                "name": "balls_in_bins_epsilon",
                "setting": f"{semantics} b=128 E=16 σ=1 δ=1e-6 samples={samples}",
                "value": value,
                "seconds": seconds,
                "goal": "≤ 1 s on CPU (δ̂ with 2^20 samples)",
            }
        )
    return rows


ROWS: dict[str, Callable[[bool], Any]] = {
    "els_epsilon": els_epsilon,
    "els_calibration": els_calibration,
    "uls_calibration": uls_calibration,
    "balls_in_bins": balls_in_bins_delta,
}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value)


def markdown(rows: list[dict[str, Any]]) -> str:
    columns = ["name", "setting", "value", "reference", "rel_diff", "seconds",
               "reference_seconds", "speedup", "cpu_speedup", "goal"]  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="coarser reference, smaller settings")
    parser.add_argument("--rows", nargs="*", choices=sorted(ROWS), default=list(ROWS))
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    for name in args.rows:
        result = ROWS[name](args.quick)
        if result is None:
            continue
        rows.extend(result if isinstance(result, list) else [result])
    report = {
        "machine": {"python": platform.python_version(), "cpus": __import__("os").cpu_count()},
        "dp_accounting": getattr(dp_accounting, "__version__", "unknown"),
        "quick": args.quick,
        "rows": rows,
    }
    print(json.dumps(report, indent=2, ensure_ascii=False))
    print()
    print(markdown(rows))


if __name__ == "__main__":
    main()
