"""UnitStats: the union of two sets of units' statistics."""

from __future__ import annotations

import math

from userdp.strategies.unit_stats import UnitStats


def test_sum_of_units_counts_sums_and_takes_norm_extremes_over_finite_units_only():
    first = UnitStats.finite_unit(2.0, clip_norm=1.0, loss_sum=3.0, tokens=4)
    second = UnitStats.finite_unit(0.5, clip_norm=1.0, loss_sum=1.0, tokens=2)
    broken = UnitStats(nonfinite=1)
    total = sum([broken, first, broken, second], UnitStats())
    assert total == UnitStats(
        count=2,
        nonfinite=2,
        clipped=1,
        norm_min=0.5,
        norm_max=2.0,
        norm_sum=2.5,
        norm_sum_sq=4.25,
        loss_sum=4.0,
        tokens=6,
    )
    assert total.loss_mean == 4.0 / 6


def test_no_finite_unit_has_zero_norm_extremes_and_no_loss_mean():
    empty = UnitStats(nonfinite=1) + UnitStats()
    assert (empty.norm_min, empty.norm_max) == (0.0, 0.0)
    assert math.isnan(empty.loss_mean)
