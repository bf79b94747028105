"""Waiting for workers at the start of a run, by their progress rather than by a fixed clock.

A worker can take minutes before it connects on a loaded machine: importing torch, loading the
model, building DeepSpeed's CPU op. While it starts it sends ``ReportStartup`` (its phase, on every
change and every few seconds); once connected, its session's messages show it is alive until it
holds the current model. :class:`StartupWait` judges one moment of that wait: done (every shard
has a ready holder), still waiting, or failed, with a one-line reason naming each starting
worker's phase. It fails when the overall bound ``worker_startup_s`` has passed, or when workers
had started reporting and every one still starting has been silent for ``worker_stall_s`` (its
process died or lost the coordinator; reports come from a background thread, so a worker hung
inside a phase keeps reporting and only ``worker_startup_s`` ends that wait). Before any worker
has reported only the overall bound applies: in a deployment the workers' pods may still be
scheduled or pulling their image.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from userdp.server.service import StartupStatus, WorkerSession


class WorkerStartupError(RuntimeError):
    """Workers did not become ready; the message names each starting worker's phase."""


@dataclass(frozen=True)
class WorkerProgress:
    """Where one worker that is not ready yet stands."""

    worker_id: str
    phase: str
    phase_seconds: float
    silent_s: float
    """Seconds since anything was heard from it."""

    def describe(self) -> str:
        return (
            f"{self.worker_id} in {self.phase!r} for {self.phase_seconds:.0f} s "
            f"(last heard {self.silent_s:.0f} s ago)"
        )


def _progress(
    ready: Iterable[str],
    sessions: Iterable[WorkerSession],
    reports: Mapping[str, StartupStatus],
    now: float,
) -> list[WorkerProgress]:
    """Every worker heard from (by report or session) that is not ready, by worker id."""
    ready = set(ready)
    heard: dict[str, WorkerProgress] = {}
    for status in reports.values():
        if status.worker_id in ready:
            continue
        silent = now - status.received
        heard[status.worker_id] = WorkerProgress(
            status.worker_id, status.phase, status.phase_seconds + silent, silent
        )
    for session in sessions:
        if session.worker_id in ready or not session.alive:
            continue
        phase = "draining" if session.draining else "connected, receiving the model"
        heard[session.worker_id] = WorkerProgress(
            session.worker_id, phase, 0.0, max(0.0, now - session.last_seen)
        )
    return [heard[w] for w in sorted(heard)]


@dataclass
class StartupWait:
    """One wait for workers (see the module docstring); ``started`` is ``time.monotonic()``."""

    needed: frozenset[str]
    startup_s: float
    stall_s: float
    started: float

    def check(
        self,
        eligible: Mapping[str, WorkerSession],
        sessions: Iterable[WorkerSession],
        reports: Mapping[str, StartupStatus],
        now: float | None = None,
    ) -> tuple[bool, list[WorkerProgress]]:
        """(done, the workers still starting); raises :class:`WorkerStartupError` when the
        wait has failed."""
        now = time.monotonic() if now is None else now
        held = set().union(*[s.shards for s in eligible.values()] or [set()])
        missing = sorted(self.needed - held)
        if not missing:
            return True, []
        starting = _progress(eligible, sessions, reports, now)
        waited = now - self.started
        shards = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        where = "; ".join(p.describe() for p in starting)
        if waited > self.startup_s:
            raise WorkerStartupError(
                f"workers not ready after {waited:.0f} s (coordinator.worker_startup_s = "
                f"{self.startup_s:g}): no ready worker holds {shards}"
                + (f"; {where}" if where else "; no worker connected or reported progress")
            )
        if starting and min(p.silent_s for p in starting) > self.stall_s:
            raise WorkerStartupError(
                f"no start-up progress from any worker for {self.stall_s:g} s "
                f"(coordinator.worker_stall_s): {where}; no ready worker holds {shards}"
            )
        return False, starting


def summarize(starting: list[WorkerProgress]) -> str:
    """One short line for a progress bar: each starting worker's phase."""
    return ", ".join(f"{p.worker_id}: {p.phase} {p.phase_seconds:.0f}s" for p in starting)


def progress_logger(
    logger: logging.Logger, every_s: float = 30.0
) -> Callable[[list[WorkerProgress]], None]:
    """An ``on_progress`` for the wait for workers that logs the starting workers' phases when
    they change, and at most every ``every_s`` otherwise."""
    last: dict[str, Any] = {"phases": None, "at": -math.inf}

    def show(starting: list[WorkerProgress]) -> None:
        phases = [(p.worker_id, p.phase) for p in starting]
        now = time.monotonic()
        if starting and (phases != last["phases"] or now - last["at"] >= every_s):
            logger.info("waiting for workers: %s", summarize(starting))
            last.update(phases=phases, at=now)

    return show
