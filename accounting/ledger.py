"""The privacy ledger: an append-only, fsync'd JSON-lines file of released steps.

Contract ("ledger first"): a step's mechanism is durably appended *before* its noisy update
leaves the coordinator, and the ε spent is recomputed from this file alone.

Durability, like a database's write-ahead log: an append either completes (written, fsync'd) or
leaves the file exactly as it was — a failed write is truncated back to the previous end, and the
ledger object then refuses further appends until the file is reopened (which re-verifies it). A
process killed mid-write can leave a partial last line (no trailing newline): opening such a file
raises :class:`LedgerTruncatedError`, and ``userdp ledger repair RUN_DIR`` drops exactly that
partial line (never a complete record). ``userdp ledger verify RUN_DIR`` checks a run's ledger.

File format (one JSON object per line, canonical JSON: sorted keys, no spaces):

* line 1, the header: ``{"type": "header", "schema_version", "run_id", "budget_epsilon",
  "budget_delta", "created", "prev_hash": "", "hash"}``
* every other line: ``{"type": "step", "step", "mechanism": <Mechanism.to_dict()>, "time",
  "run_id", "prev_hash", "hash"}``, and ``"noise"`` (:data:`NOISE_MODES`) when the writer knew
  the step's noise generator

``hash`` is sha256 over the canonical JSON of the record without ``hash``; ``prev_hash`` is the
previous line's ``hash``, so editing, deleting or reordering any line breaks the chain.
One writer at a time: the ledger holds an exclusive ``fcntl.flock`` on ``<path>.lock``.
The budget check before each append uses :mod:`userdp.accounting.budget`'s certificates.

One module for the file format, its writer (create, open, append under the lock) and its readers
(verify, repair, :func:`read_ledger`): they share one set of invariants — the canonical JSON, the
hash chain, the partial-last-line rule — and each side is correct only together with the other.
"""

from __future__ import annotations

import datetime
import fcntl
import hashlib
import json
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from userdp.accounting.api import compose_epsilon
from userdp.accounting.budget import BudgetCertificates
from userdp.accounting.durable import fsync_dir, write_all
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


def canonical_json(record: dict[str, Any]) -> str:
    """The one serialization that is hashed and written: sorted keys, no whitespace."""
    return json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=False)


def record_hash(record: dict[str, Any]) -> str:
    """sha256 (hex) of the canonical JSON of ``record`` without its ``hash`` field."""
    body = {k: v for k, v in record.items() if k != "hash"}
    return hashlib.sha256(canonical_json(body).encode("utf-8")).hexdigest()


def _utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds")


class Ledger:
    """An open ledger file holding the writer lock. Use :meth:`create` or :meth:`open`.

    Close it (or use it as a context manager) to release the lock.
    """

    def __init__(self, path: Path, header: dict[str, Any], records: list[dict[str, Any]]):
        self.path = path
        self.header = header
        self._records = records
        self._lock_fd: int | None = None
        self._write_failed: str | None = None  # why appends are refused until reopened
        self._certificates = BudgetCertificates()
        # the last check that passed, keyed by the ledger state it was made on: the step's
        # append repeats the check on the same state, so it reuses the result
        self._passed: tuple[tuple[int, Mechanism, str], float] | None = None

    # ---- opening -------------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        path: str | os.PathLike[str],
        *,
        budget_epsilon: float | None = None,
        delta: float | None = None,
        run_id: str | None = None,
    ) -> Ledger:
        """Create a new ledger (refuses an existing file) and write its header durably."""
        path = Path(path)
        if (budget_epsilon is None) != (delta is None):
            raise ValueError(
                f"budget_epsilon={budget_epsilon!r}, delta={delta!r}: give both or neither"
            )
        if budget_epsilon is not None and not budget_epsilon > 0:
            raise ValueError(f"budget_epsilon={budget_epsilon!r} is not allowed; expected > 0")
        if delta is not None and not 0 < delta < 1:
            raise ValueError(f"delta={delta!r} is not allowed; expected 0 < delta < 1")
        lock_fd = _acquire_lock(path)
        try:
            if path.exists():
                raise FileExistsError(f"ledger {path} already exists; open it with Ledger.open")
            header = {
                "type": "header",
                "schema_version": SCHEMA_VERSION,
                "run_id": run_id or uuid.uuid4().hex,
                "budget_epsilon": budget_epsilon,
                "budget_delta": delta,
                "created": _utc_now(),
                "prev_hash": "",
            }
            header["hash"] = record_hash(header)
            ledger = cls(path, header, [])
            ledger._lock_fd = lock_fd
            try:
                ledger._write_line(header, mode="x")
            except LedgerWriteError:
                if path.exists() and path.stat().st_size == 0:
                    path.unlink()  # no header was written: leave no ledger at all
                raise
            fsync_dir(path.parent)
            return ledger
        except BaseException:
            _release_lock(lock_fd)
            raise

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        create: bool = False,
        budget_epsilon: float | None = None,
        delta: float | None = None,
        repair_truncated_tail: bool = False,
    ) -> Ledger:
        """Open an existing ledger, verifying every line and the hash chain.

        ``create=True`` creates it (with the budget) when missing. An existing ledger's budget
        wins; a different budget passed here raises, so a resumed run cannot widen its budget.
        ``repair_truncated_tail=True`` drops a partial final line (a crash mid-write, which was
        never fsync'd and so never released); without it such a file raises
        :class:`LedgerTruncatedError`.
        """
        path = Path(path)
        if create and not path.exists():
            return cls.create(path, budget_epsilon=budget_epsilon, delta=delta)
        lock_fd = _acquire_lock(path)
        try:
            header, records, tail_offset = _read_and_verify(path, repair_truncated_tail)
            if tail_offset is not None:
                with open(path, "r+b") as f:
                    f.truncate(tail_offset)
                    f.flush()
                    os.fsync(f.fileno())
            if budget_epsilon is not None and (
                budget_epsilon != header["budget_epsilon"] or delta != header["budget_delta"]
            ):
                raise ValueError(
                    f"budget (epsilon={budget_epsilon}, delta={delta}) differs from the ledger's "
                    f"(epsilon={header['budget_epsilon']}, delta={header['budget_delta']}) in "
                    f"{path}; a run's budget cannot change after its ledger is created"
                )
            ledger = cls(path, header, records)
            ledger._lock_fd = lock_fd
            return ledger
        except BaseException:
            _release_lock(lock_fd)
            raise

    def close(self) -> None:
        """Release the writer lock."""
        if self._lock_fd is not None:
            _release_lock(self._lock_fd)
            self._lock_fd = None

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- reading -------------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        return self.header["run_id"]

    @property
    def budget(self) -> tuple[float, float] | None:
        """(ε, δ) budget from the header, or None when the ledger has none."""
        if self.header["budget_epsilon"] is None:
            return None
        return (self.header["budget_epsilon"], self.header["budget_delta"])

    @property
    def records(self) -> tuple[dict[str, Any], ...]:
        """The step records, in file order (copies are not made: do not mutate)."""
        return tuple(self._records)

    @property
    def last_step(self) -> int | None:
        return self._records[-1]["step"] if self._records else None

    @property
    def steps(self) -> int:
        """Number of released steps."""
        return len(self._records)

    def phases(self) -> list[tuple[Mechanism, int]]:
        """Consecutive records with the same mechanism grouped as ``(mechanism, count)``."""
        return group_phases(self._records)

    def spent(self, delta: float, **accountant_options: Any) -> float:
        """ε(δ) of every released step, recomputed from the file alone."""
        return compose_epsilon(self.phases(), delta, **accountant_options)

    def epsilon_after(self, mechanism: Mechanism, delta: float, **accountant_options: Any) -> float:
        """ε(δ) if one more step of ``mechanism`` were released."""
        phases = self.phases() + [(mechanism, 1)]
        return compose_epsilon(phases, delta, **accountant_options)

    # ---- writing -------------------------------------------------------------------------

    def check_budget(self, mechanism: Mechanism, **accountant_options: Any) -> float:
        """Raise :class:`BudgetExceededError` if one more step would exceed the budget.

        Returns an upper bound on ε after the step: the exact ε(δ), or — for uls/els runs — the
        ε of a LATER step count of the same phase that an earlier call already verified to be
        within the budget (:mod:`userdp.accounting.budget`). A refusal is always decided on the
        exact ε of the step itself. Without a budget it raises ValueError.
        """
        if self.budget is None:
            raise ValueError(f"ledger {self.path} has no budget; create it with budget_epsilon")
        budget_epsilon, budget_delta = self.budget
        key = (len(self._records), mechanism, repr(sorted(accountant_options.items())))
        if self._passed is not None and self._passed[0] == key:
            return self._passed[1]
        certified = self._certificates.epsilon_bound(
            self.phases(), mechanism, self.budget, accountant_options, compose_epsilon
        )
        if certified is not None:
            self._passed = (key, certified)
            return certified
        after = self.epsilon_after(mechanism, budget_delta, **accountant_options)
        if after > budget_epsilon:
            spent = self.spent(budget_delta, **accountant_options) if self._records else 0.0
            raise BudgetExceededError(
                f"step {self._next_step_hint()} of {mechanism.kind} would raise ε from "
                f"{spent:.6g} to {after:.6g} at δ={budget_delta:g}, over the budget "
                f"ε={budget_epsilon:g}; stop training or start a new run with a larger budget"
            )
        self._passed = (key, after)
        return after

    def append(
        self,
        step: int,
        mechanism: Mechanism,
        *,
        enforce_budget: bool = True,
        noise: str | None = None,
    ) -> dict:
        """Durably record one released step (write, flush, fsync) and return the record.

        Refuses a step number not strictly greater than the last one, and (when the ledger has a
        budget and ``enforce_budget``) a step that would exceed it; both before any write.
        ``noise`` records the step's noise generator (one of :data:`NOISE_MODES`) for the report.
        """
        if self._lock_fd is None:
            raise LedgerError(f"ledger {self.path} is closed")
        if self._write_failed is not None:
            raise LedgerWriteError(
                f"ledger {self.path}: an earlier append failed ({self._write_failed}); reopen the "
                "ledger (a resumed run does) before appending again"
            )
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step={step!r} is not allowed; expected an integer >= 0")
        if self.last_step is not None and step <= self.last_step:
            raise StepOrderError(
                f"step={step} is not after the last recorded step {self.last_step} in "
                f"{self.path}; a step is released once (a duplicate would spend privacy twice)"
            )
        if noise is not None and noise not in NOISE_MODES:
            raise ValueError(f"noise={noise!r} is not allowed; expected one of {NOISE_MODES}")
        mechanism_dict = mechanism.to_dict()
        mechanism_from_dict(mechanism_dict)  # must round-trip or the ledger can't re-account
        if enforce_budget and self.budget is not None:
            self.check_budget(mechanism)
        previous = self._records[-1] if self._records else self.header
        record = {
            "type": "step",
            "step": step,
            "mechanism": mechanism_dict,
            "time": _utc_now(),
            "run_id": self.run_id,
            "prev_hash": previous["hash"],
        }
        if noise is not None:
            record["noise"] = noise
        record["hash"] = record_hash(record)
        self._write_line(record, mode="a")
        self._records.append(record)
        return record

    def _next_step_hint(self) -> str:
        return "after " + str(self.last_step) if self._records else "1"

    def _write_line(self, record: dict[str, Any], mode: str) -> None:
        """Write one line durably, or leave the file as it was (module docstring)."""
        line = (canonical_json(record) + "\n").encode("utf-8")
        with open(self.path, mode + "b") as f:
            end = f.tell()
            try:
                write_all(f.fileno(), line)
                os.fsync(f.fileno())
            except OSError as exc:
                self._write_failed = f"{exc.strerror or exc} writing {self.path}"
                try:
                    os.ftruncate(f.fileno(), end)
                    os.fsync(f.fileno())
                except OSError as undo:
                    raise LedgerWriteError(
                        f"ledger {self.path}: writing step record failed ({exc.strerror or exc}) "
                        f"and undoing the partial line failed too ({undo.strerror or undo}); "
                        "nothing of this step was released. Free space, then run `userdp "
                        "ledger repair RUN_DIR` to drop the partial line"
                    ) from exc
                raise LedgerWriteError(
                    f"ledger {self.path}: writing a record failed ({exc.strerror or exc}); the "
                    "file is as it was before this record, and nothing of it was released"
                ) from exc


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


def _acquire_lock(path: Path) -> int:
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


def _release_lock(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def read_ledger(
    path: str | os.PathLike[str],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Read and verify a ledger without taking the writer lock (for reports): header, records."""
    header, records, _ = _read_and_verify(Path(path), repair_truncated_tail=False)
    return header, records


def ledger_state(records: Sequence[dict[str, Any]], header: dict[str, Any]) -> dict[str, Any]:
    """What a report computed from these records is bound to: the step count and the hash of the
    last record (the header's for an empty ledger); any later append changes both."""
    last = records[-1] if records else header
    return {"steps": len(records), "last_hash": last["hash"]}


def repair_ledger(
    path: str | os.PathLike[str], released_steps: Sequence[int] = ()
) -> dict[str, Any] | None:
    """Drop a partial last line of the ledger at ``path`` (a crash mid-write) and return what was
    dropped (``{"line", "bytes", "text"}``), or None when there was nothing to drop.

    Only an incomplete trailing record (no newline) is ever dropped; a complete record that does
    not verify raises :class:`LedgerCorruptError` untouched. ``released_steps`` (the release
    journal's steps) must all be in the complete records: a released step whose record is the
    partial one would mean a release without a durable charge, so the repair refuses."""
    path = Path(path)
    lock_fd = _acquire_lock(path)
    try:
        data = path.read_bytes() if path.exists() else b""
        partial = data.rsplit(b"\n", 1)[-1] if data else b""
        header, records, tail = _read_and_verify(path, repair_truncated_tail=True)
        charged = {r["step"] for r in records}
        missing = sorted(set(released_steps) - charged)
        if missing:
            raise LedgerCorruptError(
                f"ledger {path}: the release journal shows step(s) {missing[:5]} released but the "
                "ledger's complete records do not hold them; not repairing (a release was never "
                "charged): keep the run folder and report it"
            )
        if tail is None:
            return None
        with open(path, "r+b") as f:
            f.truncate(tail)
            f.flush()
            os.fsync(f.fileno())
        return {
            "line": len(records) + 2,
            "bytes": len(partial),
            "text": partial[:120].decode("utf-8", "replace"),
        }
    finally:
        _release_lock(lock_fd)


def _read_and_verify(
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
                "while writing it); that step was never fsync'd and so never released. Run "
                "`userdp ledger repair RUN_DIR` (Python: Ledger.open(path, "
                "repair_truncated_tail=True)) to drop only that line"
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
        parsed.append(record)
    return parsed[0], parsed[1:], truncate_at
