"""Kill the coordinator at every phase of a step, resume, and check the DP contracts:
ε reported ≥ ε of the steps released, no noise draw reused, model and ledger consistent."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from userdp.accounting import UlsMechanism, epsilon
from userdp.server.checkpoint import load_checkpoint, load_latest
from userdp.server.coordinator import PHASES
from userdp.server.release_journal import commitment_problem, read_release_records
from userdp.strategies.builtins import UserLevelSampling
from userdp.strategies.dpftrl import BltDpFtrl
from userdp.strategies.optimizers import Sgd

from userdp import cli

from .harness import make_loopback

ALL = ["shard-00000", "shard-00001", "shard-00002", "shard-00003"]


class SimulatedCrash(Exception):
    pass


class NoiseSpy(UserLevelSampling):
    """The real ULS strategy, recording every noise draw (noisy - sum) to detect reuse."""

    def __init__(self, draws):
        super().__init__(
            noise_multiplier=1.0, clip_norm=1.0, sampling_prob=0.3, seed=0, optimizer=Sgd(0.1)
        )
        self.draws = draws

    def add_noise(self, step, summed, stats=None):
        noisy = super().add_noise(step, summed, stats)
        self.draws.append((step, {n: noisy[n] - summed[n] for n in summed}))
        return noisy


@pytest.mark.parametrize("phase", PHASES)
def test_crash_at_every_phase_then_resume(tmp_path, phase):
    draws = []
    reached = []

    def crash(at_phase, step):
        reached.append((step, at_phase))
        if (at_phase, step) == (phase, 1):
            raise SimulatedCrash(phase)

    loop = make_loopback(tmp_path, strategy=NoiseSpy(draws), fault_hook=crash, no_noise=False)
    try:
        client = loop.add_worker("w0", ALL)
        loop.coordinator.wait_for_workers()
        with pytest.raises(SimulatedCrash):
            loop.coordinator.run(3)
        held_version = client.model_version
    finally:
        loop.close()
    released = {s for s, p in reached if p == "done"}  # broadcast finished
    charged = [r["step"] for r in loop.coordinator.ledger.records]
    assert released <= set(charged), "a released step is not in the ledger"
    # crashed after the ledger append but before the checkpoint: charged, never broadcast
    replay = phase in ("update", "checkpoint")

    loop2 = make_loopback(tmp_path, strategy=NoiseSpy(draws), no_noise=False)
    try:
        checkpoint = load_latest(tmp_path / "ckpt")
        for name, value in loop2.coordinator.params.items():
            assert torch.equal(value, checkpoint.state["params"][name])
        # the ledger, not the checkpoint, decides where the run continues
        assert loop2.coordinator.step == (max(charged) if replay else max(charged) + 1)
        # any version a worker might hold from before the crash is older than the current one
        assert loop2.coordinator.model_version > held_version or (
            held_version == checkpoint.model_version == loop2.coordinator.model_version
        )
        loop2_start = loop2.coordinator.step
        returning = loop2.add_worker("w0", ALL)
        returning.model_version = held_version
        loop2.coordinator.wait_for_workers()
        loop2.coordinator.run(3)
    finally:
        loop2.close()
    final = [r["step"] for r in loop2.coordinator.ledger.records]
    assert final == sorted(set(final)) and final[-1] == 2  # no step charged twice
    steps_released = len(released) + (3 - loop2_start)
    mech = UlsMechanism(noise_multiplier=1.0, sampling_prob=0.3)
    assert len(final) >= steps_released
    assert epsilon(mech, len(final), 1e-5) >= epsilon(mech, steps_released, 1e-5) - 1e-12
    # every noise draw is fresh: no two are equal, in particular not across the crash
    flat = [torch.cat([d[n].flatten() for n in sorted(d)]) for _, d in draws]
    for i in range(len(flat)):
        for j in range(i):
            assert not torch.equal(flat[i], flat[j])
    draws_of_step_1 = sum(1 for s, _ in draws if s == 1)
    if phase in ("sync", "sample", "plan", "gather", "noise", "ledger"):
        assert 1 not in charged  # crashed before the ledger append: nothing charged
        assert draws_of_step_1 == (2 if phase == "ledger" else 1)  # replayed with FRESH noise
    elif replay:
        assert 1 in charged  # charged, never released: replayed with fresh noise, charged once
        assert draws_of_step_1 == 2 and final.count(1) == 1
    else:
        assert 1 in charged and draws_of_step_1 == 1  # released (checkpointed): not replayed
    # the commitments: each release is the draw the ledger charged; the replayed step's is not
    # the draw the crash discarded (which the ledger committed to with the charge)
    records = loop2.coordinator.ledger.records
    journal = read_release_records(tmp_path / "ckpt")
    committed = {r["step"]: r["release_sha256"] for r in records}
    released = {line["step"]: line for line in journal}
    if 1 in released:  # (not after a crash at the broadcast: step 1 went out with step 2)
        assert released[1].get("replayed", False) == replay
        assert (released[1]["release_sha256"] == committed[1]) != replay
    assert commitment_problem(records, journal) is None


@pytest.mark.parametrize("phase", ["noise", "checkpoint", "broadcast"])
def test_blt_state_survives_a_crash(tmp_path, phase):
    """BLT-DP-FTRL's correlated-noise buffers are checkpointed with the model and restored."""

    def strategy():
        return BltDpFtrl(
            noise_multiplier=1.0, clip_norm=1.0, bins=2, epochs=3, banded_coefs=[1.0, 0.5], seed=0
        )

    def crash(at_phase, step):
        if (at_phase, step) == (phase, 2):
            raise SimulatedCrash(phase)

    loop = make_loopback(tmp_path, strategy=strategy(), fault_hook=crash, no_noise=False)
    try:
        loop.add_worker("w0", ALL)
        loop.coordinator.wait_for_workers()
        with pytest.raises(SimulatedCrash):
            loop.coordinator.run(6)
        saved = loop.coordinator.strategy.state_dict()
    finally:
        loop.close()
    loop2 = make_loopback(tmp_path, strategy=strategy(), no_noise=False)
    try:
        checkpoint = load_latest(tmp_path / "ckpt")
        restored = loop2.coordinator.strategy.state_dict()
        assert json.dumps(_plain(restored), sort_keys=True) == json.dumps(
            _plain(checkpoint.state["strategy"]), sort_keys=True
        )
        if phase == "noise":  # crashed before anything of step 2 was released or checkpointed
            assert (
                json.dumps(_plain(restored), sort_keys=True)
                == json.dumps(_plain(saved), sort_keys=True)
                or loop2.coordinator.step == 2
            )
        loop2.add_worker("w0", ALL)
        loop2.coordinator.wait_for_workers()
        loop2.coordinator.run(6)
    finally:
        loop2.close()
    final = [r["step"] for r in loop2.coordinator.ledger.records]
    assert final == sorted(set(final)) and final[-1] == 5


def test_blt_resume_refuses_when_released_noise_state_was_lost(tmp_path):
    """checkpoint_every > 1: released steps after the last checkpoint advanced the BLT state, which
    is lost; resuming would break the correlation, so it is refused (the ledger keeps them)."""
    from userdp.server.coordinator import CoordinatorSettings, ResumeError

    def crash(at_phase, step):
        if (at_phase, step) == ("sync", 3):
            raise SimulatedCrash()

    settings = CoordinatorSettings(step_deadline_s=20, task_deadline_s=5, checkpoint_every=2)
    strategy = BltDpFtrl(
        noise_multiplier=1.0, clip_norm=1.0, bins=2, epochs=3, banded_coefs=[1.0, 0.5], seed=0
    )
    loop = make_loopback(
        tmp_path, strategy=strategy, settings=settings, fault_hook=crash, no_noise=False
    )
    try:
        loop.add_worker("w0", ALL)
        loop.coordinator.wait_for_workers()
        with pytest.raises(SimulatedCrash):
            loop.coordinator.run(6)
    finally:
        loop.close()
    assert [r["step"] for r in loop.coordinator.ledger.records] == [0, 1, 2]  # step 2 released
    again = BltDpFtrl(
        noise_multiplier=1.0, clip_norm=1.0, bins=2, epochs=3, banded_coefs=[1.0, 0.5], seed=0
    )
    with pytest.raises(ResumeError, match="checkpoint_every = 1"):
        make_loopback(tmp_path, strategy=again, settings=settings, no_noise=False)


def _plain(tree):
    """JSON-comparable copy of a state dict (arrays as lists)."""
    if isinstance(tree, dict):
        return {str(k): _plain(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return [_plain(v) for v in tree]
    if hasattr(tree, "tolist"):
        return tree.tolist()
    return tree


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_resume_falls_back_to_an_older_checkpoint_and_releases_no_step_twice(
    tmp_path, caplog, damage
):
    """The latest checkpoint deleted or truncated: resume takes the older one, says so in one
    line, continues after the step charged and released since (never re-run), and the ledger
    verifies with each step once."""
    checkpoints = tmp_path / "checkpoints"  # a run folder's layout: `ledger verify` reads it
    loop = make_loopback(
        tmp_path, strategy=NoiseSpy([]), no_noise=False, checkpoint_dir=checkpoints
    )
    try:
        loop.add_worker("w0", ALL)
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(3)
    finally:
        loop.close()
    older = load_checkpoint(checkpoints / "ckpt-000000002")
    latest = checkpoints / "ckpt-000000003"
    if damage == "deleted":
        shutil.rmtree(latest)
    else:
        tensors = latest / "tensors.safetensors"
        tensors.write_bytes(tensors.read_bytes()[:-50])
    with caplog.at_level(logging.WARNING):
        loop2 = make_loopback(
            tmp_path, strategy=NoiseSpy([]), no_noise=False, checkpoint_dir=checkpoints
        )
    try:
        lines = [r.getMessage() for r in caplog.records if "resuming from" in r.getMessage()]
        assert len(lines) == 1 and lines[0].startswith(
            "resuming from ckpt-000000002 (step 2), the newest checkpoint that verifies: "
            "ckpt-000000003: "
        ), lines
        for name, value in loop2.coordinator.params.items():
            assert torch.equal(value, older.state["params"][name])
        assert loop2.coordinator.step == 3  # step 2 was charged and released: not re-run
        broadcast = max(r["model_version"] for r in read_release_records(checkpoints))
        assert loop2.coordinator.model_version > broadcast  # no worker's copy is trusted
        loop2.add_worker("w0", ALL)
        loop2.coordinator.wait_for_workers()
        loop2.coordinator.run(5)
    finally:
        loop2.close()
    charged = [r["step"] for r in loop2.coordinator.ledger.records]
    assert charged == [0, 1, 2, 3, 4]
    assert [r["step"] for r in read_release_records(checkpoints)] == [0, 1, 2, 3, 4]
    assert cli.main(["ledger", "verify", str(tmp_path)]) == 0


def test_resume_refuses_when_the_ledger_lost_a_released_step(tmp_path):
    """The ledger's last complete record removed (its chain still verifies): the release journal
    shows that step released, so resuming would release it again; resume refuses, naming it."""
    from userdp.server.coordinator import ResumeError

    loop = make_loopback(tmp_path, strategy=NoiseSpy([]), no_noise=False)
    try:
        loop.add_worker("w0", ALL)
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(3)
    finally:
        loop.close()
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("".join(ledger.read_text().splitlines(keepends=True)[:-1]))
    with pytest.raises(
        ResumeError, match=r"shows step\(s\) \[2\] released but the ledger does not"
    ):
        make_loopback(tmp_path, strategy=NoiseSpy([]), no_noise=False)


def test_a_ledger_cut_short_after_a_release_is_repaired_and_the_run_resumes(tmp_path, capsys):
    """The ledger's last line cut short after its step was broadcast: resume stops naming
    `userdp ledger repair` (not claiming the step was never released), the repair charges it
    again, and the same run resumes and finishes with each step charged and released once."""
    from userdp.accounting.ledger import LedgerTruncatedError

    checkpoints = tmp_path / "checkpoints"
    loop = make_loopback(
        tmp_path, strategy=NoiseSpy([]), no_noise=False, checkpoint_dir=checkpoints
    )
    try:
        loop.add_worker("w0", ALL)
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(3)
    finally:
        loop.close()
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_bytes(ledger.read_bytes()[:-61])  # the newline, `type` and part of `time`
    with pytest.raises(LedgerTruncatedError, match="Run `userdp ledger repair RUN_DIR`") as cut:
        make_loopback(tmp_path, strategy=NoiseSpy([]), no_noise=False, checkpoint_dir=checkpoints)
    assert "so never released" not in str(cut.value)
    assert cli.main(["ledger", "repair", str(tmp_path)]) == 0
    assert "after step 2 was released" in capsys.readouterr().out
    loop = make_loopback(
        tmp_path, strategy=NoiseSpy([]), no_noise=False, checkpoint_dir=checkpoints
    )
    try:
        loop.add_worker("w0", ALL)
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(5)
    finally:
        loop.close()
    assert [r["step"] for r in loop.coordinator.ledger.records] == [0, 1, 2, 3, 4]
    assert [r["step"] for r in read_release_records(checkpoints)] == [0, 1, 2, 3, 4]
    assert cli.main(["ledger", "verify", str(tmp_path)]) == 0
