"""Repair of a ledger's partial last line (:class:`~userdp.accounting.ledger_format.LedgerTruncatedError`),
decided by the release journal (``userdp ledger repair RUN_DIR``).

A partial last line has two causes, and the release journal tells them apart:

* **a crash while the line was written.** Its step was never fsync'd, so nothing of it was
  released and the journal does not list it: the line is dropped.
* **the file cut short afterwards** (a copy, a disk, a hand). The record was complete and
  fsync'd before its step was released, and the journal lists that step: its charge must stay.
  The line is rebuilt from what survives of it: restored exactly when the surviving fields
  (``type`` is always ``"step"``) hash to the line's own ``hash``; otherwise re-charged, a new
  record for that step with the mechanism the surviving part names (and its ``noise`` and
  ``release_sha256`` when they survive), marked ``"recharged": true``. When no mechanism survives,
  or more than that one line is missing, the repair refuses: restore the ledger from a backup.

A complete record is never dropped or changed; the file is replaced atomically.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from userdp.accounting.durable import atomic_write_bytes, truncate_durably
from userdp.accounting.ledger_format import (
    NOISE_MODES,
    LedgerCorruptError,
    acquire_lock,
    canonical_json,
    read_and_verify,
    record_hash,
    release_lock,
)
from userdp.accounting.mechanisms import mechanism_from_dict

__all__ = ["repair_ledger", "surviving_fields"]

STEP_FIELDS = ("hash", "mechanism", "prev_hash", "run_id", "step", "time", "type")
"""The fields every step record has (the optional ones: ``noise``, ``release_sha256``)."""


def surviving_fields(partial: bytes) -> dict[str, Any]:
    """The ``"key":value`` pairs of a cut canonical-JSON line that are certainly whole: each
    followed by ``,`` or ``}`` (a number cut short would otherwise parse as another number)."""
    text = partial.decode("utf-8", "replace")
    decoder = json.JSONDecoder()
    fields: dict[str, Any] = {}
    at = 1
    while text.startswith("{"):
        try:
            key, at = decoder.raw_decode(text, at)
            if not isinstance(key, str) or text[at : at + 1] != ":":
                break
            value, at = decoder.raw_decode(text, at + 1)
        except json.JSONDecodeError:
            break
        if text[at : at + 1] not in (",", "}"):
            break
        fields[key] = value
        if text[at] == "}":
            break
        at += 1
    return fields


def _rebuilt(
    partial: bytes, step: int, header: dict[str, Any], previous: dict[str, Any]
) -> tuple[dict[str, Any], str] | None:
    """The record of released ``step`` rebuilt from its cut line, and "restored" or "recharged";
    None when the line does not hold enough of it (or holds another record's fields)."""
    fields = surviving_fields(partial)
    expected = {"step": step, "prev_hash": previous["hash"], "run_id": header["run_id"]}
    if any(key in fields and fields[key] != value for key, value in expected.items()):
        return None
    try:
        mechanism_from_dict(fields["mechanism"])
    except (KeyError, TypeError, ValueError):
        return None
    whole = {**fields, "type": "step"}
    if set(STEP_FIELDS) <= set(whole) and record_hash(whole) == whole["hash"]:
        return whole, "restored"
    now = datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds")
    record = {"type": "step", **expected, "mechanism": fields["mechanism"], "time": now}
    if fields.get("noise") in NOISE_MODES:
        record["noise"] = fields["noise"]
    if isinstance(fields.get("release_sha256"), str):
        record["release_sha256"] = fields["release_sha256"]
    record["recharged"] = True
    record["hash"] = record_hash(record)
    return record, "recharged"


def repair_ledger(
    path: str | os.PathLike[str], released_steps: Sequence[int] = ()
) -> dict[str, Any] | None:
    """Repair a partial last line of the ledger at ``path`` (the module docstring) and return
    what was done: ``{"action": "dropped" | "restored" | "recharged", "line", "bytes", "text",
    "step"}``; None when every line is complete. ``released_steps``: the release journal's steps.
    :class:`LedgerCorruptError` (file untouched) when a released step cannot be charged again,
    or a complete record does not verify."""
    path = Path(path)
    lock_fd = acquire_lock(path)
    try:
        data = path.read_bytes() if path.exists() else b""
        partial = data.rsplit(b"\n", 1)[-1] if data else b""
        header, records, tail = read_and_verify(path, repair_truncated_tail=True)
        charged = {r["step"] for r in records}
        missing = sorted(set(released_steps) - charged)
        last = records[-1]["step"] if records else -1
        done = {
            "line": len(records) + 2,
            "bytes": len(partial),
            "text": partial[:120].decode("utf-8", "replace"),
        }
        if tail is None and not missing:
            return None
        if tail is not None and not missing:
            truncate_durably(path, tail)
            return {**done, "action": "dropped", "step": None}
        rebuilt = None
        if tail is not None and len(missing) == 1 and missing[0] > last:
            rebuilt = _rebuilt(partial, missing[0], header, records[-1] if records else header)
        if rebuilt is None:
            raise LedgerCorruptError(
                f"ledger {path}: the release journal shows step(s) {missing[:5]} released but the "
                "ledger's complete records do not hold them, and no charge for them survives in "
                f"the file: not repairing; restore {path.name} from a backup (resuming without "
                "their charge would understate ε, and the run refuses)"
            )
        record, action = rebuilt
        atomic_write_bytes(path, data[:tail] + (canonical_json(record) + "\n").encode("utf-8"))
        return {**done, "action": action, "step": record["step"]}
    finally:
        release_lock(lock_fd)
