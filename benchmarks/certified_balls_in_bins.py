"""The certified balls-in-bins ε (the value every place in a run states) at the paper's setting.

Rows at b = 128 bins, E = 16 epochs (n = 2048 steps), σ = 0.8, δ ∈ {1e-5, 1e-8}:

* C = I, bins redrawn every epoch and fixed for the run: the certified ε
  (:mod:`userdp.accounting.balls_in_bins_certified`: the random-allocation PLD of Feldman &
  Shenfeld, "Efficient Privacy Loss Accounting for Subsampling and Random Allocation", arXiv
  2602.17284), its CPU time (goal ≤ 30 CPU s; first query, no cache), the package's lower bound
  (the gap says how tight the stated value is), and the Monte Carlo point estimate on 2^20 draws
  (NOT a guarantee; its error grows as δ shrinks). Anchor, same run: dp_accounting's ε for
  Poisson sampling at q = 1/b over n steps (the sampling balls-in-bins replaces).
* a 3-band C and a 2-buffer BLT, fixed bins, at σ = 0.8 and at σ = 4 (a moderate ε): the
  certified ε and the method that gave it (goal: ≤ 10 CPU s), the sampling-free Rényi bound
  (:mod:`userdp.accounting.balls_in_bins_renyi`) and the Gaussian bound without amplification
  among its candidates, beside the Monte Carlo point estimate; ``--evr`` also runs the Monte Carlo
  Estimate-Verify-Release value (1.7·10⁸ draws at δ = 1e-5: minutes) where userdp's draw limit
  keeps it out of the stated value (δ ≥ 1e-6 only: at 1e-8 it would need ~10¹¹ draws).

    .venv/bin/python benchmarks/certified_balls_in_bins.py            # the rows above
    .venv/bin/python benchmarks/certified_balls_in_bins.py --quick    # b = 16, E = 4, 2^14 draws
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from typing import Any

import dp_accounting
from dp_accounting import pld as dp_pld
from userdp.accounting import balls_in_bins as bb
from userdp.accounting.balls_in_bins_certified import certified_epsilon, random_allocation_bounds
from userdp.accounting.correlation_spec import CorrelationSpec
from userdp.accounting.mechanisms import BallsInBinsMechanism

SIGMA = 0.8
CORRELATED_SIGMAS = (0.8, 4.0)
EVR_SMALLEST_DELTA = 1e-6
"""``--evr`` below this δ would need ≳ 10¹⁰ draws (its draws grow as 1/δ): not attempted."""


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    cpu = time.process_time()
    value = fn()
    return value, time.process_time() - cpu


def identity_row(bins: int, epochs: int, delta: float, semantics: str, draws: int) -> dict:
    mechanism = BallsInBinsMechanism(SIGMA, bins, epochs, semantics)
    stated, cpu = _timed(lambda: certified_epsilon(mechanism, epochs, delta, use_cache=False))
    pair = bb.dominating_pair(bins, epochs, bin_semantics=semantics)
    _, lower = random_allocation_bounds(pair, SIGMA, delta)
    estimate = bb.epsilon(SIGMA, bins, epochs, delta, bin_semantics=semantics, num_samples=draws)
    return {
        "setting": f"C = I, {semantics}, δ = {delta:g}",
        "certified": stated.epsilon,
        "method": stated.method,
        "cpu_s": round(cpu, 2),
        "lower_bound": lower,
        "monte_carlo_estimate": estimate,
        "goal_cpu_s": 30,
    }


def correlated_row(
    bins: int,
    epochs: int,
    delta: float,
    sigma: float,
    name: str,
    spec: CorrelationSpec,
    draws: int,
    evr: bool,
) -> dict:
    mechanism = BallsInBinsMechanism(sigma, bins, epochs, "fixed", spec)
    stated, cpu = _timed(lambda: certified_epsilon(mechanism, epochs, delta, use_cache=False))
    estimate = bb.epsilon(sigma, bins, epochs, delta, correlation=spec, num_samples=draws)
    row = {
        "setting": f"{name}, fixed, σ = {sigma:g}, δ = {delta:g}",
        "sigma": sigma,
        "certified": stated.epsilon,
        "method": stated.method,
        "cpu_s": round(cpu, 2),
        "renyi": stated.candidates["sampling-free Rényi DP"],
        "no_amplification": stated.candidates["no amplification"],
        "monte_carlo_estimate": estimate,
        "monte_carlo_certified": stated.candidates["Monte Carlo EVR"],
        "goal_cpu_s": 10,
    }
    if evr and row["monte_carlo_certified"] is None and delta >= EVR_SMALLEST_DELTA:
        value, evr_cpu = _timed(
            lambda: bb.certified_epsilon(sigma, bins, epochs, delta, correlation=spec, seed=1)
        )
        row["monte_carlo_certified"], row["monte_carlo_certified_cpu_s"] = value, round(evr_cpu, 1)
    return row


def poisson_anchor(bins: int, epochs: int, delta: float, sigma: float) -> float:
    accountant = dp_pld.PLDAccountant()
    event = dp_accounting.PoissonSampledDpEvent(1 / bins, dp_accounting.GaussianDpEvent(sigma))
    accountant.compose(event, bins * epochs)
    return float(accountant.get_epsilon(delta))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="b = 16, E = 4, 2^14 draws")
    parser.add_argument("--evr", action="store_true", help="also the Monte Carlo EVR value")
    args = parser.parse_args()
    bins, epochs, draws = (16, 4, 2**14) if args.quick else (128, 16, 2**20)
    deltas = (1e-5,) if args.quick else (1e-5, 1e-8)
    os.environ["USERDP_CACHE_DIR"] = tempfile.mkdtemp()  # every figure computed here, no cache
    banded = CorrelationSpec.of("banded", coefs=[1.0, 0.6, 0.3])
    blt = CorrelationSpec.of("blt", buf_decay=[0.9, 0.5], output_scale=[0.3, 0.2])
    rows = []
    for delta in deltas:
        for semantics in ("per-epoch", "fixed"):
            rows.append(identity_row(bins, epochs, delta, semantics, draws))
        for sigma in CORRELATED_SIGMAS:
            for name, spec in (("3-band C", banded), ("2-buffer BLT", blt)):
                row = correlated_row(bins, epochs, delta, sigma, name, spec, draws, args.evr)
                rows.append(row)
    anchors = {
        f"{s:g}, {d:g}": poisson_anchor(bins, epochs, d, s)
        for d in deltas
        for s in {SIGMA, *CORRELATED_SIGMAS}
    }
    setting = {"bins": bins, "epochs": epochs, "sigma": SIGMA, "draws": draws}
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs"
    print(json.dumps({"machine": machine, "setting": setting, "rows": rows, "anchors": anchors}))
    print()
    print(
        f"b = {bins}, E = {epochs}, σ = {SIGMA} unless the row says; Monte Carlo on {draws} draws"
    )
    print()
    print(
        "| setting | certified ε (method) | CPU s (goal) | lower bound | Rényi bound | no "
        "amplification | Monte Carlo estimate (not a guarantee) | Monte Carlo EVR | anchor: "
        "Poisson q = 1/b ε |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        delta = row["setting"].rsplit("= ", 1)[1]
        sigma = row.get("sigma", SIGMA)
        print(
            f"| {row['setting']} | {row['certified']:.4g} ({row['method']}) "
            f"| {row['cpu_s']} (≤ {row['goal_cpu_s']}) | {_cell(row.get('lower_bound'))} "
            f"| {_cell(row.get('renyi'))} | {_cell(row.get('no_amplification'))} "
            f"| {row['monte_carlo_estimate']:.4g} "
            f"| {_cell(row.get('monte_carlo_certified'), 'not run')} "
            f"| {anchors[f'{sigma:g}, {delta}']:.4g} |"
        )


def _cell(value: float | None, missing: str = "n/a") -> str:
    return missing if value is None else f"{value:.4g}"


if __name__ == "__main__":
    main()
