"""The privacy ledger's writer: an append-only, fsync'd JSON-lines file of released steps (the
format and the readers: :mod:`userdp.accounting.ledger_format`).

Contract ("ledger first"): a step's mechanism is durably appended *before* its noisy update
leaves the coordinator, and the ε spent is recomputed from this file alone.

Durability, like a database's write-ahead log: an append either completes (written, fsync'd) or
leaves the file exactly as it was — a failed write is truncated back to the previous end, and the
ledger object then refuses further appends until the file is reopened (which re-verifies it). A
process killed mid-write can leave a partial last line: opening such a file raises
:class:`LedgerTruncatedError`, and ``userdp ledger repair RUN_DIR`` repairs exactly that partial
line (:mod:`userdp.accounting.ledger_repair`; never a complete record). ``userdp ledger verify RUN_DIR`` checks a run's ledger.
One writer at a time: the ledger holds an exclusive ``fcntl.flock`` on ``<path>.lock``.
The budget check before each append uses :mod:`userdp.accounting.budget`'s certificates.
"""

from __future__ import annotations

import datetime
import os
import uuid
from pathlib import Path
from typing import Any

from userdp.accounting.api import compose_epsilon
from userdp.accounting.budget import BudgetCertificates
from userdp.accounting.durable import (
    TornAppendError,
    append_durably,
    fsync_path,
    truncate_durably,
)
from userdp.accounting.ledger_format import (
    NOISE_MODES,
    SCHEMA_VERSION,
    BudgetExceededError,
    LedgerCorruptError,
    LedgerError,
    LedgerLockedError,
    LedgerTruncatedError,
    LedgerWriteError,
    StepOrderError,
    acquire_lock,
    canonical_json,
    group_phases,
    is_sha256,
    ledger_state,
    read_and_verify,
    read_ledger,
    record_hash,
    release_lock,
)
from userdp.accounting.ledger_repair import repair_ledger
from userdp.accounting.mechanisms import Mechanism, mechanism_from_dict

__all__ = [
    "NOISE_MODES",
    "SCHEMA_VERSION",
    "BudgetExceededError",
    "Ledger",
    "LedgerCorruptError",
    "LedgerError",
    "LedgerLockedError",
    "LedgerTruncatedError",
    "LedgerWriteError",
    "StepOrderError",
    "group_phases",
    "ledger_state",
    "read_ledger",
    "repair_ledger",
]


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
        lock_fd = acquire_lock(path)
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
            fsync_path(path.parent)
            return ledger
        except BaseException:
            release_lock(lock_fd)
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
        lock_fd = acquire_lock(path)
        try:
            header, records, tail_offset = read_and_verify(path, repair_truncated_tail)
            if tail_offset is not None:
                truncate_durably(path, tail_offset)
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
            release_lock(lock_fd)
            raise

    def close(self) -> None:
        """Release the writer lock."""
        if self._lock_fd is not None:
            release_lock(self._lock_fd)
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
        """ε(δ) of every released step, recomputed from the file alone: a certified upper bound
        for every mechanism (balls-in-bins: :mod:`userdp.accounting.balls_in_bins_certified`,
        a function of the query alone, so the same question gets the same answer)."""
        return compose_epsilon(self.phases(), delta, **accountant_options)

    def epsilon_after(self, mechanism: Mechanism, delta: float, **accountant_options: Any) -> float:
        """ε(δ) if one more step of ``mechanism`` were released."""
        phases = group_phases([*self._records, {"mechanism": mechanism.to_dict()}])
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
        release_sha256: str | None = None,
    ) -> dict:
        """Durably record one released step (write, flush, fsync) and return the record.

        Refuses a step number not strictly greater than the last one, and (when the ledger has a
        budget and ``enforce_budget``) a step that would exceed it; both before any write.
        ``noise`` records the step's noise generator (one of :data:`NOISE_MODES`) for the report;
        ``release_sha256`` the commitment to its noise draw
        (:mod:`userdp.strategies.release_commitment`).
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
        if release_sha256 is not None and not is_sha256(release_sha256):
            raise ValueError(f"release_sha256={release_sha256!r} is not a hex SHA-256")
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
        if release_sha256 is not None:
            record["release_sha256"] = release_sha256
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
            try:
                append_durably(f.fileno(), line)
            except TornAppendError as torn:
                exc = torn.append_error
                self._write_failed = f"{exc.strerror or exc} writing {self.path}"
                raise LedgerWriteError(
                    f"ledger {self.path}: writing step record failed ({exc.strerror or exc}) "
                    "and undoing the partial line failed too "
                    f"({torn.undo_error.strerror or torn.undo_error}); nothing of this step was "
                    "released. Free space, then run `userdp ledger repair RUN_DIR` to drop the "
                    "partial line"
                ) from exc
            except OSError as exc:
                self._write_failed = f"{exc.strerror or exc} writing {self.path}"
                raise LedgerWriteError(
                    f"ledger {self.path}: writing a record failed ({exc.strerror or exc}); the "
                    "file is as it was before this record, and nothing of it was released"
                ) from exc
