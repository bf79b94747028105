"""What the coordinator knows about the data: user -> shard, shard -> sha256, example counts.

Never rows: the coordinator plans tasks by shard ownership and lets the strategy sample units from
user ids (and, for example-level strategies, per-user example counts from the shard indexes).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from userdp.strategies.errors import StrategyError
from userdp.strategies.population import PopulationCounts, parse_example_unit_id


@dataclass(frozen=True)
class Population:
    """What the coordinator knows about the data: user -> shard and shard -> sha256, never rows."""

    shard_of_user: Mapping[str, str]
    shard_sha256: Mapping[str, str]
    examples_of_user: Mapping[str, int] = field(default_factory=dict)
    manifest_sha256: str = ""
    """sha256 of the shard set's ``manifest.json``; workers must hold the same file ("" = not
    checked)."""

    @functools.cached_property
    def users(self) -> tuple[str, ...]:
        """All user ids, in manifest order (computed once)."""
        return tuple(self.shard_of_user)

    @functools.cached_property
    def population_counts(self) -> PopulationCounts:
        """The strategies' view (:class:`~userdp.strategies.base.PopulationCounts`): user ids in
        manifest order and, when known, example counts (converted once)."""
        counts = None
        if self.examples_of_user:
            counts = np.fromiter(
                (int(self.examples_of_user[u]) for u in self.users), np.int64, len(self.users)
            )
        return PopulationCounts(self.users, counts)

    def shard_of_unit(self, unit_id: str) -> str:
        """Shard of a unit: a user id, or ``<user id>/<example index>`` for example units
        (:func:`~userdp.strategies.population.parse_example_unit_id`); KeyError if neither."""
        shard = self.shard_of_user.get(unit_id)
        if shard is not None:
            return shard
        try:
            user, _ = parse_example_unit_id(unit_id)
        except StrategyError:
            raise KeyError(unit_id) from None
        if user in self.shard_of_user:
            return self.shard_of_user[user]
        raise KeyError(unit_id)

    @classmethod
    def from_manifest(
        cls,
        manifest: Any,
        examples_of_user: Mapping[str, int] | None = None,
        manifest_sha256: str = "",
    ) -> Population:
        """From a parsed shard manifest (``userdp.clients.shard_format.Manifest``: ``shards``
        with ``name``/``sha256``, ``user_shards`` user -> shard index); ``examples_of_user`` from
        the shard indexes when example-level strategies need it."""
        names = [entry.name for entry in manifest.shards]
        return cls(
            shard_of_user={u: names[i] for u, i in manifest.user_shards.items()},
            shard_sha256={entry.name: entry.sha256 for entry in manifest.shards},
            examples_of_user=dict(examples_of_user or {}),
            manifest_sha256=manifest_sha256,
        )
