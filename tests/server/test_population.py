"""Population.shard_of_unit: user ids and example unit ids ``"<user id>/<index>"``."""

from __future__ import annotations

import pytest
from userdp.server.population import Population


def test_shard_of_user_and_example_units_and_unknown_units():
    population = Population(
        shard_of_user={"alice": "s0", "org/bob": "s1"}, shard_sha256={"s0": "0", "s1": "1"}
    )
    assert population.shard_of_unit("alice") == "s0"
    assert population.shard_of_unit("alice/3") == "s0"
    assert population.shard_of_unit("org/bob") == "s1"
    assert population.shard_of_unit("org/bob/0") == "s1"
    for unknown in ("carol", "carol/0", "alice/x", "alice/"):
        with pytest.raises(KeyError):
            population.shard_of_unit(unknown)
