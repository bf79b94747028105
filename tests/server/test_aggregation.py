"""StepGather: at most one partial per task, the current attempt only, validated."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from userdp.proto.results import TaskResult, TaskSum
from userdp.server.aggregation import ExactlyOnceViolation, StepGather, TensorSpec
from userdp.server.planning import ShardGroup, assign_groups, choose_worker, plan_groups
from userdp.server.sum_plane import SumArrival
from userdp.strategies.unit_stats import UnitStats

TEMPLATE = {"w": TensorSpec((3,), "float32")}


def _gather():
    groups = [ShardGroup("7/a", 7, "a", ("u1", "u2")), ShardGroup("7/b", 7, "b", ("u3",))]
    return StepGather(7, 4, groups, TEMPLATE, clip_norm=1.0)


def _partial(task_id, attempt, worker, units, value=0.1, **kw):
    fields = dict(
        task_id=task_id,
        attempt=attempt,
        step=7,
        model_version=4,
        worker_id=worker,
        unit_ids=units,
        sums={"w": torch.full((3,), value)},
        stats=UnitStats(count=len(units)),
    )
    fields.update(kw)
    task_sum = TaskSum(fields.pop("sums"), fields.pop("stats"))
    return TaskResult(**fields, task_sum=task_sum)


def test_duplicates_closed_tasks_and_other_steps_are_discarded():
    g = _gather()
    first, attempt = g.issue("w1", ["7/a"], 0.0)
    assert attempt == 0
    assert g.fail(first, 0, "timeout")
    second, attempt = g.issue("w2", ["7/a"], 1.0)
    assert attempt == 1 and second != first
    late = g.offer(_partial(first, 0, "w1", ("u1", "u2")))
    assert not late.accepted and not late.reissue and "closed" in late.reason
    spoof = g.offer(_partial(second, 1, "w1", ("u1", "u2")))
    assert not spoof.accepted and "issued to w2" in spoof.reason
    other_step = g.offer(_partial("6.0", 0, "w2", ("u1", "u2"), step=6))
    assert not other_step.accepted and not other_step.reissue
    assert "late result" in other_step.reason
    closed_other_step = g.offer(_partial(first, 0, "w1", ("u1", "u2"), step=6))
    assert not closed_other_step.accepted and not closed_other_step.reissue
    assert g.offer(_partial(second, 1, "w2", ("u1", "u2"))).accepted
    dup = g.offer(_partial(second, 1, "w2", ("u1", "u2")))
    assert not dup.accepted and "closed" in dup.reason
    assert not g.complete()
    third, _ = g.issue("w2", ["7/b"], 2.0)
    assert g.offer(_partial(third, 0, "w2", ("u3",), value=0.2)).accepted
    result = g.result()
    torch.testing.assert_close(result.sums["w"], torch.full((3,), 0.3, dtype=torch.float64))
    assert g.units_counted == 3 and g.attempts == 3 and g.failed_tasks == 1
    assert result.stats.count == 3


def test_a_live_task_answered_with_another_step_label_is_rejected_and_reissued():
    """The task's own worker answered it: waiting for another answer would last until the
    task's deadline, so the task fails at once and its groups go back to pending."""
    g = _gather()
    task, _ = g.issue("w1", ["7/a"], 0.0)
    # another worker or attempt cannot fail someone else's task with a wrong label
    assert not g.offer(_partial(task, 0, "w2", ("u1", "u2"), step=6)).reissue
    assert not g.offer(_partial(task, 1, "w1", ("u1", "u2"), step=6)).reissue
    assert [x.group_id for x in g.pending()] == ["7/b"]
    verdict = g.offer(_partial(task, 0, "w1", ("u1", "u2"), step=6))
    assert not verdict.accepted and verdict.reissue
    assert verdict.reason == f"result labelled step 6 for task {task} of step 7"
    assert [x.group_id for x in g.pending()] == ["7/a", "7/b"]
    assert g.failed_workers("7/a") == {"w1"}
    late = g.offer(_partial(task, 0, "w1", ("u1", "u2")))  # the task is closed for good
    assert not late.accepted and not late.reissue and "closed" in late.reason
    retry, attempt = g.issue("w2", ["7/a", "7/b"], 1.0)
    assert attempt == 1
    assert g.offer(_partial(retry, 1, "w2", ("u1", "u2", "u3"))).accepted
    assert g.units_counted == 3 and g.failed_tasks == 1


def test_batched_task_failure_returns_every_group_to_pending():
    g = _gather()
    task, _ = g.issue("w1", ["7/a", "7/b"], 0.0)
    assert g.task_units(task) == ("u1", "u2", "u3")
    with pytest.raises(ValueError):
        g.issue("w2", ["7/a"], 0.0)  # already in a live task
    assert g.fail_worker("w1") == [task]
    assert [x.group_id for x in g.pending()] == ["7/a", "7/b"]
    assert g.failed_workers("7/b") == {"w1"}
    retry, attempt = g.issue("w2", ["7/a", "7/b"], 1.0)
    assert attempt == 1
    assert g.offer(_partial(retry, 1, "w2", ("u1", "u2", "u3"))).accepted
    assert g.complete()


@pytest.mark.parametrize(
    "change, reason",
    [
        (dict(unit_ids=("u1",)), "unit ids"),
        (dict(unit_ids=("u1", "u3")), "unit ids"),
        (dict(stats=UnitStats(count=1)), "count"),
        (dict(model_version=3), "model version"),
        (dict(sums={"w": torch.zeros(4)}), "shape"),
        (dict(sums={"w": torch.zeros(3, dtype=torch.float64)}), "dtype"),
        (dict(sums={"w": torch.tensor([0.0, float("inf"), 0.0])}), "non-finite"),
        (dict(sums={"v": torch.zeros(3)}), "names"),
        (dict(sums={"w": torch.full((3,), 2.0)}), "not clipped"),
    ],
)
def test_bad_partials_are_rejected_and_go_back_to_pending(change, reason):
    g = _gather()
    task, _ = g.issue("w1", ["7/a"], 0.0)
    fields = dict(unit_ids=("u1", "u2"))
    fields.update(change)
    units = fields.pop("unit_ids")
    verdict = g.offer(_partial(task, 0, "w1", units, **fields))
    assert not verdict.accepted and verdict.reissue and reason in verdict.reason
    assert [x.group_id for x in g.pending()] == ["7/a", "7/b"]
    assert g.failed_workers("7/a") == {"w1"}


def test_incomplete_step_has_no_result_and_planning_overlap_is_refused():
    g = _gather()
    with pytest.raises(RuntimeError):
        g.result()
    groups = [ShardGroup("1/a", 1, "a", ("u1",)), ShardGroup("1/b", 1, "b", ("u1",))]
    with pytest.raises(ExactlyOnceViolation):
        StepGather(1, 0, groups, TEMPLATE, 1.0)


def test_planning_groups_by_shard_and_balances_replicas():
    shard = {"u1": "a", "u2": "b", "u3": "a", "u4": "c"}
    groups = plan_groups(3, ["u1", "u2", "u3", "u4"], shard.__getitem__)
    assert [(g.group_id, g.unit_ids) for g in groups] == [
        ("3/a", ("u1", "u3")),
        ("3/b", ("u2",)),
        ("3/c", ("u4",)),
    ]
    assigned, orphans = assign_groups(groups, {"w1": {"a", "b"}, "w2": {"b"}})
    assert {w: [g.group_id for g in gs] for w, gs in assigned.items()} == {
        "w1": ["3/a"],
        "w2": ["3/b"],
    }
    assert [g.group_id for g in orphans] == ["3/c"]
    assert choose_worker("b", {"w1": {"b"}, "w2": {"b"}}, {"w1": 5}, exclude=()) == "w2"
    assert choose_worker("b", {"w1": {"b"}}, {}, exclude={"w1"}) is None


@pytest.mark.parametrize("probes", [0, 32])
def test_count_times_c_bound_is_checked_and_widened_for_estimated_norms(probes):
    groups = [ShardGroup("7/a", 7, "a", ("u1",))]
    g = StepGather(7, 4, groups, TEMPLATE, clip_norm=1.0, estimate_probes=probes)
    task, _ = g.issue("w1", ["7/a"], 0.0)
    over = g.offer(_partial(task, 0, "w1", ("u1",), value=1.5))  # norm 2.6 > 1·C
    assert over.accepted == bool(probes)  # within 1·C·z* (z* ≈ 2.76 for k = 32, one unit)
    if not probes:
        assert "exceeds count*clip_norm" in over.reason


def test_estimated_norms_still_reject_a_worker_that_does_not_clip():
    """Randomized clipping: an honest unit contributes C·Z with Z ≤ z* except with probability
    1e-9 under the accountant's envelope; an unclipped gradient (here 20·C) is rejected."""
    from scipy import stats
    from userdp.server.aggregation import contribution_bound

    z_star = (32 / stats.chi2.ppf(1e-9, 32)) ** 0.5
    assert contribution_bound(1, 1.0, 32) == pytest.approx(z_star * (1 + 1e-3) + 1e-6)
    assert 2.7 < z_star < 2.8 and contribution_bound(1, 1.0) == pytest.approx(1.001 + 1e-6)
    # honest units: their estimated-norm contributions C·√(k/χ²_k) stay below the bound
    rng = np.random.default_rng(0)
    honest = np.sqrt(32 / rng.chisquare(32, size=(2000, 50)))
    assert np.all(honest.sum(axis=1) <= contribution_bound(50, 1.0, 32))
    groups = [ShardGroup("7/a", 7, "a", ("u1",))]
    g = StepGather(7, 4, groups, TEMPLATE, clip_norm=1.0, estimate_probes=32)
    task, _ = g.issue("w1", ["7/a"], 0.0)
    unclipped = g.offer(_partial(task, 0, "w1", ("u1",), value=20.0))
    assert not unclipped.accepted and "norm estimates" in unclipped.reason


def test_estimated_norms_still_reject_non_finite_partials():
    groups = [ShardGroup("7/a", 7, "a", ("u1",))]
    g = StepGather(7, 4, groups, TEMPLATE, clip_norm=1.0, estimate_probes=32)
    task, _ = g.issue("w1", ["7/a"], 0.0)
    bad = g.offer(_partial(task, 0, "w1", ("u1",), value=float("nan")))
    assert not bad.accepted and "non-finite" in bad.reason


def test_a_reduced_sum_is_checked_member_by_member():
    """The collective plane: a member's share over the bound of the units accepted from it is
    refused even when the total is within the step's bound (the other member's slack), and so
    is a member that holds accepted sums but reported no norm; within every bound it is taken."""

    def held_gather():
        groups = [ShardGroup("7/a", 7, "a", ("u1", "u2")), ShardGroup("7/b", 7, "b", ("u3",))]
        g = StepGather(7, 4, groups, TEMPLATE, clip_norm=1.0, arrival=SumArrival.REDUCED)
        task_a, _ = g.issue("w1", ["7/a"], 0.0)  # two units: bound 2·C
        task_b, _ = g.issue("w2", ["7/b"], 0.0)  # one unit: bound 1·C
        for task, worker, units in ((task_a, "w1", ("u1", "u2")), (task_b, "w2", ("u3",))):
            held = _partial(task, 0, worker, units, held=True, sums={})
            assert g.offer(held).accepted
        return g

    total = {"w": torch.tensor([1.5, 0.0, 0.0])}  # within 3·C
    refused = held_gather().offer_reduced(total, {"w1": 0.1, "w2": 1.5})
    assert refused is not None and "member w2" in refused and "exceeds" in refused
    missing = held_gather().offer_reduced(total, {"w1": 0.1})
    assert missing is not None and "member w2: no norm" in missing
    nan = held_gather().offer_reduced(total, {"w1": 0.1, "w2": float("nan")})
    assert nan is not None and "member w2" in nan
    g = held_gather()
    assert g.offer_reduced(total, {"w1": 1.9, "w2": 0.9, "w3": 0.0}) is None
    assert torch.equal(g.result().sums["w"], total["w"])
