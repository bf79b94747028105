"""atomic_write: the target holds the old content or the new one, and no temporary is left;
append_durably: all of a record is appended and fsync'd, or the file is as it was."""

from __future__ import annotations

import errno
import json
import os

import pytest
from userdp.accounting.durable import (
    TornAppendError,
    append_durably,
    atomic_write,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    publish_directory,
)


def test_each_form_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "report.json"
    atomic_write_bytes(target, b"old")
    atomic_write_text(target, "näive\n")
    assert target.read_text(encoding="utf-8") == "näive\n"
    atomic_write_json(target, {"b": 1, "a": [2]}, sort_keys=True)
    assert target.read_text() == json.dumps({"a": [2], "b": 1})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


def test_a_failed_write_keeps_the_old_content_and_removes_its_temporary(tmp_path):
    target = tmp_path / "LATEST"
    atomic_write_text(target, "ckpt-1\n")

    def torn(temporary):
        temporary.write_text("ckpt-")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        atomic_write(target, torn)
    assert target.read_text() == "ckpt-1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["LATEST"]


def test_the_file_gets_the_permissions_open_gives(tmp_path):
    umask = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "privacy_report.md", "report")
        (tmp_path / "plain").write_text("plain")
    finally:
        os.umask(umask)
    mode = (tmp_path / "privacy_report.md").stat().st_mode & 0o777
    assert mode == (tmp_path / "plain").stat().st_mode & 0o777


def test_a_published_folder_is_fsynced_then_renamed_and_never_overwritten(tmp_path, monkeypatch):
    """Every file and folder of the staging folder is fsync'd before the rename, the parent
    after it; a target that exists already is an OSError and is left as it was."""
    from userdp.accounting import durable

    staging = tmp_path / "staging"
    (staging / "inner").mkdir(parents=True)
    (staging / "a.bin").write_bytes(b"a")
    (staging / "inner" / "b.bin").write_bytes(b"b")
    synced: list[tuple[str, bool]] = []
    real = durable.fsync_path
    monkeypatch.setattr(
        durable,
        "fsync_path",
        lambda path: (synced.append((path.name, (tmp_path / "target").exists())), real(path)),
    )
    publish_directory(staging, tmp_path / "target")
    assert (tmp_path / "target" / "inner" / "b.bin").read_bytes() == b"b"
    assert not staging.exists()
    before_rename = {name for name, renamed in synced if not renamed}
    assert {"a.bin", "b.bin", "inner", "staging"} <= before_rename
    assert synced[-1] == (tmp_path.name, True)  # the parent's entry, after the rename
    again = tmp_path / "again"
    again.mkdir()
    (again / "c.bin").write_bytes(b"c")
    (tmp_path / "target" / "keep").write_bytes(b"k")
    with pytest.raises(OSError):
        publish_directory(again, tmp_path / "target")
    assert (tmp_path / "target" / "keep").read_bytes() == b"k" and again.is_dir()


def _disk_full_after(monkeypatch, nbytes):
    """os.write writes ``nbytes`` of what it is given, then fails like a full disk."""
    real = os.write

    def write(fd, data):
        real(fd, bytes(data[:nbytes]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", write)


def test_an_append_is_written_whole_and_fsynced(tmp_path, monkeypatch):
    path = tmp_path / "released.jsonl"
    path.write_bytes(b"one\n")
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd)))
    with open(path, "ab", buffering=0) as handle:
        append_durably(handle.fileno(), b"two\n")
        assert synced == [handle.fileno()]
    assert path.read_bytes() == b"one\ntwo\n"


def test_a_failed_append_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    """A partial record reached the file, then ENOSPC: the partial bytes are cut off again."""
    path = tmp_path / "ledger.jsonl"
    path.write_bytes(b"one\n")
    with open(path, "ab", buffering=0) as handle:
        _disk_full_after(monkeypatch, 3)
        with pytest.raises(OSError, match="No space") as raised:
            append_durably(handle.fileno(), b"a long record\n")
        monkeypatch.undo()
    assert not isinstance(raised.value, TornAppendError)
    assert path.read_bytes() == b"one\n"


def test_a_failed_undo_is_a_torn_append_naming_both_errors(tmp_path, monkeypatch):
    path = tmp_path / "ledger.jsonl"
    path.write_bytes(b"one\n")
    with open(path, "ab", buffering=0) as handle:
        _disk_full_after(monkeypatch, 3)
        monkeypatch.setattr(
            os, "ftruncate", lambda fd, n: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error"))
        )
        with pytest.raises(TornAppendError) as raised:
            append_durably(handle.fileno(), b"a long record\n")
        monkeypatch.undo()
    assert raised.value.append_error.errno == errno.ENOSPC
    assert raised.value.undo_error.errno == errno.EIO
    assert path.read_bytes() == b"one\na l"  # the torn tail a repair (or a reader) must handle
