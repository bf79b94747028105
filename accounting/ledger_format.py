"""The privacy ledger's file format and its readers, without the accountant: a run's records,
their hash chain, the phases they hold, the partial last line a crash can leave, and whether
a privacy report still covers the ledger. ``userdp ledger verify`` and ``userdp ledger repair``
need nothing else, so they start without importing the accountants; the writer
(:class:`userdp.accounting.ledger.Ledger`) appends in this format under the same lock.

File format (one JSON object per line, canonical JSON: sorted keys, no spaces):

* line 1, the header: ``{"type": "header", "schema_version", "run_id", "budget_epsilon",
  "budget_delta", "created", "prev_hash": "", "hash"}``
* every other line: ``{"type": "step", "step", "mechanism": <Mechanism.to_dict()>, "time",
  "run_id", "prev_hash", "hash"}``, and ``"noise"`` (:data:`NOISE_MODES`) when the writer knew
  the step's noise generator; ``"release_sha256"``, the commitment to the step's noise draw
  (:mod:`userdp.strategies.release_commitment`; records without it predate the field); and
  ``"recharged": true`` on a record that ``userdp ledger repair`` wrote again for a released step
  whose line was cut short

``hash`` is sha256 over the canonical JSON of the record without ``hash``; ``prev_hash`` is the
previous line's ``hash``, so editing, deleting or reordering any line breaks the chain. A process
killed mid-write (or a file cut short) leaves a partial last line (no trailing newline): reading
such a file raises :class:`LedgerTruncatedError`, and
:func:`userdp.accounting.ledger_repair.repair_ledger` repairs exactly that line, as the release
journal decides (never a complete record). One writer at a time: an exclusive ``fcntl.flock`` on ``<path>.lock``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from userdp.accounting.mechanisms import Mechanism, mechanism_from_dict

SCHEMA_VERSION = 1
NOISE_MODES = ("secure", "fast", "test", "none")
"""A step record's optional ``noise`` field: the secure generator, the fast floating-point one, a
fixed test seed, or no noise (a test-only mode); records without it predate the field."""


class LedgerError(RuntimeError):
    """Base class for ledger problems."""


class LedgerCorruptError(LedgerError, ValueError):
    """A line of the ledger is not what was written (bad JSON, broken hash chain, bad record)."""


class LedgerTruncatedError(LedgerError, ValueError):
    """The last line is partial (a crash mid-write); nothing is dropped without the caller's say."""


class LedgerWriteError(LedgerError):
    """An append failed (disk full, I/O error); the file was left as it was before the append,
    or — if even that failed — the ledger must be reopened (and maybe repaired) to continue."""


class LedgerLockedError(LedgerError):
    """Another process holds the ledger's writer lock."""


class BudgetExceededError(LedgerError):
    """Appending the step would spend more than the ledger's (ε, δ) budget."""


class StepOrderError(LedgerError):
    """A step number that is not strictly greater than the last one (a duplicate release)."""


HEX = frozenset("0123456789abcdef")


def is_sha256(value: Any) -> bool:
    """``value`` is a lower-case hex SHA-256 (a step record's ``release_sha256``)."""
    return isinstance(value, str) and len(value) == 64 and all(c in HEX for c in value)


def canonical_json(record: dict[str, Any]) -> str:
    """The one serialization that is hashed and written: sorted keys, no whitespace."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False)


def record_hash(record: dict[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of ``record`` without its ``hash`` field."""
    body = {k: v for k, v in record.items() if k != "hash"}
    return hashlib.sha256(canonical_json(body).encode("utf-8")).hexdigest()


def group_phases(records: Sequence[dict[str, Any]]) -> list[tuple[Mechanism, int]]:
    """Consecutive step records with the same mechanism as ``(mechanism, count)`` phases."""
    phases: list[tuple[Mechanism, int]] = []
    last_dict: dict[str, Any] | None = None
    for record in records:
        if record["mechanism"] == last_dict:
            mechanism, count = phases[-1]
            phases[-1] = (mechanism, count + 1)
        else:
            phases.append((mechanism_from_dict(record["mechanism"]), 1))
            last_dict = record["mechanism"]
    return phases


def acquire_lock(path: Path) -> int:
    lock_path = path.with_name(path.name + ".lock")
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LedgerLockedError(
            f"ledger {path} is held by another writer (lock {lock_path}); only one coordinator "
            "may append to a ledger; stop the other process first"
        ) from None
    return fd


def release_lock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def read_ledger(
    path: str | os.PathLike[str],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Read and verify a ledger without taking the writer lock (for reports): header, records."""
    header, records, _ = read_and_verify(Path(path), repair_truncated_tail=False)
    return header, records


def ledger_state(records: Sequence[dict[str, Any]], header: dict[str, Any]) -> dict[str, Any]:
    """What a report computed from these records is bound to: the step count and the hash of the
    last record (the header's for an empty ledger); any later append changes both."""
    last = records[-1] if records else header
    return {"steps": len(records), "last_hash": last["hash"]}


def read_and_verify(
    path: Path, repair_truncated_tail: bool
) -> tuple[dict[str, Any], list[dict[str, Any]], int | None]:
    """Parse and verify ``path``; returns header, step records, and the offset to truncate to
    (only when ``repair_truncated_tail`` and the last line is partial)."""
    if not path.exists():
        raise FileNotFoundError(f"ledger {path} does not exist")
    data = path.read_bytes()
    lines = data.split(b"\n")
    # ``data`` ending in "\n" leaves one empty final element; anything else is a partial line.
    partial = lines.pop()
    truncate_at: int | None = None
    if partial:
        if not repair_truncated_tail:
            raise LedgerTruncatedError(
                f"ledger {path} line {len(lines) + 1} is incomplete (no trailing newline: a crash "
                "while writing it, or the file was cut short). Run `userdp ledger repair RUN_DIR`: "
                "it drops the line if the release journal shows its step was never released, and "
                "restores its charge if it was; then run the same command to resume"
            )
        truncate_at = len(data) - len(partial)
    if not lines:
        raise LedgerCorruptError(f"ledger {path} has no header line")
    parsed: list[dict[str, Any]] = []
    prev_hash = ""
    for number, raw in enumerate(lines, start=1):
        where = f"ledger {path} line {number}"
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise LedgerCorruptError(
                f"{where} is not valid JSON ({e}); the file was modified"
            ) from None
        if not isinstance(record, dict):
            raise LedgerCorruptError(f"{where} is not a JSON object; the file was modified")
        if record.get("hash") != record_hash(record):
            raise LedgerCorruptError(f"{where} does not match its hash; the line was modified")
        if record.get("prev_hash") != prev_hash:
            raise LedgerCorruptError(
                f"{where} breaks the hash chain (a line was removed, inserted or reordered)"
            )
        prev_hash = record["hash"]
        expected_type = "header" if number == 1 else "step"
        if record.get("type") != expected_type:
            raise LedgerCorruptError(
                f"{where} has type {record.get('type')!r}, not {expected_type}"
            )
        if number == 1 and record.get("schema_version") != SCHEMA_VERSION:
            raise LedgerCorruptError(
                f"{where}: schema_version {record.get('schema_version')!r} is not supported "
                f"(this userdp reads {SCHEMA_VERSION})"
            )
        if number > 1:
            if parsed[1:] and record["step"] <= parsed[-1]["step"]:
                raise LedgerCorruptError(f"{where}: step {record['step']} is not increasing")
            try:
                mechanism_from_dict(record["mechanism"])
            except (KeyError, ValueError) as e:
                raise LedgerCorruptError(f"{where}: bad mechanism ({e})") from None
            if "release_sha256" in record and not is_sha256(record["release_sha256"]):
                raise LedgerCorruptError(f"{where}: release_sha256 is not a hex SHA-256")
        parsed.append(record)
    return parsed[0], parsed[1:], truncate_at


class ReportStaleError(ValueError):
    """A privacy report that no longer covers its ledger (steps were charged after it)."""


def check_report_current(
    report_path: str | os.PathLike[str], ledger_path: str | os.PathLike[str]
) -> dict[str, Any]:
    """The report at ``report_path`` (JSON) if it was computed from the ledger as it is now;
    :class:`ReportStaleError` naming the fix otherwise (e.g. a crash after more steps were
    charged than the report covers)."""
    report = json.loads(Path(report_path).read_text(encoding="utf-8"))
    header, records = read_ledger(ledger_path)
    now = ledger_state(records, header)
    if report.get("ledger") != now:
        covered = (report.get("ledger") or {}).get("steps", "an unknown number of")
        raise ReportStaleError(
            f"{report_path} covers {covered} step(s) but the ledger {ledger_path} now holds "
            f"{now['steps']}: the report is stale; run `userdp report "
            f"{Path(ledger_path).parent}` to recompute it from the ledger"
        )
    return report
