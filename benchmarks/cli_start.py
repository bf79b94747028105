"""Benchmark the command line's start-up: CPU seconds of ``userdp --help``, ``userdp account
epsilon --help`` (everything before the accountant computes) and a whole ``userdp account
epsilon`` query, next to anchors measured in the same run: a bare ``python -c pass`` and
``python -c "import dp_accounting"`` (the library the accountant itself needs).

CPU seconds (user + system of the child, ``getrusage(RUSAGE_CHILDREN)``) rather than wall time:
on a shared machine they are the fairer number. Each figure is the median of ``--repeats`` runs.
Prints JSON, then a markdown table.

    .venv/bin/python benchmarks/cli_start.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
from pathlib import Path

USERDP = str(Path(sys.executable).parent / "userdp")
QUERY = [
    "account",
    "epsilon",
    "--mechanism",
    "uls",
    "--noise-multiplier",
    "1",
    "--steps",
    "1000",
    "--sampling-prob",
    "0.01",
    "--delta",
    "1e-6",
]

# (name, argv, goal in CPU seconds or None for anchors)
CASES: tuple[tuple[str, list[str], float | None], ...] = (
    ("python -c pass (anchor)", [sys.executable, "-c", "pass"], None),
    ("import dp_accounting (anchor)", [sys.executable, "-c", "import dp_accounting"], None),
    ("userdp --help", [USERDP, "--help"], 0.5),
    ("userdp account epsilon --help", [USERDP, "account", "epsilon", "--help"], 1.0),
    ("userdp account epsilon (uls, T=1000)", [USERDP, *QUERY], None),
)


def cpu_seconds(argv: list[str]) -> float:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    rows = []
    for name, command, goal in CASES:
        cpu_seconds(command)  # warm the page cache and .pyc files
        runs = [cpu_seconds(command) for _ in range(args.repeats)]
        median = statistics.median(runs)
        rows.append(
            {
                "case": name,
                "cpu_s_median": round(median, 3),
                "cpu_s_min": round(min(runs), 3),
                "goal_cpu_s": goal,
                "goal_met": None if goal is None else median <= goal,
            }
        )
    print(json.dumps({"benchmark": "cli_start", "repeats": args.repeats, "rows": rows}))
    print()
    print("| case | CPU s (median) | CPU s (min) | goal |")
    print("|---|---|---|---|")
    for row in rows:
        goal = "anchor" if row["goal_cpu_s"] is None else f"≤ {row['goal_cpu_s']} s"
        if row["goal_met"] is not None:
            goal += " (met)" if row["goal_met"] else " (NOT met)"
        print(f"| {row['case']} | {row['cpu_s_median']} | {row['cpu_s_min']} | {goal} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
