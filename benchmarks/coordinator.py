"""Benchmark the coordinator's protocol and step loop on loopback (real gRPC, no gradient work).

1. ``round``: per-step overhead of sample → plan → stream tasks → gather (exactly-once checks,
   float64 running sum) → noise → ledger append (fsync) → server update → broadcast → ack, for a
   cohort of ~``cohort`` users Poisson-sampled from ``population`` users, with ``workers`` worker
   threads whose compute returns an all-zero partial at once (so gradient compute is excluded).
   Goal: ≤ 50 ms for 10k users out of 1M.
2. ``transfer``: one model update of ``params`` fp32 parameters from the coordinator to one worker
   (chunked ModelParts, reassembly, sha256 check, apply, ack), and one partial sum of the same
   size back (chunked ResultParts, reassembly into the step loop's event), each timed 5 times in
   a row after ``WARMUP`` untimed ones (best and median; the warm-up times are in the JSON). Goal:
   ≥ 1 GB/s per stream in each direction, beside a loopback TCP socket copy of the same bytes.
   Both processes apply the allocator settings the CLI applies (:mod:`userdp.proto.allocator`).
3. ``--scale`` (the CPU scale simulation): the same real step loop as ``round`` — the
   strategy's Poisson sampling over a population of 1M users (metadata only), planning by shard
   ownership, exactly-once gathering of ``--payload``-element fp32 partials streamed by worker
   processes, noise, the fsync'd ledger with its budget check, the server update and the
   broadcast — for 100 steps, reporting per-step overhead (median, p95, max, per phase) and the
   coordinator process's memory (RSS before the population, after it, at the end, and peak).
   Goals: ≤ 50 ms/step, ≤ 2 GB.

    .venv/bin/python benchmarks/coordinator.py [--population 1000000] [--cohort 10000]
        [--shards 64] [--workers 4] [--steps 5] [--params 100000000]
    .venv/bin/python benchmarks/coordinator.py --scale [--steps 100] [--payload 10000]
        [--profile prof.out]     # cProfile of the coordinator's step loop (main thread)

Prints JSON, then a markdown table. Round times include the loopback gRPC round trip to worker
processes on the same machine, so on a small shared CPU they also include the workers' CPU time.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import queue
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from userdp.clients.grpc_client import WorkerClient
from userdp.proto.allocator import keep_freed_memory
from userdp.proto.results import TaskSum
from userdp.server.auth import Authorizer
from userdp.server.coordinator import Coordinator, CoordinatorSettings, Population
from userdp.server.grpc_server import serve
from userdp.server.publisher import ModelPublisher
from userdp.server.registry import ModelAcked, WorkerRegistry
from userdp.strategies.unit_stats import UnitStats


class ZeroCompute:
    """BENCHMARK-ONLY worker compute: an all-zero partial sum, instantly (no gradient work)."""

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}

    def apply_model(self, tensors, full: bool) -> None:
        self.shapes.update({name: t.shape for name, t in tensors.items()})

    def compute(self, task) -> TaskSum:
        sums = {name: torch.zeros(shape) for name, shape in self.shapes.items()}
        return TaskSum(sums=sums, stats=UnitStats(count=len(task.unit_ids)))


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


def _rss_mb() -> float:
    """Current resident set size of this process (MB), from /proc (Linux)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize() / 1e6
    except OSError:
        return float("nan")


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e6  # KiB on Linux


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def bench_round(
    population: int,
    cohort: int,
    shards: int,
    workers: int,
    steps: int,
    payload: int = 1000,
    profile: str | None = None,
) -> dict:
    rss_start = _rss_mb()
    names = [f"shard-{i:05d}" for i in range(shards)]
    pop = Population(
        shard_of_user={f"user-{i:07d}": names[i % shards] for i in range(population)},
        shard_sha256={n: "0" * 64 for n in names},
    )
    _ = pop.users  # the cached user tuple the samplers index into
    rss_population = _rss_mb()
    rss_steps: list[float] = []
    profiler = cProfile.Profile() if profile else None
    with tempfile.TemporaryDirectory() as tmp:
        source, strategy, ledger = _strategy_and_ledger(
            population, cohort, Path(tmp) / "ledger.jsonl"
        )
        registry, publisher = WorkerRegistry(), ModelPublisher(chunk_bytes=4 << 20)
        server = serve(registry, publisher, Authorizer.insecure(), pop.shard_sha256)
        params = {"w": torch.zeros(payload), "b": torch.zeros(10)}
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
            coordinator.wait_for_workers()
            coordinator.run(1)  # the first step warms up (connections, first full sync)
            if profiler is not None:
                profiler.enable()
            cpu_start, wall_start = time.process_time(), time.perf_counter()
            coordinator.run(steps + 1, on_step=lambda _: rss_steps.append(_rss_mb()))
            cpu_used, wall_used = time.process_time() - cpu_start, time.perf_counter() - wall_start
            if profiler is not None:
                profiler.disable()
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
    out = {
        "strategy_and_ledger": source,
        "population": population,
        "cohort_mean": statistics.mean(r.units for r in reports),
        "shards": shards,
        "workers": workers,
        "steps": len(reports),
        "payload_fp32": payload + 10,
        "round_ms_median": statistics.median(totals),
        "round_ms_p95": _percentile(totals, 0.95),
        "round_ms_max": max(totals),
        "round_ms_mean": statistics.mean(totals),
        "wall_ms_per_step": wall_used * 1000 / len(reports),
        "coordinator_cpu_ms_per_step": cpu_used * 1000 / len(reports),
        "load_average": list(os.getloadavg()),
        "round_ms_first_10_median": statistics.median(totals[:10]),
        "round_ms_last_10_median": statistics.median(totals[-10:]),
        "phase_ms_median": phases,
        "phase_ms_max": {p: max(r.seconds[p] * 1000 for r in reports) for p in reports[0].seconds},
        "rss_mb_start": round(rss_start, 1),
        "rss_mb_after_population": round(rss_population, 1),
        "rss_mb_first_step": round(rss_steps[0], 1) if rss_steps else None,
        "rss_mb_last_step": round(rss_steps[-1], 1) if rss_steps else None,
        "peak_rss_mb": round(_peak_rss_mb(), 1),
    }
    if profiler is not None:
        profiler.dump_stats(profile)
        stats = pstats.Stats(profile)
        stats.sort_stats("cumulative")
        out["profile"] = profile
        out["profile_top"] = _top_functions(stats, 15)
    return out


def _top_functions(stats: pstats.Stats, n: int) -> list[dict]:
    """The ``n`` functions with the most cumulative time (ms per profiled step is added by the
    caller's reader; here: total seconds)."""
    rows = []
    for (filename, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():
        rows.append(
            {
                "function": f"{Path(filename).name}:{line}({name})",
                "calls": calls,
                "tottime_s": round(tottime, 4),
                "cumtime_s": round(cumtime, 4),
            }
        )
    rows.sort(key=lambda r: r["cumtime_s"], reverse=True)
    return rows[:n]


def _wait_ack(registry: WorkerRegistry, version: int, timeout_s: float = 300.0) -> None:
    """Block until the worker acknowledges ``version`` (a ModelAcked event)."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"worker did not acknowledge model version {version}")
        try:
            event = registry.events.get(timeout=remaining)
        except queue.Empty:
            continue
        if isinstance(event, ModelAcked) and event.model_version == version:
            if event.rejected:
                raise RuntimeError(f"worker rejected model version {version}")
            return


@contextlib.contextmanager
def _synced_worker(params: dict[str, torch.Tensor]) -> Iterator[tuple[Any, Any, Any]]:
    """(registry, publisher, session) of a coordinator serving ``params`` as model version 0 to
    ONE worker process (:class:`ZeroCompute`) that has acknowledged it; stopped on exit. The
    worker is a separate process, as on a real deployment (in one process the two ends would
    share the GIL)."""
    registry, publisher = WorkerRegistry(), ModelPublisher(chunk_bytes=4 << 20)
    server = serve(registry, publisher, Authorizer.insecure(), {}, max_message_bytes=64 << 20)
    publisher.publish(0, params)
    proc = subprocess.Popen([sys.executable, __file__, "--worker", server.address, "w0", ""])
    try:
        deadline = time.monotonic() + 120
        while registry.get("w0") is None:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError("the worker process did not register")
            time.sleep(0.01)
        session = registry.get("w0")
        session.send_many(publisher.full()[1])  # initial sync (what the step loop does on join)
        _wait_ack(registry, 0)
        yield registry, publisher, session
    finally:
        proc.kill()
        proc.wait()
        server.stop(0)


WARMUP = 2
"""Transfers per direction before the timed ones: the first transfers into a fresh process touch
memory the kernel has not yet given it (on the 2-core VM the first 400 MB ones took 2-4 times as
long as the later ones); a worker in a run pays that once."""


def _rates(num_params: int, seconds: list[float]) -> dict:
    """Best and median rate of the timed transfers (``seconds`` after the ``WARMUP`` ones)."""
    timed = seconds[WARMUP:]
    best = min(timed)
    return {
        "params": num_params,
        "bytes": num_params * 4,
        "seconds_best": best,
        "gb_per_s": num_params * 4 / best / 1e9,
        "gb_per_s_median": num_params * 4 / statistics.median(timed) / 1e9,
        "seconds_all": timed,
        "warmup_seconds": seconds[:WARMUP],
    }


def bench_transfer(num_params: int, repeats: int = 5) -> dict:
    """``WARMUP`` + ``repeats`` updates of ``num_params`` fp32 parameters to ONE worker process,
    each timed from the coordinator starting to encode it to the worker's acknowledgement
    (decoded, applied): one stream. Also times the coordinator's encoding alone."""
    params = {"w": torch.randn(num_params)}
    seconds = []
    with _synced_worker(params) as (registry, publisher, session):
        for version in range(1, WARMUP + repeats + 1):
            params["w"].add_(1.0)
            start = time.perf_counter()
            publisher.publish(version, params, sink=session.send)  # what the step loop does
            _wait_ack(registry, version)
            seconds.append(time.perf_counter() - start)
        start = time.perf_counter()
        publisher.publish(WARMUP + repeats + 1, params)  # encoding only, no stream
        encode_s = time.perf_counter() - start
    return {
        **_rates(num_params, seconds),
        "encode_seconds": encode_s,
        "encode_gb_per_s": num_params * 4 / encode_s / 1e9,
        "worker": "separate process (ZeroCompute: decode + apply + ack)",
    }


def bench_partial_transfer(num_params: int, repeats: int = 5) -> dict:
    """The other direction (``WARMUP`` + ``repeats`` times): ONE worker process returns a partial
    sum of ``num_params`` fp32 values (:class:`ZeroCompute`: no gradient work), timed from the
    coordinator sending the task to the reassembled partial arriving as the step loop's event
    (encode on the worker, stream, reassemble on the coordinator), less the compute seconds the
    worker reports."""
    from userdp.proto import userdp_v1_pb2 as pb
    from userdp.proto.codec import task_proto
    from userdp.server.registry import ResultReceived
    from userdp.strategies.base import TaskSpec

    seconds, compute = [], []
    with _synced_worker({"w": torch.zeros(num_params)}) as (registry, _, session):
        spec = TaskSpec(clip_norm=1.0)
        for attempt in range(WARMUP + repeats):
            task = task_proto(spec, 0, f"t{attempt}", 0, 0, ["u0"], 600.0)
            start = time.perf_counter()
            session.send(pb.CoordinatorMessage(task=task))
            while True:
                event = registry.events.get(timeout=600)
                if isinstance(event, ResultReceived) and event.task_id == task.task_id:
                    break
            elapsed = time.perf_counter() - start
            if event.result is None:
                raise RuntimeError(f"the partial sum was refused: {event.error}")
            seconds.append(elapsed - event.result.compute_seconds)
            compute.append(event.result.compute_seconds)
    return {
        **_rates(num_params, seconds),
        "worker_compute_seconds": compute,
        "worker": "separate process (ZeroCompute: zero partial, encode + stream)",
    }


_SOCKET_SENDER = """
import socket, sys
payload = bytes(int(sys.argv[2]))
with socket.create_connection(("127.0.0.1", int(sys.argv[1]))) as s:
    s.sendall(payload)
"""


def bench_socket(num_bytes: int, repeats: int = 3) -> dict:
    """The physical reference for one stream: ``num_bytes`` over a loopback TCP socket from another
    process into a preallocated buffer (``recv_into``), best of ``repeats``; the sender's payload
    is built before it connects, so only the transfer is timed."""
    buffer = bytearray(num_bytes)
    view = memoryview(buffer)
    seconds = []
    for _ in range(repeats):
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]
            proc = subprocess.Popen(
                [sys.executable, "-c", _SOCKET_SENDER, str(port), str(num_bytes)]
            )
            connection, _ = server.accept()
            with connection:
                start = time.perf_counter()
                received = 0
                while received < num_bytes:
                    n = connection.recv_into(view[received:], num_bytes - received)
                    if n == 0:
                        raise RuntimeError("the socket sender closed early")
                    received += n
                seconds.append(time.perf_counter() - start)
            proc.wait()
    best = min(seconds)
    return {"bytes": num_bytes, "seconds_best": best, "gb_per_s": num_bytes / best / 1e9}


def run_worker(address: str, worker_id: str, shards: str) -> int:
    """A worker process with :class:`ZeroCompute` (used by ``bench_round``)."""
    held = [(n, "0" * 64) for n in shards.split(",") if n]
    WorkerClient(address, worker_id, held, ZeroCompute()).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    keep_freed_memory()  # as `userdp coordinator` and `userdp worker` do; --worker children too
    if argv[:1] == ["--worker"]:
        return run_worker(*argv[1:4])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--population", type=int, default=1_000_000)
    parser.add_argument("--cohort", type=int, default=10_000)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=None, help="default 5 (100 with --scale)")
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--skip", choices=["round", "transfer"], default=None)
    parser.add_argument(
        "--scale",
        action="store_true",
        help="the scale simulation: 100 steps (unless --steps), memory, no transfer",
    )
    parser.add_argument("--payload", type=int, default=None, help="fp32 elements per partial")
    parser.add_argument("--profile", default=None, help="write cProfile stats of the step loop")
    args = parser.parse_args(argv)
    out: dict = {}
    if args.scale:
        steps = 100 if args.steps is None else args.steps
        out["scale"] = bench_round(
            args.population,
            args.cohort,
            args.shards,
            args.workers,
            steps,
            payload=args.payload or 10_000,
            profile=args.profile,
        )
    else:
        if args.skip != "round":
            out["round"] = bench_round(
                args.population,
                args.cohort,
                args.shards,
                args.workers,
                5 if args.steps is None else args.steps,
                payload=args.payload or 1000,
                profile=args.profile,
            )
        if args.skip != "transfer":
            out["transfer"] = bench_transfer(args.params)
            out["transfer"]["partial_sum"] = bench_partial_transfer(args.params)
            out["transfer"]["socket_anchor"] = bench_socket(args.params * 4)
    print(json.dumps(out, indent=2))
    print("\n| benchmark | setting | result | goal |\n|---|---|---|---|")
    if "round" in out:
        r = out["round"]
        print(
            f"| round overhead | {r['cohort_mean']:.0f} users of {r['population']:,}, "
            f"{r['shards']} shards, {r['workers']} workers | {r['round_ms_median']:.1f} ms "
            f"median ({r['round_ms_max']:.1f} max) | ≤ 50 ms |"
        )
    if "scale" in out:
        r = out["scale"]
        print(
            f"| scale simulation | {r['steps']} steps, {r['cohort_mean']:.0f} users of "
            f"{r['population']:,}, {r['shards']} shards, {r['workers']} worker processes, "
            f"{r['payload_fp32']:,} fp32/partial | {r['round_ms_median']:.1f} ms/step median, "
            f"mean {r['round_ms_mean']:.1f}, p95 {r['round_ms_p95']:.1f}, max "
            f"{r['round_ms_max']:.1f}; coordinator CPU {r['coordinator_cpu_ms_per_step']:.1f} "
            f"ms/step | ≤ 50 ms/step |"
        )
        print(
            f"| scale simulation memory | coordinator process RSS: start "
            f"{r['rss_mb_start']:.0f} MB, population {r['rss_mb_after_population']:.0f} MB, "
            f"last step {r['rss_mb_last_step']:.0f} MB | peak {r['peak_rss_mb']:.0f} MB "
            f"| ≤ 2 GB |"
        )
        phases = ", ".join(f"{p} {ms:.1f}" for p, ms in r["phase_ms_median"].items())
        print(f"| scale simulation phases | median ms per phase | {phases} | |")
    if "transfer" in out:
        t = out["transfer"]
        print(
            f"| update transfer | {t['params']:,} fp32 params ({t['bytes'] / 1e6:.0f} MB), "
            f"1 stream to a worker process | {t['gb_per_s']:.2f} GB/s best of "
            f"{len(t['seconds_all'])} after {WARMUP} warm-up, median {t['gb_per_s_median']:.2f} "
            f"({t['seconds_best'] * 1000:.0f} ms; encoding alone {t['encode_gb_per_s']:.2f} GB/s) "
            f"| ≥ 1 GB/s |"
        )
        partial = t["partial_sum"]
        print(
            f"| partial-sum transfer | {partial['params']:,} fp32 ({partial['bytes'] / 1e6:.0f} "
            f"MB), 1 stream from a worker process to the coordinator's step loop | "
            f"{partial['gb_per_s']:.2f} GB/s best of {len(partial['seconds_all'])} after "
            f"{WARMUP} warm-up, median "
            f"{partial['gb_per_s_median']:.2f} ({partial['seconds_best'] * 1000:.0f} ms) "
            "| ≥ 1 GB/s |"
        )
        anchor = t["socket_anchor"]
        print(
            f"| loopback TCP socket (anchor) | the same {anchor['bytes'] / 1e6:.0f} MB, one stream "
            f"into a preallocated buffer | {anchor['gb_per_s']:.2f} GB/s "
            f"({anchor['seconds_best'] * 1000:.0f} ms) | anchor |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
