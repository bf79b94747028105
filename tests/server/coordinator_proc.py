"""A coordinator PROCESS for the SIGKILL test: real ULS strategy, toy workers in threads, the
ledger and checkpoints in DIR. ``python -m tests.server.coordinator_proc DIR STEPS``.

Every model version the worker applies is appended (fsync'd) to DIR/received.txt with its kind
(update = a step's noisy update; full = a resync), so the test knows which noisy updates left
the coordinator before it was killed."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

from tests.server.harness import make_loopback
from tests.server.toy import ToyCompute

ALL = ["shard-00000", "shard-00001", "shard-00002", "shard-00003"]


class RecordingCompute(ToyCompute):
    def __init__(self, path: Path) -> None:
        super().__init__()
        self.path = path
        self.lock = threading.Lock()

    def record(self, version: int, full: bool) -> None:
        with self.lock, open(self.path, "a") as handle:
            handle.write(f"{version} {'full' if full else 'update'}\n")
            handle.flush()
            os.fsync(handle.fileno())


def main(directory: str, steps: str) -> int:
    from tests.server.standins import uls_strategy

    out = Path(directory)
    loop = make_loopback(out, strategy=uls_strategy(), no_noise=False)
    compute = RecordingCompute(out / "received.txt")
    client = loop.add_worker("w0", ALL, compute=compute)
    original = client._receive_version

    def receive_and_record(model, commit):
        tensors = original(model, commit)
        if tensors is not None:
            compute.record(commit.model_version, commit.full)
        return tensors

    client._receive_version = receive_and_record
    loop.coordinator.wait_for_workers()
    print(f"start {loop.coordinator.step} {loop.coordinator.model_version}", flush=True)
    loop.coordinator.run(int(steps))
    print("done", flush=True)
    loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
