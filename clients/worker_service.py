"""The worker's compute behind the gRPC client: a task's units -> their examples -> the clipping
engine's sum of clipped unit gradients, on the model version the coordinator broadcast.

:class:`EngineCompute` implements :class:`userdp.clients.task_runner.TaskCompute`:

- ``apply_model``: copies received tensors into the model's parameters by name (a full model
  replaces every parameter it names; an update only the trainable ones it carries).
- ``compute(task)``: the wire task is decoded by :func:`userdp.proto.codec.task_from_proto`. For
  unit = user, the user's examples are selected with the task's selection strategy and group size
  (:func:`userdp.clients.selection.select_examples`), with an RNG seeded from (selection_seed,
  step, unit id) — never from anything that touches noise; for unit = example
  (``"<user id>/<index>"``, :func:`userdp.proto.codec.parse_example_unit_id`), that one example.
  ``highest_ppl`` / ``lowest_ppl`` rank a user's examples by the perplexities
  :func:`build_compute` scored ONCE with the model as built, before any broadcast is applied
  (:mod:`userdp.clients.perplexity`); a worker started without them fails such a task.
  The task reaches the engine as one :class:`userdp.clients.engine_request.EngineRequest`
  (:meth:`EngineRequest.of_task`). The engine returns the plain SUM of clipped unit gradients
  and its statistics; normalization and noise are the coordinator's. In a worker of N ranks
  every rank calls it with the same task and the engine's sum is their collective
  (:mod:`userdp.clients.ranks`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from userdp.clients.distributed import raise_if_any_rank_failed, world
from userdp.clients.engine import Unit, build_engine
from userdp.clients.engine_request import EngineRequest
from userdp.clients.model import load_parameters
from userdp.clients.perplexity import ExamplePerplexities, example_perplexities
from userdp.clients.selection import (
    PERPLEXITY_SELECTIONS,
    MissingPerplexityError,
    example_at,
    select_examples,
)
from userdp.clients.shard_store import ShardStore
from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.codec import WorkerTask, parse_example_unit_id, task_from_proto
from userdp.proto.results import TaskSum
from userdp.proto.tensors import WireTensor


def _selection_rng(seed: int, step: int, unit_id: str) -> np.random.Generator:
    unit_hash = int.from_bytes(hashlib.sha256(unit_id.encode()).digest()[:8], "big")
    return np.random.default_rng([seed, step, unit_hash])


class EngineCompute:
    """Task compute over a :class:`ShardStore` and a clipping engine (see the module docstring).

    ``engine`` must offer ``run(request)`` (one :class:`EngineRequest` per task) and
    ``trainable_parameters()`` / ``module`` as :mod:`userdp.clients.engine` defines them;
    ``unit_type`` is the engine's unit value class (unit id + token arrays). ``perplexities``:
    every example's perplexity under the initial model, needed by the perplexity-based
    selections only."""

    def __init__(
        self,
        store: ShardStore,
        engine: Any,
        unit_type: Any,
        perplexities: ExamplePerplexities | None = None,
    ) -> None:
        self.store = store
        self.engine = engine
        self.unit_type = unit_type
        self.perplexities = perplexities

    def apply_model(self, tensors: Mapping[str, WireTensor], full: bool) -> None:
        """Copy received tensors into the model by name; an unknown name is a KeyError and
        nothing is copied."""
        load_parameters(self.engine.module, {name: t.torch() for name, t in tensors.items()})

    def _units(self, task: WorkerTask) -> list[Any]:
        units = []
        for unit_id in task.unit_ids:
            if task.unit == "example":
                user, index = parse_example_unit_id(unit_id)
                example = example_at(
                    self.store.user_examples(user),
                    index,
                    task.selection,
                    task.seq_len,
                    perplexities=self._perplexities(task.selection, user),
                    group_size=task.group_size,
                )
                examples = [example]
            else:
                rng = _selection_rng(task.selection_seed, task.step, unit_id)
                examples = select_examples(
                    self.store.user_examples(unit_id),
                    task.group_size,
                    task.selection,
                    task.seq_len,
                    rng,
                    perplexities=self._perplexities(task.selection, unit_id),
                )
            units.append(self.unit_type(unit_id, examples))
        return units

    def _perplexities(self, selection: str, user_id: str) -> np.ndarray | None:
        if selection not in PERPLEXITY_SELECTIONS:
            return None
        if self.perplexities is None:
            raise MissingPerplexityError(
                f"the task asks for data.selection = {selection!r}, but this worker scored no "
                "perplexities: a worker scores them at start only when its own config says "
                "data.selection = 'highest_ppl' or 'lowest_ppl'; start it with the run's config"
            )
        return self.perplexities.of_user(user_id)

    def compute(self, task: pb.Task) -> TaskSum:
        """The task's clipped sum. With world size > 1 every rank of the worker calls this with
        the same task (:mod:`userdp.clients.ranks`); the ranks agree that each read the units
        before the engine's collective, so a rank that cannot read them fails the task on every
        rank instead of leaving the others waiting in the sum."""
        error: Exception | None = None
        try:
            decoded = task_from_proto(task)
            units = self._units(decoded)
        except Exception as exc:  # noqa: BLE001 - raised below, after the ranks agree
            error = exc
        if world()[1] > 1:
            raise_if_any_rank_failed(
                error,
                self.engine.device,
                f"another rank of this worker could not read the units of task {task.task_id} "
                "(its log says why)",
            )
        if error is not None:
            raise error
        return self.engine.run(EngineRequest.of_task(decoded, units))


def build_compute(
    config: Any, store: ShardStore, on_phase: Callable[[str], None] | None = None
) -> EngineCompute:
    """The worker compute of a config: model, engine and clipping engine of ``userdp.clients``
    (``on_phase`` hears the start-up phases). With ``data.selection = "highest_ppl" |
    "lowest_ppl"`` it also scores every example of ``store`` with the model as just built, the
    run's initial model, before any update can reach it (cached in ``workers.cache_dir``,
    default ``cache/`` in the shard folder; :mod:`userdp.clients.perplexity`)."""
    engine = build_engine(config, store.manifest, on_phase=on_phase)
    perplexities = None
    if config.data.selection in PERPLEXITY_SELECTIONS:
        perplexities = _initial_perplexities(config, store, engine, on_phase)
    return EngineCompute(store, engine, Unit, perplexities)


def _initial_perplexities(
    config: Any, store: ShardStore, engine: Any, on_phase: Callable[[str], None] | None
) -> ExamplePerplexities:
    """Every rank scores with its engine's module (no update applied yet), then all take rank
    0's scores (:meth:`ExamplePerplexities.broadcast_from_rank_zero`); a rank that fails fails
    them all rather than leaving the others in the broadcast."""
    scores: ExamplePerplexities | None = None
    error: Exception | None = None
    try:
        scores = example_perplexities(
            engine.module,
            store,
            config.data.seq_len,
            cache_dir=config.workers.cache_dir,
            token_budget=config.workers.token_budget,
            pad_id=engine.pad_id,
            on_phase=on_phase,
        )
    except Exception as exc:  # noqa: BLE001 - raised below, after the ranks agree
        error = exc
    if world()[1] > 1:
        raise_if_any_rank_failed(
            error,
            engine.device,
            "another rank of this worker could not score the examples' perplexities (its log "
            "says why)",
        )
    if error is not None:
        raise error
    assert scores is not None
    if world()[1] > 1:
        scores.broadcast_from_rank_zero(engine.device)
    return scores
