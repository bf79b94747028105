"""Task planning: split a step's cohort by shard, and batch shard groups into one task per worker.

The unit of re-issue is a *shard group*: the cohort's units that live in one shard. Any worker
holding a replica of that shard can compute it. A *task* sent to a worker batches all the shard
groups assigned to that worker for the step (one message, one partial sum). When a task fails
(its worker dies, is too slow, refuses it, or sends a bad partial), its groups go back to the
pending pool and are re-batched onto other holders under a new task id, with the attempt number
of the groups' previous tries + 1 (exactly-once bookkeeping in :mod:`userdp.server.aggregation`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ShardGroup:
    """The units of one shard for one step; ``group_id`` is ``<step>/<shard>``."""

    group_id: str
    step: int
    shard: str
    unit_ids: tuple[str, ...]


class PlanningError(RuntimeError):
    """A unit's shard is unknown (the cohort is not from this run's manifest)."""


def plan_groups(
    step: int, unit_ids: Sequence[str], shard_of_unit: Callable[[str], str]
) -> list[ShardGroup]:
    """Group ``unit_ids`` by shard (keeping cohort order inside a shard), one group per shard."""
    by_shard: dict[str, list[str]] = defaultdict(list)
    for unit in unit_ids:
        try:
            shard = shard_of_unit(unit)
        except KeyError as exc:
            raise PlanningError(f"step {step}: unit {unit!r} has no shard ({exc})") from None
        by_shard[shard].append(unit)
    return [
        ShardGroup(group_id=f"{step}/{shard}", step=step, shard=shard, unit_ids=tuple(units))
        for shard, units in sorted(by_shard.items())
    ]


def choose_worker(
    shard: str,
    holders: Mapping[str, Iterable[str]],
    load: Mapping[str, int],
    exclude: Iterable[str] = (),
) -> str | None:
    """The least-loaded worker (ties: smallest id) among ``holders`` that holds ``shard`` and is
    not excluded; None when no such worker is available."""
    excluded = set(exclude)
    candidates = [
        worker for worker, shards in holders.items() if worker not in excluded and shard in shards
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda w: (load.get(w, 0), w))


def assign_groups(
    groups: Sequence[ShardGroup],
    holders: Mapping[str, Iterable[str]],
    load: Mapping[str, int] | None = None,
    exclude: Callable[[str], Iterable[str]] = lambda group_id: (),
) -> tuple[dict[str, list[ShardGroup]], list[ShardGroup]]:
    """Greedy balanced assignment, largest group first: worker -> its groups, plus the groups no
    available (non-excluded) worker holds."""
    holder_sets = {w: set(s) for w, s in holders.items()}
    current: dict[str, int] = defaultdict(int, load or {})
    assigned: dict[str, list[ShardGroup]] = defaultdict(list)
    orphans: list[ShardGroup] = []
    for group in sorted(groups, key=lambda g: (-len(g.unit_ids), g.group_id)):
        worker = choose_worker(group.shard, holder_sets, current, exclude(group.group_id))
        if worker is None:
            orphans.append(group)
            continue
        assigned[worker].append(group)
        current[worker] += len(group.unit_ids)
    return dict(assigned), orphans
