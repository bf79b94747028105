"""The collective data plane checks every member's share, not only the step's total.

- :func:`check_collective_refuses_a_member_that_does_not_clip`: two workers reduce their held
  sums to the real coordinator over a real gloo group (tests/server's loopback harness); worker
  "b" sums its units' gradients unclipped. The cohort is chosen so that b's sum exceeds the
  bound of its own units while the reduced total stays within the step's count·C: only a check
  of each member's share sees it. The coordinator must refuse the step (nothing charged,
  nothing applied), as the gRPC plane refuses such a task's sum (checks_gather.py).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from userdp.server.aggregation import contribution_bound
from userdp.server.coordinator import CoordinatorSettings
from userdp.server.fleet import StepAborted
from userdp.server.group_plane import GroupSettings

from tests.server import harness, toy
from tests.server.standins import uls_strategy

CLIP = 1.0
GROUP = GroupSettings(store_bind="127.0.0.1", timeout_s=60.0)
"""The group's timeout only ends a collective whose member died."""


class UnclippedCompute(toy.ToyCompute):
    """A worker whose engine does not clip: its units' gradients are summed as they are."""

    def compute(self, task):
        result = super().compute(task)
        sums, _ = toy.clipped_sum(task.unit_ids, self.params, math.inf)
        return dataclasses.replace(result, sums=sums)


def _norm(sums) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in sums.values()))


def _hiding_seed(population, honest: set[str]) -> int:
    """A sampler seed whose step-0 cohort lets the unclipped worker hide in the honest one's
    slack: its own sum over its units' bound, the total within the step's count·C."""
    params = toy.initial_params()
    for seed in range(1000):
        cohort = uls_strategy(clip_norm=CLIP, seed=seed).sample_cohort(0, population.users)
        mine = [u for u in cohort.unit_ids if population.shard_of_user[u] in honest]
        theirs = [u for u in cohort.unit_ids if population.shard_of_user[u] not in honest]
        if not mine or not theirs:
            continue
        clipped, _ = toy.clipped_sum(mine, params, CLIP)
        unclipped, _ = toy.clipped_sum(theirs, params, math.inf)
        total = {n: clipped[n] + unclipped[n] for n in clipped}
        if (
            _norm(unclipped) > 1.5 * contribution_bound(len(theirs), CLIP)
            and _norm(total) < 0.8 * len(cohort) * CLIP
        ):
            return seed
    raise AssertionError("precondition: no sampler seed lets an unclipped member hide")


def check_collective_refuses_a_member_that_does_not_clip(tmp_path: Path) -> None:
    population = toy.toy_population(40, 4)
    s0, s1, s2, s3 = sorted(population.shard_sha256)
    seed = _hiding_seed(population, {s0, s1})
    settings = CoordinatorSettings(
        step_deadline_s=120, task_deadline_s=60, worker_startup_s=300, max_step_retries=0
    )
    loop = harness.make_loopback(
        tmp_path,
        strategy=uls_strategy(clip_norm=CLIP, seed=seed),
        population=population,
        settings=settings,
        no_noise=False,
        group=GROUP,
    )
    refused = ""
    try:
        loop.add_worker("a", [s0, s1], toy.ToyCompute())
        loop.add_worker("b", [s2, s3], UnclippedCompute())
        loop.coordinator.wait_for_workers()
        try:
            loop.coordinator.run(1)
        except StepAborted as exc:
            refused = str(exc)
    finally:
        loop.close()
    assert "member b" in refused, (
        "the collective plane released a step in which worker b did not clip: a worker that does "
        "not clip hid in the others' slack under the total's count*clip_norm "
        f"(the step ended with {refused or 'a release'!r})"
    )
    assert list(loop.coordinator.ledger.records) == [], "a refused step was charged"
    for name, value in toy.initial_params().items():
        assert torch.equal(loop.coordinator.params[name], value), f"{name!r} was updated"
