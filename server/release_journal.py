"""The coordinator's release journal: an fsync'd line per step whose update is about to leave the
coordinator (``checkpoints/released.jsonl``): ``{"step", "model_version", "release_sha256"}``,
and ``"replayed": true`` for a step charged before a crash and run again. Resume reads it so that
a step broadcast after the last checkpoint is never released twice; ``userdp ledger verify``
reads it to check that every released step is charged in the ledger, and
(:func:`commitment_problem`) that each release is the draw the ledger charged, or, for a replayed
step, not the draw the crash discarded. Plain files and JSON: no model library is needed to read
it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from userdp.accounting.durable import append_durably

__all__ = [
    "RELEASE_JOURNAL",
    "UNREADABLE_RELEASE",
    "append_release_journal",
    "commitment_problem",
    "read_release_journal",
    "read_release_records",
]

RELEASE_JOURNAL = "released.jsonl"
UNREADABLE_RELEASE = 10**18
"""The step :func:`read_release_journal` reports for a torn line: later than any real step."""


def append_release_journal(
    directory: str | Path,
    step: int,
    model_version: int,
    *,
    release_sha256: str | None = None,
    replayed: bool = False,
) -> None:
    """Record (fsync'd) that ``step``'s update is about to leave the coordinator, with the
    commitment to its release (:mod:`userdp.strategies.release_commitment`) and whether it is a
    replay of a step charged before a crash."""
    directory = Path(directory)
    path = directory / RELEASE_JOURNAL
    entry: dict = {"step": step, "model_version": model_version}
    if release_sha256 is not None:
        entry["release_sha256"] = release_sha256
    if replayed:
        entry["replayed"] = True
    try:
        directory.mkdir(parents=True, exist_ok=True)
        line = (json.dumps(entry) + "\n").encode()
        with open(path, "ab", buffering=0) as handle:
            append_durably(handle.fileno(), line)  # all of the line, or the step is not recorded
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


def commitment_problem(ledger_records: Sequence[dict], journal: Sequence[dict]) -> str | None:
    """Why the release journal's commitments disagree with the ledger's, or None. A step
    released once must release the draw the ledger charged (equal ``release_sha256``); a
    replayed one must not release the draw its crash discarded (the ledger's, charged before
    the crash). Lines or records without the field (written before it existed) are skipped."""
    charged = {r["step"]: r.get("release_sha256") for r in ledger_records}
    for line in journal:
        released, committed = line.get("release_sha256"), charged.get(line["step"])
        if released is None or committed is None:
            continue
        if line.get("replayed") and released == committed:
            return (
                f"step {line['step']} was replayed with the release its crash discarded "
                "(release_sha256 equal in the ledger and the release journal): the replay's "
                "noise was not fresh"
            )
        if not line.get("replayed") and released != committed:
            return (
                f"step {line['step']}'s release (release journal) is not the draw the ledger "
                "charged (release_sha256 differs)"
            )
    return None
