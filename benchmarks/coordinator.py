"""Benchmark the coordinator's protocol and step loop on loopback (real gRPC, no gradient work).

1. ``round``: per-step overhead of sample → plan → stream tasks → gather (exactly-once checks,
   float64 running sum) → noise → ledger append (fsync) → server update → broadcast → ack, for a
   cohort of ~``cohort`` users Poisson-sampled from ``population`` users, with ``workers`` worker
   threads whose compute returns an all-zero partial at once (so gradient compute is excluded).
   Goal: ≤ 50 ms for 10k users out of 1M.
2. ``transfer``: one model update of ``params`` fp32 parameters from the coordinator to one worker
   (chunked ModelParts, reassembly, sha256 check, apply, ack). Goal: ≥ 1 GB/s per stream.

    .venv/bin/python benchmarks/coordinator.py [--population 1000000] [--cohort 10000]
        [--shards 64] [--workers 4] [--steps 5] [--params 100000000]

Prints JSON, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from userdp.clients.grpc_client import ComputedPartial, WorkerClient
from userdp.server.auth import Authorizer
from userdp.server.coordinator import Coordinator, CoordinatorSettings, Population
from userdp.server.grpc_server import serve
from userdp.server.service import ModelPublisher, WorkerRegistry


class ZeroCompute:
    """BENCHMARK-ONLY worker compute: an all-zero partial sum, instantly (no gradient work)."""

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}

    def apply_model(self, tensors, full: bool) -> None:
        self.shapes.update({name: t.shape for name, t in tensors.items()})

    def compute(self, task) -> ComputedPartial:
        sums = {name: torch.zeros(shape) for name, shape in self.shapes.items()}
        return ComputedPartial(sums=sums, count=len(task.unit_ids))


def _strategy_and_ledger(population: int, cohort: int, ledger_path: Path):
    """userdp's ULS strategy and ledger (with a budget, so every step runs check_budget)."""
    from userdp.accounting.ledger import Ledger
    from userdp.strategies.builtins import UserLevelSampling
    from userdp.strategies.optimizers import Sgd

    strategy = UserLevelSampling(
        noise_multiplier=1.0, clip_norm=1.0, sampling_prob=cohort / population, optimizer=Sgd(0.1)
    )
    ledger = Ledger.open(ledger_path, create=True, budget_epsilon=1e4, delta=1e-6)
    return "userdp ULS + userdp ledger (budget checked every step)", strategy, ledger


def bench_round(population: int, cohort: int, shards: int, workers: int, steps: int) -> dict:
    names = [f"shard-{i:05d}" for i in range(shards)]
    pop = Population(
        shard_of_user={f"user-{i:07d}": names[i % shards] for i in range(population)},
        shard_sha256={n: "0" * 64 for n in names},
    )
    with tempfile.TemporaryDirectory() as tmp:
        source, strategy, ledger = _strategy_and_ledger(
            population, cohort, Path(tmp) / "ledger.jsonl"
        )
        registry, publisher = WorkerRegistry(), ModelPublisher(chunk_bytes=4 << 20)
        server = serve(registry, publisher, Authorizer.insecure(), pop.shard_sha256)
        params = {"w": torch.zeros(1000), "b": torch.zeros(10)}
        coordinator = Coordinator(
            strategy=strategy,
            ledger=ledger,
            params=params,
            population=pop,
            registry=registry,
            publisher=publisher,
            checkpoint_dir=Path(tmp) / "ckpt",
            settings=CoordinatorSettings(checkpoint_every=10**9),
        )
        coordinator.resume()
        procs = []
        for w in range(workers):
            held = ",".join(n for i, n in enumerate(names) if i % workers == w)
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--worker", server.address, f"w{w}", held]
                )
            )
        try:
            assert coordinator.wait_for_workers(120)
            coordinator.run(steps + 1)  # the first step warms up
        finally:
            for proc in procs:
                proc.kill()
                proc.wait()
            server.stop(0)
    reports = coordinator.reports[1:]
    totals = [sum(r.seconds.values()) * 1000 for r in reports]
    phases = {
        p: statistics.median(r.seconds[p] * 1000 for r in reports) for p in reports[0].seconds
    }
    return {
        "strategy_and_ledger": source,
        "population": population,
        "cohort_mean": statistics.mean(r.units for r in reports),
        "shards": shards,
        "workers": workers,
        "round_ms_median": statistics.median(totals),
        "round_ms_max": max(totals),
        "phase_ms_median": phases,
    }


def _wait_version(client: WorkerClient, version: int, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while client.model_version != version:
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker did not reach model version {version}")
        time.sleep(0.0005)


def bench_transfer(num_params: int, repeats: int = 2) -> dict:
    registry, publisher = WorkerRegistry(), ModelPublisher(chunk_bytes=4 << 20)
    server = serve(registry, publisher, Authorizer.insecure(), {}, max_message_bytes=64 << 20)
    params = {"w": torch.randn(num_params)}
    publisher.publish(0, params)
    client = WorkerClient(server.address, "w0", [], ZeroCompute())
    threading.Thread(target=client.run, daemon=True).start()
    deadline = time.monotonic() + 60
    while registry.get("w0") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    session = registry.get("w0")
    session.send_many(publisher.full()[1])  # initial sync (what the step loop does on join)
    _wait_version(client, 0)
    seconds = []
    for version in range(1, repeats + 1):
        params["w"].add_(1.0)
        start = time.perf_counter()
        publisher.publish(version, params, sink=session.send)  # what the step loop does
        _wait_version(client, version)
        seconds.append(time.perf_counter() - start)
    client.stop()
    server.stop(0)
    best = min(seconds)
    return {
        "params": num_params,
        "bytes": num_params * 4,
        "seconds_best": best,
        "gb_per_s": num_params * 4 / best / 1e9,
        "seconds_all": seconds,
    }


def run_worker(address: str, worker_id: str, shards: str) -> int:
    """A worker process with :class:`ZeroCompute` (used by ``bench_round``)."""
    held = [(n, "0" * 64) for n in shards.split(",") if n]
    WorkerClient(address, worker_id, held, ZeroCompute()).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return run_worker(*argv[1:4])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--population", type=int, default=1_000_000)
    parser.add_argument("--cohort", type=int, default=10_000)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--skip", choices=["round", "transfer"], default=None)
    args = parser.parse_args(argv)
    out: dict = {}
    if args.skip != "round":
        out["round"] = bench_round(
            args.population, args.cohort, args.shards, args.workers, args.steps
        )
    if args.skip != "transfer":
        out["transfer"] = bench_transfer(args.params)
    print(json.dumps(out, indent=2))
    print("\n| benchmark | setting | result | goal |\n|---|---|---|---|")
    if "round" in out:
        r = out["round"]
        print(
            f"| round overhead | {r['cohort_mean']:.0f} users of {r['population']:,}, "
            f"{r['shards']} shards, {r['workers']} workers | {r['round_ms_median']:.1f} ms "
            f"median ({r['round_ms_max']:.1f} max) | ≤ 50 ms |"
        )
    if "transfer" in out:
        t = out["transfer"]
        print(
            f"| update transfer | {t['params']:,} fp32 params ({t['bytes'] / 1e6:.0f} MB), "
            f"1 stream | {t['gb_per_s']:.2f} GB/s ({t['seconds_best'] * 1000:.0f} ms) | ≥ 1 GB/s |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
