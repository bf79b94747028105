"""One ε everywhere: a real balls-in-bins run states its ledger's certified ε in every place.

A run states ε in its summary (the :class:`~userdp.run.loop.RunResult`), the per-step metrics
(and from them the progress bar, the plots and every tracking backend), the exported model's
``userdp_release.json`` and the privacy report. Each must be the certified upper bound that the
ledger's records give at the run's δ (:func:`userdp.accounting.api.compose_epsilon`), the one
that σ was calibrated on and the budget check used: the run must end within its budget, per-step
ε must not decrease, and ``userdp ledger verify`` must accept the folder.

The run: BLT-DP-FTRL with balls-in-bins sampling (4 fixed bins, 2 epochs) and a 2-banded
correlation, in process, σ calibrated to ε = 8. With correlated noise the smallest certified
bound here is Monte Carlo Estimate-Verify-Release; the check recomputes it with the accountant's
EVR as written (held at import, so a mutation that replaces it is still compared against it):
a run that states the Monte Carlo point estimate anywhere states less than that.
"""

from __future__ import annotations

import json
from pathlib import Path

from userdp.accounting import balls_in_bins
from userdp.accounting.api import balls_in_bins_epochs, compose_epsilon
from userdp.accounting.balls_in_bins_certified import gaussian_epsilon, query_seed
from userdp.accounting.ledger_format import group_phases, read_ledger

from userdp.config import parse_config

_evr_certified_epsilon = balls_in_bins.certified_epsilon

BUDGET = 8.0


def _config(out: Path):
    return parse_config(
        {
            "data": {"demo_users": 40, "seq_len": 16, "eval_fraction": 0.1},
            "model": {"preset": "gpt2-tiny"},
            "strategy": {
                "name": "blt-dp-ftrl",
                "sampling": "balls-in-bins-fixed",
                "sampling_prob": 0.25,  # 4 bins
                "steps": 8,  # 2 epochs
                "clip_norm": 1.0,
                "engine": "loop",
            },
            "privacy": {"epsilon": BUDGET},
            "output": {"dir": str(out), "seed": 0},
        }
    )


def check_run_states_one_certified_epsilon(tmp_path: Path) -> None:
    from userdp import cli
    from userdp.run.launch import run
    from userdp.run.report import read_metrics

    result = run(_config(Path(tmp_path) / "run"), mode="in-process", quiet=True)
    folder = result.run_dir
    header, records = read_ledger(folder / "ledger.jsonl")
    delta = header["budget_delta"]
    phases = group_phases(records)
    certified = compose_epsilon(phases, delta)
    ((mechanism, steps),) = phases
    epochs = balls_in_bins_epochs(mechanism, steps)
    evr = _evr_certified_epsilon(
        mechanism.noise_multiplier,
        mechanism.bins,
        epochs,
        delta,
        bin_semantics=mechanism.bin_semantics,
        correlation=mechanism.correlation,
        seed=query_seed(mechanism, epochs, delta),
    )
    pair = balls_in_bins.dominating_pair(
        mechanism.bins,
        epochs,
        bin_semantics=mechanism.bin_semantics,
        correlation=mechanism.correlation,
    )
    unamplified = gaussian_epsilon(pair.sensitivity / mechanism.noise_multiplier, delta)
    assert mechanism.correlation is not None, "precondition: correlated noise (Monte Carlo EVR)"
    assert certified >= min(evr, unamplified), (
        f"the ledger's ε = {certified:.6g} is below both certified bounds, the ε that "
        f"Estimate-Verify-Release certifies on the query's samples ({evr:.6g}) and the bound "
        f"without amplification ({unamplified:.6g}): the run states an uncertified estimate"
    )
    metrics = [r for r in read_metrics(folder / "metrics.jsonl") if r.get("kind") == "step"]
    stated = {
        "the run's summary": result.epsilon,
        "the last step's metrics": metrics[-1]["epsilon"],
        "model/userdp_release.json": json.loads(
            (folder / "model" / "userdp_release.json").read_text()
        )["epsilon"],
        "privacy_report.json": json.loads((folder / "privacy_report.json").read_text())["epsilon"],
    }
    differ = {k: v for k, v in stated.items() if v != certified}
    assert not differ, (
        f"the ledger's certified ε is {certified!r}, but {differ} state another: the run states "
        "an uncertified estimate or a second ε"
    )
    assert certified <= BUDGET, f"the run's certified ε = {certified:.6g} exceeds its budget"
    curve = [r["epsilon"] for r in metrics if r.get("epsilon") is not None]
    assert curve == sorted(curve), f"per-step ε decreases somewhere: {curve}"
    assert cli.main(["ledger", "verify", str(folder)]) == 0, "userdp ledger verify refused the run"
