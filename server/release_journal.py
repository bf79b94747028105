"""The coordinator's release journal: an fsync'd line per step whose update is about to leave the
coordinator (``checkpoints/released.jsonl``). Resume reads it so that a step broadcast after the
last checkpoint is never released twice; ``userdp ledger verify`` reads it to check that every
released step is charged in the ledger. Plain files and JSON: no model library is needed to read
it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = [
    "RELEASE_JOURNAL",
    "UNREADABLE_RELEASE",
    "append_release_journal",
    "read_release_journal",
    "read_release_records",
]

RELEASE_JOURNAL = "released.jsonl"
UNREADABLE_RELEASE = 10**18
"""The step :func:`read_release_journal` reports for a torn line: later than any real step."""


def append_release_journal(directory: str | Path, step: int, model_version: int) -> None:
    """Record (fsync'd) that ``step``'s update is about to leave the coordinator."""
    directory = Path(directory)
    path = directory / RELEASE_JOURNAL
    try:
        directory.mkdir(parents=True, exist_ok=True)
        line = (json.dumps({"step": step, "model_version": model_version}) + "\n").encode()
        with open(path, "ab", buffering=0) as handle:
            end = handle.tell()
            try:
                view = memoryview(line)
                while view:
                    view = view[handle.write(view) :]
                os.fsync(handle.fileno())
            except OSError:
                os.ftruncate(handle.fileno(), end)  # no torn line: the step is not recorded
                raise
    except OSError as exc:  # nothing of the step has left: it is not broadcast
        raise OSError(
            exc.errno,
            f"{exc.strerror or exc} while recording the release of step {step}",
            str(path),
        ) from exc


def read_release_records(directory: str | Path) -> list[dict]:
    """The lines of the journal in ``directory`` as written (``step``, ``model_version``); a torn
    line reads as ``{"step": UNREADABLE_RELEASE}`` (counted as released)."""
    path = Path(directory) / RELEASE_JOURNAL
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
            record["step"] = int(record["step"])
        except (ValueError, KeyError, TypeError):
            record = {"step": UNREADABLE_RELEASE}  # unreadable: assume the newest step was released
        records.append(record)
    return records


def read_release_journal(directory: str | Path) -> list[int]:
    """Steps recorded by :func:`append_release_journal` (a torn last line counts as released)."""
    return [record["step"] for record in read_release_records(directory)]
