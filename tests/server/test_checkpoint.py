"""Checkpoints: nested state round-trips without pickle; writes are atomic; a failed write (a full
disk, under the real serializer) leaves the previous checkpoint the latest and nothing else."""

from __future__ import annotations

import contextlib
import errno
import json
import shutil
import subprocess

import numpy as np
import pytest
import torch
from safetensors import SafetensorError
from userdp.server import checkpoint as checkpoint_module
from userdp.server.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    load_checkpoint,
    load_latest,
    restore_latest,
    save_checkpoint,
)


def test_nested_state_round_trip(tmp_path):
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))])
    optimizer.param_groups[0]["params"][0].grad = torch.ones(3)
    optimizer.step()
    state = {
        "params": {"w": torch.arange(4.0)},
        "optimizer": optimizer.state_dict(),  # int keys, tuples (betas), tensors
        "strategy": {"buffer": np.arange(3.0), "steps": [1, 2], "name": "blt", "x": None},
    }
    save_checkpoint(tmp_path, step=5, model_version=6, ledger_entries=5, state=state)
    ckpt = load_latest(tmp_path)
    assert (ckpt.step, ckpt.model_version, ckpt.ledger_entries) == (5, 6, 5)
    assert torch.equal(ckpt.state["params"]["w"], torch.arange(4.0))
    restored = torch.optim.Adam([torch.nn.Parameter(torch.ones(3))])
    restored.load_state_dict(ckpt.state["optimizer"])
    assert restored.state_dict()["param_groups"][0]["betas"] == (0.9, 0.999)
    assert torch.equal(
        restored.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"]
    )
    np.testing.assert_array_equal(ckpt.state["strategy"]["buffer"], np.arange(3.0))
    assert ckpt.state["strategy"]["steps"] == [1, 2] and ckpt.state["strategy"]["x"] is None
    assert not any(p.suffix == ".pkl" for p in tmp_path.rglob("*"))


def test_latest_points_to_newest_and_old_ones_are_pruned(tmp_path):
    for step in range(4):
        save_checkpoint(
            tmp_path,
            step=step,
            model_version=step,
            ledger_entries=step,
            state={"p": {"w": torch.full((2,), float(step))}},
            keep=2,
        )
    assert load_latest(tmp_path).step == 3
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-000000002", "ckpt-000000003"]


def test_half_written_checkpoint_is_invisible(tmp_path):
    save_checkpoint(tmp_path, step=1, model_version=1, ledger_entries=1, state={"a": 1})
    (tmp_path / ".tmp-ckpt-000000002-dead").mkdir()  # a crash mid-write leaves only this
    assert load_latest(tmp_path).step == 1
    assert load_latest(tmp_path / "nothing") is None


def test_unknown_format_version_refused(tmp_path):
    path = save_checkpoint(tmp_path, step=1, model_version=1, ledger_entries=1, state={})
    meta = json.loads((path / "state.json").read_text())
    meta["format_version"] = 99
    (path / "state.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="format"):
        load_latest(tmp_path)


def _state(value: float) -> dict:
    return {"params": {"w": torch.full((4,), float(value))}, "strategy": {}}


def _no_temporary_folders(directory) -> None:
    left = sorted(p.name for p in directory.iterdir() if p.name.startswith(".tmp-ckpt-"))
    assert not left, f"temporary checkpoint folders left behind: {left}"


def _check_failed_write(exc_info, directory) -> None:
    """The one-line error of a checkpoint that a full disk stopped: the cause, the checkpoint that
    stays the latest, the action; nothing of it left on disk."""
    message = str(exc_info.value)
    assert len(message.splitlines()) == 1, message
    assert exc_info.value.errno == errno.ENOSPC
    assert "(disk full: No space left on device)" in message, message
    assert "ckpt-000000001 stays the latest checkpoint" in message, message
    assert f"free space in {directory}, then run the same command to resume" in message, message
    _no_temporary_folders(directory)
    assert (directory / "LATEST").read_text().strip() == "ckpt-000000001"
    assert not (directory / "ckpt-000000002").exists()
    previous = load_latest(directory)
    assert previous.step == 1 and torch.equal(previous.state["params"]["w"], torch.full((4,), 1.0))


def test_serializer_failure_is_a_failed_checkpoint(tmp_path, monkeypatch):
    """safetensors reports a full disk with its own exception type, not OSError: the write is
    still a failed checkpoint (temporary folder removed, LATEST unchanged, one line naming the
    cause and the action), and a later write succeeds."""
    real_save_file = checkpoint_module.save_file

    def disk_full(tensors, filename):  # what safetensors does on ENOSPC: part written, then this
        with open(filename, "wb") as handle:
            handle.write(b"\0" * 100)
        raise SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    save_checkpoint(tmp_path, step=1, model_version=1, ledger_entries=1, state=_state(1.0))
    monkeypatch.setattr(checkpoint_module, "save_file", disk_full)
    with pytest.raises(CheckpointWriteError) as failed:
        save_checkpoint(tmp_path, step=2, model_version=2, ledger_entries=2, state=_state(2.0))
    assert isinstance(failed.value.__cause__, SafetensorError)
    _check_failed_write(failed, tmp_path)
    monkeypatch.setattr(checkpoint_module, "save_file", real_save_file)  # space freed
    save_checkpoint(tmp_path, step=2, model_version=2, ledger_entries=2, state=_state(2.0))
    assert load_latest(tmp_path).step == 2


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs (root only; skipped where mounting is not permitted)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_tmpfs_fails_the_checkpoint_and_freed_space_lets_it_resume(small_tmpfs):
    """A real full disk (a 4 MiB tmpfs filled by another file) under the real serializer."""
    directory = small_tmpfs / "checkpoints"
    save_checkpoint(directory, step=1, model_version=1, ledger_entries=1, state=_state(1.0))
    filler = small_tmpfs / "filler"
    with open(filler, "ab", buffering=0) as handle:
        for size in (1 << 20, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while True:
                    handle.write(b"\0" * size)
    big = {"params": {"w": torch.full((4,), 2.0), "v": torch.ones(1 << 18)}}  # 1 MiB
    with pytest.raises(CheckpointWriteError) as failed:
        save_checkpoint(directory, step=2, model_version=2, ledger_entries=2, state=big)
    assert isinstance(failed.value.__cause__, SafetensorError)  # the serializer's own type
    _check_failed_write(failed, directory)
    filler.unlink()
    save_checkpoint(directory, step=2, model_version=2, ledger_entries=2, state=big)
    resumed = load_latest(directory)
    assert resumed.step == 2 and torch.equal(resumed.state["params"]["v"], torch.ones(1 << 18))


def _two_checkpoints(directory) -> None:
    for step in (1, 2):
        save_checkpoint(
            directory, step=step, model_version=step, ledger_entries=step, state=_state(step)
        )


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda d: shutil.rmtree(d / "ckpt-000000002"), "ckpt-000000002: missing"),
        (
            lambda d: _flip_a_byte(d / "ckpt-000000002" / "tensors.safetensors"),
            "ckpt-000000002: tensors.safetensors does not match its checksum",
        ),
        (
            lambda d: (d / "ckpt-000000002" / "state.json").write_text(
                (d / "ckpt-000000002" / "state.json").read_text().replace('"step": 2', '"step": 3')
            ),
            "ckpt-000000002: state.json does not match its checksum",
        ),
        (lambda d: (d / "LATEST").unlink(), "LATEST is missing"),
    ],
    ids=["deleted", "tensors-corrupted", "state-edited", "no-latest"],
)
def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_that_verifies(
    tmp_path, damage, reason
):
    _two_checkpoints(tmp_path)
    damage(tmp_path)
    if "LATEST" in reason:  # then the newest folder is taken, without a pointer
        taken = load_latest(tmp_path)
        assert taken.step == 2 and taken.fallback == reason and taken.passed_over == ()
        return
    taken = load_latest(tmp_path)
    assert taken.step == 1 and torch.equal(taken.state["params"]["w"], torch.full((4,), 1.0))
    assert taken.fallback == reason
    with pytest.raises(CheckpointError, match="checksum|missing"):
        load_checkpoint(tmp_path / "ckpt-000000002")


def test_restore_sets_the_passed_over_checkpoint_aside_and_says_so(tmp_path, caplog):
    _two_checkpoints(tmp_path)
    _flip_a_byte(tmp_path / "ckpt-000000002" / "tensors.safetensors")
    params = {"w": torch.zeros(4)}
    strategy = type("S", (), {"load_state_dict": lambda self, state: None})()
    with caplog.at_level("WARNING", logger="userdp.server.checkpoint"):
        taken = restore_latest(tmp_path, params, strategy)
    assert taken.step == 1 and torch.equal(params["w"], torch.full((4,), 1.0))
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("resuming from ckpt-000000001 (step 1), the newest checkpoint that")
    assert "ckpt-000000002: tensors.safetensors does not match its checksum" in line
    assert "kept as unverified-ckpt-000000002" in line
    assert (tmp_path / "unverified-ckpt-000000002").is_dir()
    assert (tmp_path / "LATEST").read_text().strip() == "ckpt-000000001"
    assert load_latest(tmp_path).fallback is None  # the next resume takes it directly


def test_the_callers_check_is_applied_and_none_verifying_is_one_clear_error(tmp_path):
    _two_checkpoints(tmp_path)
    taken = load_latest(tmp_path, check=lambda c: "ahead of the ledger" if c.step == 2 else None)
    assert taken.step == 1 and taken.fallback == "ckpt-000000002: ahead of the ledger"
    with pytest.raises(CheckpointError) as none:
        load_latest(tmp_path, check=lambda c: "ahead of the ledger")
    message = str(none.value)
    assert len(message.splitlines()) == 1
    assert "ckpt-000000002: ahead of the ledger; ckpt-000000001: ahead of the ledger" in message
    assert "restore one from a backup, or move the ckpt-* folders and LATEST out of it" in message
