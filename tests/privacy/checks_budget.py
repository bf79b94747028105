"""The budget is checked before a step's work (:func:`userdp.strategies.step.begin_step`).

The contract (docs/privacy.md, "The privacy ledger"): once one more step would take ε over the
ledger's budget, no cohort is sampled and no worker computes. The ledger's own ``append`` also
refuses such a step, but only after its cohort was sampled and its clipped sums computed; a run
that relies on that refusal alone ends with the same ledger and the same released model, which
is why the checks below count the work itself:

- :func:`check_inprocess_budget_stops_before_sampling`: the reference step loop
  (:mod:`userdp.strategies.local_step`) under a budget that admits exactly two steps;
- :func:`check_coordinator_budget_stops_before_tasks`: the real coordinator over loopback gRPC
  with a worker, under the same budget.

Each records every ``sample_cohort`` call and every computed task: the refused step must have
neither, and the ledger must hold exactly the admitted steps.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from userdp.accounting import UlsMechanism, epsilon
from userdp.accounting.ledger import BudgetExceededError, Ledger
from userdp.strategies.builtins import UserLevelSampling
from userdp.strategies.local_step import run_local_step
from userdp.strategies.noise import GaussianNoise, NoiseRng
from userdp.strategies.unit_stats import UnitStats

from tests.server import toy
from tests.server.harness import make_loopback

SIGMA = 1.0
Q = 0.3
DELTA = 1e-5
ADMITTED = 2
"""Steps the budget admits: ε(3 steps) is well above ε(2 steps)·1.001, the budget."""
ASKED = 6


def _budget() -> float:
    return epsilon(UlsMechanism(noise_multiplier=SIGMA, sampling_prob=Q), ADMITTED, DELTA) * 1.001


class _SamplingLog:
    """Wraps a strategy's ``sample_cohort`` and records the step of every call."""

    def __init__(self, strategy: UserLevelSampling) -> None:
        self.steps: list[int] = []
        inner = strategy.sample_cohort

        def sample_cohort(step, population):
            self.steps.append(int(step))
            return inner(step, population)

        strategy.sample_cohort = sample_cohort


def _strategy() -> UserLevelSampling:
    return UserLevelSampling(
        noise_multiplier=SIGMA,
        clip_norm=1.0,
        sampling_prob=Q,
        seed=3,
        noise=GaussianNoise(NoiseRng.for_testing(3)),
    )


def _assert_stopped_before_work(where: str, sampled: list[int], computed: list[int]) -> None:
    refused = sorted({s for s in sampled + computed if s >= ADMITTED})
    assert not refused, (
        f"{where}: the budget admits steps 0..{ADMITTED - 1}, but step(s) {refused} were sampled "
        f"(sample_cohort calls: {sampled}) or computed (tasks of steps {sorted(set(computed))}): "
        "the budget must be checked before the step's cohort is sampled and any worker computes"
    )
    assert sampled == list(range(ADMITTED)), (
        f"{where}: sample_cohort ran for steps {sampled}; expected exactly the admitted steps "
        f"0..{ADMITTED - 1}"
    )


def check_inprocess_budget_stops_before_sampling(tmp_path: Path) -> None:
    """The reference loop under a budget of two steps: the third step raises
    BudgetExceededError with nothing sampled or computed for it."""
    strategy = _strategy()
    sampling = _SamplingLog(strategy)
    computed: list[int] = []
    current = {"step": -1}

    def compute(task, unit_ids, params):
        computed.append(current["step"])
        return {n: np.zeros_like(v) for n, v in params.items()}, UnitStats(count=len(unit_ids))

    users = [f"user-{i}" for i in range(40)]
    params = {"w": np.zeros(4)}
    path = Path(tmp_path) / "ledger.jsonl"
    stopped_at = None
    with Ledger.create(path, budget_epsilon=_budget(), delta=DELTA) as ledger:
        for step in range(ASKED):
            current["step"] = step
            try:
                run_local_step(strategy, step, params, users, compute, ledger=ledger)
            except BudgetExceededError:
                stopped_at = step
                break
        charged = [int(r["step"]) for r in ledger.records]
    assert stopped_at == ADMITTED and charged == list(range(ADMITTED)), (
        f"in-process: the run stopped at step {stopped_at} with steps {charged} charged; "
        f"expected a BudgetExceededError at step {ADMITTED} after steps 0..{ADMITTED - 1}"
    )
    _assert_stopped_before_work("in-process", sampling.steps, computed)


class _CountingCompute(toy.ToyCompute):
    """The transport tests' toy worker compute, recording the step of every task it computes."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[int] = []

    def compute(self, task):
        self.steps.append(int(task.step))
        return super().compute(task)


def check_coordinator_budget_stops_before_tasks(tmp_path: Path) -> None:
    """The real coordinator (loopback gRPC, one worker) asked for six steps under a budget of
    two: it stops with ``budget_exhausted`` before step 2, having neither sampled step 2's cohort
    nor sent a worker a task of it."""
    from tests.server.standins import open_ledger

    population = toy.toy_population()
    strategy = _strategy()
    sampling = _SamplingLog(strategy)
    ledger = open_ledger(Path(tmp_path) / "ledger.jsonl", budget_epsilon=_budget(), delta=DELTA)
    loop = make_loopback(tmp_path, strategy=strategy, ledger=ledger, population=population)
    compute = _CountingCompute()
    try:
        loop.add_worker("w0", list(population.shard_sha256), compute)
        loop.coordinator.wait_for_workers()
        reports = loop.coordinator.run(ASKED)
    finally:
        loop.close()
    charged = [int(r["step"]) for r in ledger.records]
    assert loop.coordinator.budget_exhausted and charged == list(range(ADMITTED)), (
        f"coordinator: {len(reports)} step(s) reported, steps {charged} charged, "
        f"budget_exhausted={loop.coordinator.budget_exhausted}; expected a stop before step "
        f"{ADMITTED}"
    )
    _assert_stopped_before_work("coordinator", sampling.steps, compute.steps)
