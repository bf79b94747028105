"""One rank of a worker's ranks, without DeepSpeed or gRPC (run under torchrun by
test_worker_ranks.py).

    python -m torch.distributed.run --nproc-per-node 2 worker_rank_main.py OUT_DIR SCENARIO

Every rank builds the loop engine on a tiny GPT-2 initialized with a seed of its own (so only the
model broadcast can make the ranks agree) and an :class:`EngineCompute` over :class:`ByteStore`.
Rank 0 drives :class:`BroadcastCompute` like the worker's gRPC client does; the others run
:func:`follow`. SCENARIO:

- ``serve``: a model version, a task, a task one rank cannot read, the first task again (with
  idle keepalives in between), then stop. Rank 0 writes its results; every rank writes a marker
  once it has returned.
- ``rank0-dies``: a model version, then rank 0 exits (status 3) without stopping the others.
"""

from __future__ import annotations

import faulthandler
import hashlib
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

# run as a script by torch's launcher, outside pytest: the checkout root is put on the path here
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

UNREADABLE_ON_RANK_1 = "user-unreadable-on-rank-1"
SCALE = 1.5  # the model version rank 0 sends: its own initial parameters x SCALE


class ByteStore:
    """TEST DOUBLE of a ShardStore: each user's examples drawn from a generator keyed by the user
    id; ``failing`` names a user whose read raises (as an I/O error would)."""

    def __init__(self, failing: str = "") -> None:
        self.failing = failing

    def user_examples(self, user: str) -> list[np.ndarray]:
        if user == self.failing:
            raise OSError(f"injected read error for {user}")
        seed = int.from_bytes(hashlib.sha256(user.encode()).digest()[:8], "big")
        rng = np.random.default_rng(seed)
        return [rng.integers(3, 259, size=int(rng.integers(4, 24))) for _ in range(3)]


def task(task_id: str, units: list[str]):
    from userdp.proto import userdp_v1_pb2 as pb

    return pb.Task(
        task_id=task_id,
        step=4,
        model_version=1,
        unit_ids=units,
        clip_norm=7.5,
        engine=pb.EngineOptions(engine="loop"),
        selection=pb.Selection(group_size=2, seq_len=24),
        selection_seed=11,
    )


GOOD_UNITS = [f"user-{i}" for i in range(7)]


def model_version(module) -> dict:
    """Rank 0's model version, as the wire delivers it."""
    from userdp.proto.tensors import decode_chunks, tensors_chunks

    scaled = {n: p.detach() * SCALE for n, p in module.named_parameters() if p.requires_grad}
    return decode_chunks(tensors_chunks(scaled))


def main(out_dir: str, scenario: str) -> None:
    import torch
    from safetensors.torch import save_file
    from userdp.clients.engine import ClippingEngine, Unit
    from userdp.clients.ranks import BroadcastCompute, follow
    from userdp.clients.worker_service import EngineCompute

    from tests.clients.engine_fixtures import tiny_model

    torch.distributed.init_process_group("gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    out = Path(out_dir)
    engine = ClippingEngine(tiny_model(seed=rank), engine="loop")
    store = ByteStore(failing=UNREADABLE_ON_RANK_1 if rank == 1 else "")
    compute = EngineCompute(store, engine, Unit)
    if rank > 0:
        follow(compute)
        assert not torch.distributed.is_initialized()  # left with rank 0
        (out / f"followed-{rank}").write_text("stopped by rank 0")
        return
    ranks = BroadcastCompute(compute, keepalive_s=0.1)
    ranks.apply_model(model_version(engine.module), full=True)
    if scenario == "rank0-dies":
        os._exit(3)
    time.sleep(0.5)  # idle keepalives while the coordinator sends nothing
    first = ranks.compute(task("t1", GOOD_UNITS))
    errors = []
    try:
        ranks.compute(task("t2", GOOD_UNITS[:3] + [UNREADABLE_ON_RANK_1]))
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        errors.append(f"{type(exc).__name__}: {exc}")
    time.sleep(0.3)
    again = ranks.compute(task("t3", GOOD_UNITS))
    ranks.stop()
    save_file({k: v.contiguous() for k, v in first.sums.items()}, str(out / "first.st"))
    save_file({k: v.contiguous() for k, v in again.sums.items()}, str(out / "again.st"))
    facts = {
        "stats": asdict(first.stats),
        "errors": errors,
        "world": world,
        "group_left": not torch.distributed.is_initialized(),
    }
    (out / "rank0.json").write_text(json.dumps(facts))
    (out / "followed-0").write_text("stopped the others")


if __name__ == "__main__":
    faulthandler.enable()  # a native abort prints every thread's Python stack
    main(sys.argv[1], sys.argv[2])
    # the results are written and the ranks left together: exit without interpreter finalization,
    # whose teardown of native threads' leftovers can abort a process that did all its work
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
