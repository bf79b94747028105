"""Run a userdp strategy inside Flower (flwr ≥ 1.21 Message API), for users who deploy with it.

Semantics, stated plainly:
- A Flower *node* is a worker, NOT a privacy unit. A node may hold many users; the ClientApp
  clips PER USER (or per example for ELS) with the userdp compute function and returns the SUM
  of clipped updates, so the guarantee is user-level, unlike Flower's own DP wrappers, which
  clip each node's reply as a whole (node-level DP).
- The server learns which users each node holds (ids and example counts, never rows) in a
  one-off QUERY census, then the userdp strategy samples users (Poisson, ELS, balls-in-bins…),
  not nodes. Nodes with no sampled user get no message; a step with an empty cohort still
  releases (and charges) pure noise.
- The step is :mod:`userdp.strategies.step`'s: ``configure_train`` is :func:`begin_step` (budget
  check, cohort, task) and ``aggregate_train`` is :func:`finish_step` (noise once, on the server;
  the ledger entry appended BEFORE the new arrays are returned to Flower). If any node that was sent units fails, the step is NOT
  released (nothing noised or charged) and the same step index — hence the same cohort — is
  retried in the next Flower round, as the userdp coordinator does.
- Transport is Flower's (polling, no exactly-once beyond one reply per message). Evaluation
  rounds are skipped.

The ClientApp wraps ``compute(task, unit_ids, params) -> (task_sum, UnitStats)``, the
same worker contract as :func:`userdp.strategies.local_step.run_local_step`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, fields
from typing import Any

import numpy as np
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy as FlowerStrategy

from userdp.config import Config, load_config
from userdp.run.components import strategy_from_config
from userdp.strategies.base import (
    PopulationCounts,
    Strategy,
    StrategyError,
    TaskSpec,
    parse_example_unit_id,
)
from userdp.strategies.step import CohortSum, ExecutionOptions, PlannedStep, begin_step, finish_step
from userdp.strategies.tensors import sum_tensor_dicts
from userdp.strategies.unit_stats import UnitStats

__all__ = ["UserDpFlowerStrategy", "make_client_app"]

log = logging.getLogger(__name__)

Compute = Callable[[TaskSpec, Sequence[str], Mapping[str, np.ndarray]], tuple[dict, UnitStats]]
UsersOfNode = Callable[[Context], Mapping[str, int]]


def _user_of(unit_id: str, unit: str) -> str:
    return parse_example_unit_id(unit_id)[0] if unit == "example" else unit_id


def _task_to_config(task: TaskSpec, unit_ids: Sequence[str], step: int) -> ConfigRecord:
    config = ConfigRecord({f"task.{k}": v for k, v in asdict(task).items()})
    config["userdp.step"] = step
    config["userdp.unit_ids"] = list(unit_ids)
    return config


def _task_from_config(config: ConfigRecord) -> tuple[TaskSpec, list[str], int]:
    task = TaskSpec(**{f.name: config[f"task.{f.name}"] for f in fields(TaskSpec)})
    return task, list(config["userdp.unit_ids"]), int(config["userdp.step"])


class UserDpFlowerStrategy(FlowerStrategy):
    """A ``flwr.serverapp.strategy.Strategy`` driving a userdp :class:`Strategy`.

    ``ledger``: any object with ``append(step, mechanism)`` (e.g. userdp's accounting ledger);
    ``check_budget(mechanism)`` is called too when present. Flower rounds map to userdp steps
    ``0, 1, …`` (a failed round retries its step).
    """

    def __init__(
        self,
        strategy: Strategy,
        ledger: Any,
        *,
        min_nodes: int = 1,
        timeout: float = 600.0,
        options: ExecutionOptions | None = None,
    ) -> None:
        self.strategy = strategy
        self.options = options
        self.min_nodes = int(min_nodes)
        self.ledger = ledger
        self.timeout = timeout
        self.step = 0
        self.node_of_user: dict[str, int] = {}
        self.population: PopulationCounts | None = None
        self.params: dict[str, np.ndarray] | None = None
        self._pending: tuple[PlannedStep, dict[int, list[str]]] | None = None
        self.released_steps: list[int] = []
        self.expected_users: int | None = None

    @classmethod
    def from_config(
        cls, config: Config, ledger: Any, *, num_users: int, **kwargs: Any
    ) -> UserDpFlowerStrategy:
        """The strategy of a userdp config (a TOML path or a ``userdp.Config``; a built-in or a
        plugin ``"package.module:ClassName"``) with its execution options. ``num_users`` is N,
        the users the nodes hold: σ is calibrated for it when ``privacy.noise_multiplier`` is
        unset, and the census must then find exactly N users."""
        if not isinstance(config, Config):
            config = load_config(config)
        strategy, options, _ = strategy_from_config(config, num_users)
        adapter = cls(strategy, ledger, options=options, **kwargs)
        adapter.expected_users = int(num_users)
        return adapter

    # -- census ------------------------------------------------------------------------------

    def _census(self, grid: Grid) -> None:
        """Ask every node (waiting for ``min_nodes``) which users it holds."""
        deadline = time.monotonic() + self.timeout
        nodes = list(grid.get_node_ids())
        while len(nodes) < self.min_nodes:
            if time.monotonic() > deadline:
                raise StrategyError(
                    f"only {len(nodes)} node(s) connected; min_nodes={self.min_nodes}"
                )
            time.sleep(0.5)
            nodes = list(grid.get_node_ids())
        messages = [
            Message(RecordDict(), dst_node_id=node, message_type=MessageType.QUERY)
            for node in nodes
        ]
        counts: dict[str, int] = {}
        replies = list(grid.send_and_receive(messages, timeout=self.timeout))
        if len(replies) < len(messages):
            raise StrategyError(
                f"census: {len(replies)} of {len(messages)} nodes answered within "
                f"{self.timeout:g} s (a node that failed to start or is overloaded)"
            )
        for reply in replies:
            if reply.has_error():
                raise StrategyError(f"census failed on node {reply.metadata.src_node_id}")
            record = reply.content.config_records["userdp.users"]
            for user, n in zip(record["user_ids"], record["n_examples"], strict=True):
                if user in self.node_of_user:
                    raise StrategyError(f"user {user!r} is held by two nodes")
                self.node_of_user[user] = reply.metadata.src_node_id
                counts[user] = int(n)
        if not counts:
            raise StrategyError("the census found no users on any node")
        if self.expected_users is not None and len(counts) != self.expected_users:
            raise StrategyError(
                f"the census found {len(counts)} users but the strategy was calibrated for "
                f"num_users={self.expected_users}"
            )
        users = tuple(sorted(counts))
        self.population = PopulationCounts(users, np.array([counts[u] for u in users], np.int64))

    # -- Flower hooks ------------------------------------------------------------------------

    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        if self.population is None:
            self._census(grid)
        if self.params is None:
            self.params = {k: np.array(v.numpy(), copy=True) for k, v in arrays.items()}
        planned = begin_step(
            self.strategy, self.step, self.population, self.ledger, options=self.options
        )
        cohort, task = planned.cohort, planned.task
        by_node: dict[int, list[str]] = {}
        for unit in cohort.unit_ids:
            by_node.setdefault(self.node_of_user[_user_of(unit, cohort.unit)], []).append(unit)
        self._pending = (planned, by_node)
        model = ArrayRecord({k: _array(v) for k, v in self.params.items()})
        return [
            Message(
                RecordDict({"arrays": model, "config": _task_to_config(task, units, self.step)}),
                dst_node_id=node,
                message_type=MessageType.TRAIN,
            )
            for node, units in by_node.items()
        ]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        if self._pending is None:
            raise StrategyError("aggregate_train called before configure_train")
        planned, by_node = self._pending
        self._pending = None
        partials, units, clipped = [], 0, 0
        answered: set[int] = set()
        for reply in replies:
            node = reply.metadata.src_node_id
            if reply.has_error() or node not in by_node or node in answered:
                log.warning(
                    "step %d: bad or duplicate reply from node %s; step not released",
                    self.step,
                    node,
                )
                return None, None
            answered.add(node)
            metrics = reply.content.metric_records["userdp.stats"]
            if int(metrics["units"]) != len(by_node[node]):
                log.warning("step %d: node %s answered for the wrong units", self.step, node)
                return None, None
            partials.append({k: v.numpy() for k, v in reply.content.array_records["sum"].items()})
            units += int(metrics["units"])
            clipped += int(metrics["clipped"])
        if answered != set(by_node):
            log.warning(
                "step %d: %d node(s) did not answer; step not released (retried)",
                self.step,
                len(set(by_node) - answered),
            )
            return None, None
        if partials:
            summed = sum_tensor_dicts(partials)
        else:  # empty cohort: the release is pure noise
            summed = {k: np.zeros_like(v, dtype=np.float64) for k, v in self.params.items()}
        finish_step(
            self.strategy,
            planned,
            CohortSum(summed, UnitStats(count=units, clipped=clipped)),
            self.params,
            self.ledger,
        )
        self.released_steps.append(self.step)
        self.step += 1
        record = ArrayRecord({k: _array(v) for k, v in self.params.items()})
        return record, MetricRecord({"units": units, "clipped": clipped})

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        return []

    def aggregate_evaluate(self, server_round, replies) -> MetricRecord | None:
        return None

    def summary(self) -> None:
        facts = self.strategy.facts()
        log.info("userdp strategy %s: %s", type(self.strategy).__name__, facts.to_dict())


def _array(value: np.ndarray) -> Any:
    from flwr.app import Array

    return Array(np.ascontiguousarray(value))


def make_client_app(compute: Compute, users_of_node: UsersOfNode) -> ClientApp:
    """A ClientApp for nodes holding many users. ``users_of_node(context)`` lists this node's
    users and example counts; ``compute`` clips per unit and returns the sum."""
    app = ClientApp()

    @app.query()
    def census(msg: Message, context: Context) -> Message:
        users = users_of_node(context)
        record = ConfigRecord(
            {"user_ids": list(users), "n_examples": [int(n) for n in users.values()]}
        )
        return Message(RecordDict({"userdp.users": record}), reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        task, unit_ids, _ = _task_from_config(msg.content.config_records["config"])
        local = users_of_node(context)
        foreign = [u for u in unit_ids if _user_of(u, task.unit) not in local]
        if foreign:
            raise StrategyError(f"node asked for {len(foreign)} unit(s) it does not hold")
        params = {k: v.numpy() for k, v in msg.content.array_records["arrays"].items()}
        partial, stats = compute(task, unit_ids, params)
        reply = RecordDict(
            {
                "sum": ArrayRecord({k: _array(np.asarray(v)) for k, v in partial.items()}),
                "userdp.stats": MetricRecord({"units": stats.count, "clipped": stats.clipped}),
            }
        )
        return Message(reply, reply_to=msg)

    return app
