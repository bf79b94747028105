"""The population a strategy samples from, as the coordinator knows it: user ids in a stable
order and, for example-level strategies, how many examples each user has; never rows.

An example unit (ELS, one example of the capped subset D_sub) is named ``"<user id>/<example
index>"`` (:func:`example_unit_id`); :func:`parse_example_unit_id` is its one parser, used by the
coordinator to find a unit's shard (``userdp.server.population.Population``) and by the worker to
select the example.

The names of the data selection strategies (which of a user's records a unit uses; their
definitions are in :mod:`userdp.clients.selection`) live here, below both the strategies that
build D_sub and the workers that read the records.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from userdp.strategies.errors import StrategyError

__all__ = [
    "EXAMPLE_UNIT_SELECTIONS",
    "PERPLEXITY_SELECTIONS",
    "RANKED_SELECTIONS",
    "SELECTION_STRATEGIES",
    "PopulationCounts",
    "as_population",
    "example_unit_id",
    "parse_example_unit_id",
]

PERPLEXITY_SELECTIONS: tuple[str, ...] = ("highest_ppl", "lowest_ppl")
"""The strategies that rank a user's examples by their perplexity under the initial model."""
RANKED_SELECTIONS: tuple[str, ...] = ("longest", "shortest", *PERPLEXITY_SELECTIONS)
"""The deterministic strategies: a user's first ``group_size`` examples in a fixed order."""
EXAMPLE_UNIT_SELECTIONS: tuple[str, ...] = ("random", *RANKED_SELECTIONS)
"""The strategies that choose whole records, so example units (ELS, group privacy) can use them."""
SELECTION_STRATEGIES: tuple[str, ...] = (*EXAMPLE_UNIT_SELECTIONS, "random_chunk")
"""Every data selection strategy (``random_chunk`` cuts windows across records: user units only)."""


@dataclass(frozen=True)
class PopulationCounts:
    """What the coordinator knows about the data: user ids and, for example units, counts.

    ``user_ids`` is the manifest order (a sampler's randomness is drawn over positions in it, so
    the order must be stable across a run and a resume). ``examples_per_user`` is needed only by
    example-level strategies (ELS, Alg. 1's D_sub); it is an int array aligned with ``user_ids``.
    """

    user_ids: Sequence[str]
    examples_per_user: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.user_ids)

    def require_examples(self, who: str) -> np.ndarray:
        if self.examples_per_user is None:
            raise StrategyError(
                f"{who} needs the number of examples per user; pass a population with "
                "examples_of_user (user id -> n_examples), not just user ids"
            )
        return self.examples_per_user


def as_population(population: Any) -> PopulationCounts:
    """Accept what callers have: a PopulationCounts, a sequence of user ids, a mapping
    ``user id -> n_examples``, or an object with a ``population_counts`` attribute
    (``userdp.server.population.Population``, which converts itself once)."""
    if isinstance(population, PopulationCounts):
        return population
    counts = getattr(population, "population_counts", None)
    if isinstance(counts, PopulationCounts):
        return counts
    if isinstance(population, Mapping):
        users = tuple(population)
        values = np.fromiter((int(population[u]) for u in users), dtype=np.int64, count=len(users))
        return PopulationCounts(users, values)
    if isinstance(population, Sequence) and not isinstance(population, str | bytes):
        return PopulationCounts(population)
    raise StrategyError(
        f"population={type(population).__name__} is not allowed; expected user ids, a mapping "
        "user id -> n_examples, or a userdp.server.population.Population"
    )


def example_unit_id(user_id: str, example_index: int) -> str:
    """The unit id of one example of D_sub: ``"<user id>/<example index>"``."""
    return f"{user_id}/{int(example_index)}"


def parse_example_unit_id(unit_id: str) -> tuple[str, int]:
    """Inverse of :func:`example_unit_id` (user ids may themselves contain ``/``)."""
    user, sep, index = unit_id.rpartition("/")
    if not sep or not index.isdigit():
        raise StrategyError(f"unit id {unit_id!r} is not an example unit '<user id>/<index>'")
    return user, int(index)
