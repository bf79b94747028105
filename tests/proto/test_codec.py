"""The result codec: a worker's statistics arrive at the coordinator unchanged."""

from __future__ import annotations

from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.codec import result_from_proto, result_proto
from userdp.proto.results import TaskSum
from userdp.strategies.unit_stats import UnitStats


def test_result_statistics_round_trip():
    stats = UnitStats(
        count=3,
        nonfinite=1,
        clipped=2,
        norm_min=0.25,
        norm_max=4.0,
        norm_sum=5.5,
        norm_sum_sq=17.0625,
        loss_sum=12.5,
        tokens=40,
    )
    task = pb.Task(task_id="3.1", attempt=2, step=3, model_version=9, unit_ids=["a", "b/0"])
    result = result_proto(task, TaskSum(sums={}, stats=stats, skipped_examples=5), 1.5)
    received = result_from_proto(result, "worker-1", {})
    assert received.task_sum.stats == stats
    assert (received.task_id, received.attempt, received.step, received.model_version) == (
        "3.1",
        2,
        3,
        9,
    )
    assert received.unit_ids == ("a", "b/0") and received.compute_seconds == 1.5
    assert received.worker_id == "worker-1"
