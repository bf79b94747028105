"""Benchmark ``userdp plan --demo --users 32`` at compute budgets 128 and 1024 (a fresh accounting
cache each time, as on a new machine), each beside the accountant's own time for the same plan:
the σ(M) calibrations of the cohorts that plan visited, alone in a child with a fresh cache (the
part of the plan that is accounting; the rest is L(G), 32 users' gradient norms per group size,
and start-up).

Wall seconds and CPU seconds of the child (user + system); medians of ``--repeats`` runs. Prints
JSON, then a markdown table.

    .venv/bin/python benchmarks/plan_cost.py [--repeats 1]
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
BUDGETS = {128: 15.0, 1024: 60.0}  # budget -> goal, wall seconds
USERS = 32

CALIBRATIONS = """
import time
from userdp.accounting.calibration import calibrate_noise_multiplier
from userdp.accounting.mechanisms import UlsMechanism
from userdp.plan.estimators import PLAN_DISCRETIZATION
w, c = time.perf_counter(), time.process_time()
for m in {cohorts}:
    calibrate_noise_multiplier(UlsMechanism(1.0, m / {users}), {epsilon}, {delta}, {steps},
        value_discretization_interval=PLAN_DISCRETIZATION, search_discretization_interval=None)
print(time.perf_counter() - w, time.process_time() - c)
"""


def timed_plan(budget: int, env: dict[str, str]) -> tuple[float, float, dict]:
    """(wall, CPU seconds, the plan's JSON) of one ``userdp plan`` child."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.perf_counter()
    argv = [USERDP, "plan", "--demo", "--compute-budget", str(budget), "--users", str(USERS)]
    done = subprocess.run([*argv, "--json"], check=True, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, json.loads(done.stdout)


def timed_calibrations(plan: dict, env: dict[str, str]) -> tuple[float, float]:
    """(wall, CPU) seconds of the plan's σ(M) calibrations alone, after their imports."""
    code = CALIBRATIONS.format(
        cohorts=sorted(int(m) for m in plan["noise_multipliers"]),
        users=plan["num_users"],
        epsilon=plan["epsilon"],
        delta=plan["delta"],
        steps=plan["steps"],
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env
    )
    wall, cpu = result.stdout.split()[-2:]
    return float(wall), float(cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        demo_cache = tempfile.mkdtemp(dir=tmp)  # the demo shards, written once before timing

        def fresh_cache() -> dict[str, str]:
            cache = tempfile.mkdtemp(dir=tmp)
            for name in os.listdir(demo_cache):
                if name.startswith("demo-"):
                    os.symlink(os.path.join(demo_cache, name), os.path.join(cache, name))
            return {**os.environ, "USERDP_CACHE_DIR": cache}

        timed_plan(128, {**os.environ, "USERDP_CACHE_DIR": demo_cache})
        for budget, goal in BUDGETS.items():
            plans = [timed_plan(budget, fresh_cache()) for _ in range(args.repeats)]
            plan = plans[-1][2]
            anchors = [timed_calibrations(plan, fresh_cache()) for _ in range(args.repeats)]
            wall = statistics.median(w for w, _, _ in plans)
            cpu = statistics.median(c for _, c, _ in plans)
            rows.append(
                {
                    "name": f"userdp plan --demo --compute-budget {budget} --users {USERS}",
                    "wall_s": round(wall, 2),
                    "cpu_s": round(cpu, 2),
                    "goal_wall_s": goal,
                    "met": wall <= goal,
                    "group_sizes": sorted(int(g) for g in plan["norms"]),
                    "cohorts": sorted(int(m) for m in plan["noise_multipliers"]),
                }
            )
            rows.append(
                {
                    "name": f"anchor: its {len(plan['noise_multipliers'])} σ(M) calibrations alone",
                    "wall_s": round(statistics.median(w for w, _ in anchors), 2),
                    "cpu_s": round(statistics.median(c for _, c in anchors), 2),
                }
            )
    load = os.getloadavg()
    print(
        json.dumps({"benchmark": "plan_cost", "repeats": args.repeats, "load": load, "rows": rows})
    )
    print("\n| command | wall s | CPU s | goal | met | L(G) for G | σ(M) for M |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        goal = f"≤ {row['goal_wall_s']} s wall" if "goal_wall_s" in row else "anchor"
        met = {True: "yes", False: "no"}.get(row.get("met"), "")
        sizes = ", ".join(map(str, row.get("group_sizes", [])))
        cohorts = ", ".join(map(str, row.get("cohorts", [])))
        print(
            f"| {row['name']} | {row['wall_s']} | {row['cpu_s']} | {goal} | {met} | {sizes} | {cohorts} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
