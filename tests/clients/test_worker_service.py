"""EngineCompute: a task's unit ids -> the user's selected examples (real ShardStore, real
select_examples) -> the engine; end to end over gRPC with a Population read from the manifest.

Most tests use a LABELLED TEST DOUBLE (``TokenCountEngine``: each unit contributes a constant
vector whose norm is min(C, its token count / 100)) to check which examples reach the engine
cheaply; ``test_end_to_end_over_grpc_with_the_real_engine`` runs the real clipping engine
(userdp.clients.engine) on a tiny GPT-2 and checks the step against a single-process reference."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pytest
import torch
from userdp.clients.grpc_client import Backoff, WorkerClient
from userdp.clients.selection import select_examples
from userdp.clients.shard_store import ShardStore
from userdp.clients.worker_service import EngineCompute, _selection_rng
from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.results import TaskSum
from userdp.server.population import Population
from userdp.strategies.base import Release
from userdp.strategies.unit_stats import UnitStats

from tests.server.harness import make_loopback
from tests.server.standins import uls_strategy
from userdp.shards.input import InputSource
from userdp.shards.writer import ShardOptions, write_shards


@dataclass
class Unit:
    unit_id: str
    examples: list


def unit_norm(examples, clip_norm):
    return min(clip_norm, sum(len(e) for e in examples) / 100)


class TokenCountEngine:
    """TEST DOUBLE of the clipping engine (see the module docstring)."""

    def __init__(self):
        self.module = torch.nn.Linear(3, 2)
        self.seen: list[Unit] = []

    def run(self, request):
        units, clip_norm = request.units, request.clip_norm
        self.seen.extend(units)
        sums = {n: torch.zeros_like(p) for n, p in self.module.named_parameters()}
        total = sum(p.numel() for p in self.module.parameters())
        for unit in units:
            for name in sums:
                sums[name] += unit_norm(unit.examples, clip_norm) / total**0.5
        tokens = sum(len(e) for u in units for e in u.examples)
        return TaskSum(sums=sums, stats=UnitStats(count=len(units), tokens=tokens))


@pytest.fixture(scope="module")
def shard_dir(tmp_path_factory):
    rng = np.random.default_rng(0)
    users = [f"u{int(rng.integers(30))}" for _ in range(300)]
    texts = [f"text {i} " + "abc" * int(rng.integers(1, 30)) for i in range(300)]
    out = tmp_path_factory.mktemp("shards") / "shards"
    source = InputSource.from_table(pa.table({"user": users, "body": texts}), "user", "body", "t")
    write_shards(source, out, ShardOptions(progress=False, num_shards=3))
    return out


def _task(units, unit="user", step=3, group_size=2, seq_len=8):
    return pb.Task(
        task_id="3.0",
        step=step,
        unit_ids=units,
        clip_norm=1.0,
        engine=pb.EngineOptions(unit=unit),
        selection=pb.Selection(strategy="random", group_size=group_size, seq_len=seq_len),
        selection_seed=11,
    )


def test_units_get_their_selected_examples(shard_dir):
    store = ShardStore(shard_dir)
    engine = TokenCountEngine()
    compute = EngineCompute(store, engine, Unit)
    user = store.users()[0]
    compute.compute(_task([user]))
    compute.compute(_task([user]))
    first, again = engine.seen
    expected = select_examples(
        store.user_examples(user), 2, "random", 8, _selection_rng(11, 3, user)
    )
    assert [e.tolist() for e in first.examples] == [e.tolist() for e in expected]
    assert [e.tolist() for e in again.examples] == [e.tolist() for e in first.examples]
    assert len(first.examples) <= 2 and all(len(e) <= 8 for e in first.examples)
    compute.compute(_task([f"{user}/1"], unit="example", seq_len=64))
    example = engine.seen[-1]
    assert [e.tolist() for e in example.examples] == [store.user_examples(user)[1][:64].tolist()]


def test_apply_model_copies_by_name_and_refuses_unknown(shard_dir):
    from userdp.proto.tensors import decode_chunks, tensors_chunks

    engine = TokenCountEngine()
    compute = EngineCompute(ShardStore(shard_dir), engine, Unit)
    new = {"weight": torch.full((2, 3), 7.0)}
    compute.apply_model(decode_chunks(tensors_chunks(new)), full=False)
    assert torch.equal(engine.module.weight.detach(), new["weight"])
    with pytest.raises(KeyError):
        compute.apply_model(decode_chunks(tensors_chunks({"nope": torch.zeros(1)})), full=False)


def _store_and_population(shard_dir):
    store = ShardStore(shard_dir)
    counts = store.user_counts()
    population = Population.from_manifest(
        store.manifest, {u: c.n_examples for u, c in counts.items()}
    )
    return store, population


def _one_step_over_grpc(tmp_path, store, population, strategy, params, compute):
    """A loopback coordinator holding ``params`` (the toy model replaced by the engine's) and
    one gRPC worker on ``compute`` run one step: (its report, the coordinator's parameters)."""
    from userdp.server.aggregation import template_of

    loop = make_loopback(tmp_path, population=population, strategy=strategy)
    loop.coordinator.params.clear()
    loop.coordinator.params.update({n: t.clone() for n, t in params.items()})
    loop.coordinator.template = template_of(params)
    loop.coordinator.publisher.publish(loop.coordinator.model_version, params, {})
    holdings = [(e.name, e.sha256) for e in store.manifest.shards]
    client = WorkerClient(loop.server.address, "w0", holdings, compute, backoff=Backoff(0.05, 0.2))
    thread = threading.Thread(target=client.run, daemon=True)
    thread.start()
    try:
        loop.coordinator.wait_for_workers()
        report = loop.coordinator.run(1)[0]
        after = {n: t.clone() for n, t in loop.coordinator.params.items()}
    finally:
        client.stop()
        loop.close()
    return report, after


def test_end_to_end_over_grpc_with_a_real_manifest(shard_dir, tmp_path):
    store, population = _store_and_population(shard_dir)
    engine = TokenCountEngine()
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    compute = EngineCompute(store, engine, Unit)
    report, _ = _one_step_over_grpc(
        tmp_path, store, population, uls_strategy(q=0.5), params, compute
    )
    cohort = uls_strategy(q=0.5).sample_cohort(0, population)
    assert report.units == len(cohort.unit_ids) == len(engine.seen)
    assert sorted(u.unit_id for u in engine.seen) == sorted(cohort.unit_ids)


class RecordingEngine:
    """The REAL clipping engine (userdp.clients.engine), recording what each task asked of it."""

    def __init__(self, engine):
        self.engine = engine
        self.module = engine.module
        self.requests: list = []

    def run(self, request):
        self.requests.append(request)
        return self.engine.run(request)


def test_end_to_end_over_grpc_with_the_real_engine(shard_dir, tmp_path):
    """A coordinator step over gRPC with the real vectorized engine on a tiny GPT-2 equals the
    single-process reference: the ``loop`` engine's clipped sum of the same units, then the
    strategy's server update (noise disabled, test-only)."""
    from userdp.clients.engine import ClippingEngine, build_engine
    from userdp.clients.engine import Unit as EngineUnit

    from userdp.config import parse_config

    store, population = _store_and_population(shard_dir)
    config = parse_config({"data": {"seq_len": 128}, "strategy": {"engine": "vectorized"}})
    engine = RecordingEngine(build_engine(config, store.manifest, use_deepspeed=False))
    reference_engine = build_engine(config, store.manifest, use_deepspeed=False)
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    strategy = uls_strategy(q=0.5, clip_norm=0.5, lr=0.1)
    compute = EngineCompute(store, engine, EngineUnit)
    report, after = _one_step_over_grpc(tmp_path, store, population, strategy, params, compute)
    units = [u for request in engine.requests for u in request.units]
    assert all(r.clip_norm == 0.5 and r.engine == "vectorized" for r in engine.requests)
    cohort = uls_strategy(q=0.5).sample_cohort(0, population)
    assert sorted(u.unit_id for u in units) == sorted(cohort.unit_ids)
    assert report.units == report.stats.count == len(units) and report.stats.clipped > 0
    reference = ClippingEngine(reference_engine.module, engine="loop").clipped_sum(units, 0.5)
    expected = {n: t.clone() for n, t in params.items()}
    replay = uls_strategy(q=0.5, clip_norm=0.5, lr=0.1)
    replay_cohort = replay.sample_cohort(0, population)
    replay.server_update(expected, Release(0, replay_cohort, reference.sums))
    for name in params:
        assert torch.allclose(after[name], expected[name], rtol=1e-4, atol=1e-6), name
    assert not all(torch.equal(after[n], params[n]) for n in params)  # the step moved the model
