"""The coordinator's bytes and time per step on the two data planes, against the number of workers.

For W worker processes (default 1, 2, 4, 8) and a model of ``--params`` float32 parameters
(default 100M, 400 MB, in 25 tensors), the real coordinator (loopback gRPC, ULS with its
production noise, the fsync'd ledger, SGD update, checkpoints off) runs ``--steps`` timed steps
after one warm-up step on each data plane:

- ``grpc``: every worker streams its task sum to the coordinator and receives every version;
- ``collective``: the workers hold their sums, reduce them in a gloo group to the leader, which
  alone sends the sum, and pass the version on through the group (docs/protocol.md).

Per step it records the coordinator's bytes (model parts sent over gRPC, task sums received),
the gather time (tasks, transfers, the reduce and the checks up to the cohort's sum), for the
collective plane the aggregation itself (from the members' ``GroupReduce`` to the checked sum at
the coordinator: their summing of the held sums, the gloo reduce, the leader's stream of the one
sum, the coordinator's checks), the wall time per step (including the next step's wait for
acknowledgements), and the anchor measured in the same run: ``torch.distributed``'s own gloo
``all_reduce`` of one float32 tensor of the same size among W processes (median of 3 after a
warm-up). Goals (W = 4): bytes per step independent of W within one model size; the collective
aggregation ≤ 2× the anchor's all_reduce.

The workers compute no gradients: BENCHMARK-ONLY :class:`SumCompute` returns a fixed direction
scaled to half the clip bound of the task's units (a valid clipped sum), so the figures are the
data plane's own. Prints JSON, then a markdown table.

    .venv/bin/python benchmarks/data_plane.py [--params 100000000] [--workers 1 2 4 8]
        [--steps 2] [--planes grpc collective]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from userdp.clients.grpc_client import WorkerClient
from userdp.proto.allocator import keep_freed_memory
from userdp.proto.layout import TensorLayout
from userdp.proto.results import TaskSum
from userdp.server.auth import Authorizer
from userdp.server.coordinator import Coordinator, CoordinatorSettings, Population
from userdp.server.group_plane import GroupPlane, GroupSettings
from userdp.server.grpc_server import serve
from userdp.server.publisher import ModelPublisher
from userdp.server.registry import ResultReceived, WorkerRegistry, WorkerSession
from userdp.server.sum_plane import StreamedPlane
from userdp.strategies.unit_stats import UnitStats

TENSORS = 25
USERS_PER_SHARD = 32
CLIP = 1.0


class SumCompute:
    """BENCHMARK-ONLY worker compute: a constant sum of norm 0.5·C·units (a valid clipped sum),
    of the model's shapes; it keeps no model (only the shapes), to leave memory to the data plane."""

    def __init__(self) -> None:
        self.shapes: dict[str, tuple[int, ...]] = {}

    def apply_model(self, tensors, full: bool) -> None:
        self.shapes.update({n: tuple(t.shape) for n, t in tensors.items()})

    def compute(self, task) -> TaskSum:
        """The sums as views of one float32 buffer in the model's order, as the engines'
        accumulator returns them (:class:`userdp.clients.clipping.Accumulator`)."""
        numel = sum(math.prod(shape) for shape in self.shapes.values())
        value = 0.5 * task.clip_norm * len(task.unit_ids) / math.sqrt(numel)
        sums = TensorLayout.of_shapes(self.shapes).views(torch.full((numel,), value))
        return TaskSum(sums=sums, stats=UnitStats(count=len(task.unit_ids)))


def run_worker(address: str, worker_id: str, shard: str) -> int:
    WorkerClient(address, worker_id, [(shard, "0" * 64)], SumCompute()).run()
    return 0


def _params(num_params: int) -> dict[str, torch.Tensor]:
    size = num_params // TENSORS
    return {f"layer{i:02d}.weight": torch.zeros(size) for i in range(TENSORS)}


def tcp_bytes(pid: int) -> dict[tuple[str, str], tuple[int, int]]:
    """(local, remote) → (bytes sent, bytes received) of every TCP socket of process ``pid``,
    from the kernel's TCP_INFO as ``ss -tinp`` prints it (loopback sockets too)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    sockets: dict[tuple[str, str], tuple[int, int]] = {}
    key = None
    for line in out.splitlines():
        if not line.startswith((" ", "\t")):
            fields = line.split()
            key = (fields[3], fields[4]) if f"pid={pid}," in line else None
            continue
        if key is not None:
            counts = dict(f.split(":", 1) for f in line.split() if f.startswith("bytes_"))
            sent = int(counts.get("bytes_sent", 0))
            sockets[key] = (sent, int(counts.get("bytes_received", 0)))
    return sockets


def tcp_delta(before: dict, after: dict) -> tuple[int, int]:
    """Bytes sent and received between two :func:`tcp_bytes` snapshots (a socket opened in
    between counts in full; one closed in between is not seen: the benchmark's groups and
    connections stay up across the timed steps)."""
    sent = received = 0
    for key, (s1, r1) in after.items():
        s0, r0 = before.get(key, (0, 0))
        sent, received = sent + s1 - s0, received + r1 - r0
    return sent, received


class Bytes:
    """Counts the coordinator's model-size gRPC payloads: model parts sent, task-sum tensors
    received."""

    def __init__(self, registry: WorkerRegistry) -> None:
        self.sent = 0
        self.received = 0
        self.by_worker: Counter = Counter()
        original_send, original_put = WorkerSession.send, registry.events.put
        counter = self

        def send(session, message) -> None:
            if message.WhichOneof("kind") == "model_part":
                size = len(message.model_part.chunk.data)
                counter.sent += size
                counter.by_worker[session.worker_id] += size
            original_send(session, message)

        def put(event, *args, **kwargs) -> None:
            if isinstance(event, ResultReceived) and event.result is not None:
                counter.received += sum(
                    len(t.data) if hasattr(t, "data") else t.nbytes
                    for t in event.result.task_sum.sums.values()
                )
            original_put(event, *args, **kwargs)

        WorkerSession.send = send  # this benchmark process only
        registry.events.put = put
        self._restore = lambda: setattr(WorkerSession, "send", original_send)

    def close(self) -> None:
        self._restore()


def bench_plane(plane: str, workers: int, num_params: int, steps: int) -> dict:
    from userdp.accounting.ledger import Ledger
    from userdp.strategies.builtins import UserLevelSampling
    from userdp.strategies.optimizers import Sgd

    names = [f"shard-{i:05d}" for i in range(workers)]
    population = Population(
        shard_of_user={
            f"user-{i:06d}": names[i % workers] for i in range(USERS_PER_SHARD * workers)
        },
        shard_sha256={n: "0" * 64 for n in names},
    )
    params = _params(num_params)
    with tempfile.TemporaryDirectory() as tmp:
        strategy = UserLevelSampling(
            noise_multiplier=1.0, clip_norm=CLIP, sampling_prob=0.5, optimizer=Sgd(0.1)
        )
        ledger = Ledger.open(Path(tmp) / "ledger.jsonl", create=True)
        registry, publisher = WorkerRegistry(), ModelPublisher(chunk_bytes=1 << 20)
        server = serve(
            registry,
            publisher,
            Authorizer.insecure(),
            population.shard_sha256,
            max_partial_bytes=2 * 4 * num_params + (1 << 20),
        )
        sum_plane = (
            GroupPlane(GroupSettings(store_bind="127.0.0.1", timeout_s=600.0))
            if plane == "collective"
            else StreamedPlane()
        )
        coordinator = Coordinator(
            strategy=strategy,
            ledger=ledger,
            params=params,
            population=population,
            registry=registry,
            publisher=publisher,
            checkpoint_dir=Path(tmp) / "ckpt",
            settings=CoordinatorSettings(
                checkpoint_every=10**9, step_deadline_s=3600, task_deadline_s=1800
            ),
            plane=sum_plane,
        )
        coordinator.resume()
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", server.address, f"w{w}", names[w]]
            )
            for w in range(workers)
        ]
        counter = None
        try:
            coordinator.wait_for_workers()
            coordinator.run(1)  # warm-up: connections, the first full sync, the first group
            counter = Bytes(registry)
            sockets = tcp_bytes(os.getpid())
            walls: list[float] = []
            reduces: list[float] = []
            phases: list[dict] = []
            last = [time.perf_counter()]

            def stamp(_report) -> None:
                now = time.perf_counter()
                walls.append(now - last[0])
                last[0] = now
                reduces.append(getattr(sum_plane, "reduce_seconds", float("nan")))
                phases.append(dict(getattr(sum_plane, "reduce_phases", {})))

            coordinator.run(1 + steps, on_step=stamp)
            tcp_sent, tcp_received = tcp_delta(sockets, tcp_bytes(os.getpid()))
        finally:
            if counter is not None:
                counter.close()
            for proc in procs:
                proc.kill()
                proc.wait()
            server.stop(0)
            ledger.close()
    reports = coordinator.reports[1:]
    model_bytes = 4 * sum(t.numel() for t in params.values())
    return {
        "plane": plane,
        "workers": workers,
        "steps": len(reports),
        "model_mb": model_bytes / 1e6,
        "coordinator_tcp_sent_mb_per_step": tcp_sent / len(reports) / 1e6,
        "coordinator_tcp_received_mb_per_step": tcp_received / len(reports) / 1e6,
        "grpc_payload_sent_mb_per_step": counter.sent / len(reports) / 1e6,
        "grpc_payload_received_mb_per_step": counter.received / len(reports) / 1e6,
        "sent_mb_by_worker": {w: b / len(reports) / 1e6 for w, b in counter.by_worker.items()},
        "gather_s_median": statistics.median(r.seconds["gather"] for r in reports),
        "reduce_s_median": statistics.median(reduces) if plane == "collective" else None,
        "reduce_phases_s": phases[1:] if plane == "collective" else None,
        "broadcast_s_median": statistics.median(r.seconds["broadcast"] for r in reports),
        "step_wall_s_median": statistics.median(walls),
        "failed_tasks": sum(r.failed_tasks for r in reports),
    }


def _anchor_rank(rank: int, workers: int, port: int, num_params: int, out: str) -> None:
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, workers, rank == 0, datetime.timedelta(seconds=600))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=workers)
    tensor = torch.ones(num_params)
    times = []
    for _ in range(4):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    if rank == 0:
        Path(out).write_text(json.dumps(times[1:]))
    dist.destroy_process_group()


def bench_all_reduce(workers: int, num_params: int) -> dict:
    """torch.distributed's gloo all_reduce of ``num_params`` float32 among ``workers`` processes."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "times.json")
        mp.spawn(_anchor_rank, args=(workers, port, num_params, out), nprocs=workers, join=True)
        times = json.loads(Path(out).read_text())
    return {"workers": workers, "all_reduce_s_median": statistics.median(times), "times": times}


def _row_in_child(plane: str, workers: int, params: int, steps: int) -> dict:
    """:func:`bench_plane` in a child process; a child that fails (e.g. killed for memory) gives
    a row that says so."""
    argv = [sys.executable, __file__, "--row", plane, str(workers), str(params), str(steps)]
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        why = "killed (out of memory?)" if done.returncode < 0 else done.stderr.strip()[-300:]
        row = {"plane": plane, "workers": workers, "error": f"exit {done.returncode}: {why}"}
    else:
        row = json.loads(done.stdout.strip().splitlines()[-1])
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def markdown(rows: list[dict], anchors: dict[int, dict]) -> str:
    lines = [
        "| plane | W | coordinator TCP sent MB/step | TCP received MB/step | gather s | "
        "aggregation s | "
        "all_reduce anchor s | aggregation / anchor | step wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        anchor = anchors[row["workers"]]["all_reduce_s_median"]
        if "error" in row:
            lines.append(f"| {row['plane']} | {row['workers']} | not run: {row['error']} |")
            continue
        reduce = row["reduce_s_median"]
        aggregation = "—" if reduce is None else f"{reduce:.2f}"
        # one process has nothing to all-reduce: no ratio at W = 1
        ratio = "—" if reduce is None or row["workers"] < 2 else f"{reduce / anchor:.2f}"
        lines.append(
            f"| {row['plane']} | {row['workers']} | {row['coordinator_tcp_sent_mb_per_step']:.0f} | "
            f"{row['coordinator_tcp_received_mb_per_step']:.0f} | {row['gather_s_median']:.2f} | "
            f"{aggregation} | {anchor:.2f} | {ratio} | {row['step_wall_s_median']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    keep_freed_memory()  # as `userdp coordinator` and `userdp worker` do
    if argv[:1] == ["--worker"]:
        return run_worker(*argv[1:4])
    if argv[:1] == ["--row"]:  # one (plane, W) in a process of its own: an OOM loses one row
        plane, workers, params, steps = argv[1], *map(int, argv[2:5])
        print(json.dumps(bench_plane(plane, workers, params, steps)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000_000)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--planes", nargs="+", default=["grpc", "collective"])
    args = parser.parse_args(argv)
    anchors = {w: bench_all_reduce(w, args.params) for w in args.workers}
    rows = [
        _row_in_child(plane, w, args.params, args.steps)
        for w in args.workers
        for plane in args.planes
    ]
    record = {
        "params": args.params,
        "load_average": list(os.getloadavg()),
        "rows": rows,
        "anchors": list(anchors.values()),
        "goals": {
            "coordinator bytes per step": "independent of W within one model size (collective)",
            "collective gather": "<= 2x torch.distributed all_reduce of the same bytes (W = 4)",
        },
    }
    print(json.dumps(record, indent=2))
    print()
    print(markdown(rows, anchors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
