"""Fault injection: for every phase of the coordinator's step and every storage write, inject a
crash or an I/O error (a full disk), then check the privacy invariants and that a resumed run
finishes. The executable form of docs/privacy.md's contract:

* the ledger is never behind the releases (every step the release journal shows is charged);
* nothing is released twice (journal and ledger steps strictly increase, no duplicates);
* ε is recomputable from the ledger alone (it verifies, and re-accounting it gives the same ε);
* a new coordinator resumes from the checkpoint and the ledger and finishes the run.

The default suite runs a quick subset (one case of each kind); ``-m slow`` runs all of them.
"""

from __future__ import annotations

import errno
import math

import pytest
from safetensors import SafetensorError
from userdp.accounting import ledger as ledger_module
from userdp.accounting.api import compose_epsilon
from userdp.accounting.ledger import Ledger, group_phases, read_ledger, repair_ledger
from userdp.server import checkpoint as checkpoint_module
from userdp.server import coordinator as coordinator_module
from userdp.server.coordinator import PHASES, CoordinatorSettings
from userdp.server.release_journal import UNREADABLE_RELEASE, read_release_journal

from .harness import make_loopback
from .standins import open_ledger, uls_strategy

ALL = ["shard-00000", "shard-00001", "shard-00002", "shard-00003"]
STEPS = 4
FAULT_STEP = 1
DELTA = 1e-5


class SimulatedCrash(Exception):
    """The coordinator process dies here (nothing after this point runs)."""


def disk_full() -> OSError:
    return OSError(errno.ENOSPC, "No space left on device")


def inject(kind: str, where: str, monkeypatch):
    """A fault_hook (or None) and monkeypatches for fault ``kind`` at ``where``: ``crash`` and
    ``io-error`` raise at the start of a step phase; ``disk-full`` and ``torn`` make a storage
    write fail (``torn``: the ledger write and its undo both fail)."""
    if kind in ("crash", "io-error"):

        def hook(phase, step):
            if (phase, step) == (where, FAULT_STEP):
                raise SimulatedCrash(where) if kind == "crash" else disk_full()

        return hook
    if where == "ledger":  # the step record's write fails part-way (rolled back, or torn)
        real_write = ledger_module.os.write
        calls = {"n": 0}

        def write(fd, data):
            calls["n"] += 1
            if calls["n"] == FAULT_STEP + 1:  # the first append after the header is step 0
                real_write(fd, bytes(data[:30]))
                raise disk_full()
            return real_write(fd, data)

        monkeypatch.setattr(ledger_module.os, "write", write)
        if kind == "torn":  # the undo fails too: what a process killed mid-write leaves
            monkeypatch.setattr(
                ledger_module.os, "ftruncate", lambda fd, n: (_ for _ in ()).throw(disk_full())
            )
        return None
    if where == "checkpoint":  # the first checkpoint write of the run fails in the serializer
        real_save_file = checkpoint_module.save_file

        def failing_save_file(tensors, filename):  # safetensors' own error type on ENOSPC
            monkeypatch.setattr(checkpoint_module, "save_file", real_save_file)
            with open(filename, "wb") as handle:
                handle.write(b"\0" * 100)
            raise SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )

        monkeypatch.setattr(checkpoint_module, "save_file", failing_save_file)
        return None
    real_append = coordinator_module.append_release_journal

    def failing_append(directory, step, model_version, **commitment):
        if step == FAULT_STEP:
            raise disk_full()
        return real_append(directory, step, model_version, **commitment)

    monkeypatch.setattr(coordinator_module, "append_release_journal", failing_append)
    return None


def check_invariants(tmp_path, what: str) -> list[int]:
    header, records = read_ledger(tmp_path / "ledger.jsonl")
    charged = [r["step"] for r in records]
    released = [s for s in read_release_journal(tmp_path / "ckpt") if s < UNREADABLE_RELEASE]
    assert charged == sorted(set(charged)), f"{what}: ledger steps {charged} repeat or go back"
    assert released == sorted(set(released)), f"{what}: a step was released twice: {released}"
    assert set(released) <= set(charged), (
        f"{what}: released {sorted(set(released) - set(charged))} without a ledger record"
    )
    if records:
        phases = group_phases(records)
        eps = compose_epsilon(phases, DELTA)
        with Ledger.open(tmp_path / "ledger.jsonl") as ledger:
            assert math.isfinite(eps) and ledger.spent(DELTA) == eps, f"{what}: ε not recomputable"
    return charged


def run_case(tmp_path, monkeypatch, kind: str, where: str, checkpoint_every: int) -> None:
    what = f"{kind} at {where}, checkpoint every {checkpoint_every} step(s)"
    settings = CoordinatorSettings(
        step_deadline_s=60,
        task_deadline_s=30,
        worker_startup_s=300,
        checkpoint_every=checkpoint_every,
    )
    hook = inject(kind, where, monkeypatch)
    loop = make_loopback(
        tmp_path, strategy=uls_strategy(), fault_hook=hook, no_noise=False, settings=settings
    )
    try:
        loop.add_worker("w0", ALL)
        loop.coordinator.wait_for_workers()
        with pytest.raises((SimulatedCrash, OSError, ledger_module.LedgerWriteError)):
            loop.coordinator.run(STEPS)
    finally:
        loop.close()
    monkeypatch.undo()  # the process restarts; the disk has space again
    left = sorted(p.name for p in (tmp_path / "ckpt").glob(".tmp-ckpt-*"))
    assert not left, f"{what}: temporary checkpoint folders left behind: {left}"
    if kind == "torn":
        with pytest.raises(ledger_module.LedgerTruncatedError, match="userdp ledger repair"):
            open_ledger(tmp_path / "ledger.jsonl")
        assert repair_ledger(tmp_path / "ledger.jsonl") is not None
    check_invariants(tmp_path, what)

    loop = make_loopback(tmp_path, strategy=uls_strategy(), no_noise=False, settings=settings)
    try:
        loop.add_worker("w0", ALL)
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(STEPS)
    finally:
        loop.close()
    charged = check_invariants(tmp_path, f"{what}, after resume")
    assert charged[-1] == STEPS - 1, f"{what}: the resumed run did not finish ({charged})"


CASES = [(kind, phase) for phase in PHASES for kind in ("crash", "io-error")] + [
    ("disk-full", "ledger-write"),
    ("torn", "ledger-write"),
    ("disk-full", "checkpoint-write"),
    ("disk-full", "journal-write"),
]
CHECKPOINT_EVERY = (1, 3)  # a checkpoint before every broadcast, and released steps lost on crash
QUICK = {
    ("crash", "ledger", 3),
    ("io-error", "broadcast", 3),
    ("torn", "ledger-write", 1),
    ("disk-full", "checkpoint-write", 3),
    ("disk-full", "journal-write", 1),
}


def _param(kind, where, every):
    marks = () if (kind, where, every) in QUICK else (pytest.mark.slow,)
    return pytest.param(kind, where, every, marks=marks, id=f"{kind}-{where}-ckpt{every}")


@pytest.mark.parametrize(
    "kind, where, every", [_param(k, w, e) for k, w in CASES for e in CHECKPOINT_EVERY]
)
def test_fault_then_resume_keeps_the_invariants(tmp_path, monkeypatch, kind, where, every):
    run_case(tmp_path, monkeypatch, kind, where.removesuffix("-write"), every)
