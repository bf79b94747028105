"""Benchmark the commands a user runs around a run: ``userdp report RUN`` and ``userdp ledger
verify RUN`` of an 80-step run, ``userdp plan --demo --compute-budget 128 --users 32`` (a fresh
accounting cache each time, as on a new machine) and ``userdp account epsilon`` for per-epoch
balls-in-bins (2^20 samples, b = 128, E = 16), each next to an anchor measured in the same run:

- report: the accountant's own time for the run's ε (dp_accounting's PLD accountant for the same
  (σ, q, T), in process, after its import);
- ledger verify: ``python -c pass``;
- plan: ``python -c "import transformers"`` (the model library the plan builds its model with);
- per-epoch ε: the δ̂ computation alone in process (the accountant's own time).

Wall seconds and CPU seconds of the child (user + system, ``RUSAGE_CHILDREN``); each figure is the
median of ``--repeats`` runs. The 80-step run is simulated in process once first (a tiny GPT-2,
ULS, σ calibrated to ε = 8). Prints JSON, then a markdown table.

    .venv/bin/python benchmarks/aux_commands.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

USERDP = str(Path(sys.executable).parent / "userdp")
STEPS = 80
PER_EPOCH = [
    "account",
    "epsilon",
    "--mechanism",
    "balls-in-bins",
    "--bin-semantics",
    "per-epoch",
    "--noise-multiplier",
    "1.5",
    "--bins",
    "128",
    "--epochs",
    "16",
    "--steps",
    "2048",
    "--delta",
    "1e-5",
    "--estimate",
    "--samples",
    "1048576",
    "--seed",
    "0",
]


def timed_child(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one child process."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def timed_code(code: str) -> tuple[float, float]:
    """(wall, CPU) seconds of ``code`` run in a child after its imports (the anchor's own time):
    the child prints both."""
    result = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    )
    wall, cpu = result.stdout.split()[-2:]
    return float(wall), float(cpu)


REPORT_ANCHOR = """
import time, dp_accounting
from dp_accounting import pld
w, c = time.perf_counter(), time.process_time()
acc = pld.PLDAccountant(value_discretization_interval=1e-4)
acc.compose(dp_accounting.PoissonSampledDpEvent({q}, dp_accounting.GaussianDpEvent({sigma})), {steps})
acc.get_epsilon({delta})
print(time.perf_counter() - w, time.process_time() - c)
"""

PER_EPOCH_ANCHOR = """
import time
from userdp.accounting import balls_in_bins as bb
w, c = time.perf_counter(), time.process_time()
bb.delta_estimate(1.5, 128, 16, 1.0, bin_semantics="per-epoch", num_samples=2**20, seed=0)
print(time.perf_counter() - w, time.process_time() - c)
"""


def eighty_step_run(folder: Path) -> tuple[Path, dict]:
    """A finished 80-step in-process run of a tiny GPT-2 (its folder and its ledger mechanism)."""
    config = folder / "run.toml"
    config.write_text(
        "[data]\ndemo_users = 200\nseq_len = 32\n[model]\npreset = 'gpt2-tiny'\n"
        f"[strategy]\nsteps = {STEPS}\nsampling_prob = 0.05\ngroup_size = 2\n"
        "[privacy]\nepsilon = 8.0\n[workers]\ncount = 1\n"
        f"[output]\ndir = '{folder / 'run'}'\nseed = 0\nsample_count = 0\n"
    )
    subprocess.run(
        [USERDP, "simulate", "--config", str(config), "--in-process", "--quiet"],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    run = folder / "run"
    ledger = [json.loads(line) for line in (run / "ledger.jsonl").read_text().splitlines()]
    report = json.loads((run / "privacy_report.json").read_text())
    return run, {"mechanism": ledger[-1]["mechanism"], "delta": report["delta"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        run, facts = eighty_step_run(folder)
        mech = facts["mechanism"]

        def fresh_cache() -> dict[str, str]:
            return {**os.environ, "USERDP_CACHE_DIR": tempfile.mkdtemp(dir=tmp)}

        cases = [
            (
                "userdp report (80-step run)",
                lambda: timed_child([USERDP, "report", str(run)]),
                ("wall", 5.0),
            ),
            (
                "anchor: dp_accounting ε of the same run (in process, after import)",
                lambda: timed_code(
                    REPORT_ANCHOR.format(
                        q=mech["sampling_prob"],
                        sigma=mech["noise_multiplier"],
                        steps=STEPS,
                        delta=facts["delta"],
                    )
                ),
                None,
            ),
            (
                "userdp ledger verify (80-step run)",
                lambda: timed_child([USERDP, "ledger", "verify", str(run)]),
                ("wall", 5.0),
            ),
            ("anchor: python -c pass", lambda: timed_child([sys.executable, "-c", "pass"]), None),
            (
                "userdp plan --demo --compute-budget 128 --users 32 (fresh cache)",
                lambda: timed_child(
                    [USERDP, "plan", "--demo", "--compute-budget", "128", "--users", "32"],
                    env=fresh_cache(),
                ),
                ("wall", 15.0),
            ),
            (
                "anchor: import transformers",
                lambda: timed_child([sys.executable, "-c", "import transformers"]),
                None,
            ),
            (
                "userdp account epsilon (per-epoch, 2^20)",
                lambda: timed_child([USERDP, *PER_EPOCH]),
                ("cpu", 2.0),
            ),
            ("anchor: per-epoch δ̂ alone (in process)", lambda: timed_code(PER_EPOCH_ANCHOR), None),
        ]
        rows = []
        for name, measure, goal in cases:
            samples = [measure() for _ in range(args.repeats)]
            wall = statistics.median(w for w, _ in samples)
            cpu = statistics.median(c for _, c in samples)
            row = {"name": name, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2)}
            if goal is not None:  # (what is bounded, the bound): anchors have none
                kind, limit = goal
                measured = wall if kind == "wall" else cpu
                row.update({f"goal_{kind}_s": limit, "met": measured <= limit})
            rows.append(row)
    load = os.getloadavg()
    print(
        json.dumps(
            {"benchmark": "aux_commands", "repeats": args.repeats, "load": load, "rows": rows}
        )
    )
    print("\n| command | wall s | CPU s | goal | met |\n|---|---|---|---|---|")
    for row in rows:
        goal = (
            f"≤ {row['goal_wall_s']} s wall"
            if "goal_wall_s" in row
            else f"≤ {row['goal_cpu_s']} CPU s"
            if "goal_cpu_s" in row
            else "anchor"
        )
        met = {True: "yes", False: "no"}.get(row.get("met"), "")
        print(f"| {row['name']} | {row['wall_s']} | {row['cpu_s']} | {goal} | {met} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
