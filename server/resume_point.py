"""Which checkpoint a run resumes from: the newest one that verifies.

A checkpoint verifies when it loads and matches its checksums
(:func:`userdp.server.checkpoint.load_checkpoint`) and agrees with the two files that say what
was spent and released: the ledger charges the step it follows, holds at least the records it
counted, and the release journal never broadcast that step as a later model version than the
checkpoint holds. A checkpoint that does not verify (deleted, truncated, corrupted, or from
another timeline of the run) is passed over for the newest older one that does
(:func:`userdp.server.checkpoint.restore_latest` logs which and why). Falling back never releases
a step twice: the steps charged after the checkpoint taken stay charged and are not re-run
(:func:`continue_after_lost_steps`). Resume is refused (:class:`ResumeError`) when the release
journal shows a step released that the ledger does not charge: the ledger lost records, and
re-running those steps would release them a second time.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from userdp.server.checkpoint import Checkpoint, restore_latest
from userdp.server.release_journal import UNREADABLE_RELEASE, read_release_records

__all__ = [
    "ResumeError",
    "checkpoint_problem",
    "continue_after_lost_steps",
    "noise_is_stateful",
    "restore_resume_point",
]

log = logging.getLogger(__name__)


class ResumeError(RuntimeError):
    """The run cannot resume without breaking a DP contract (the message says why and what to do)."""


def noise_is_stateful(strategy: Any) -> bool:
    """The strategy's noise carries state across steps (BLT-correlated noise): steps lost after
    a checkpoint cannot be skipped without breaking the correlation the accountant assumes."""
    noise = getattr(strategy, "noise", None)
    return noise is not None and bool(noise.state_dict())


def continue_after_lost_steps(strategy: Any, checkpoint_step: int, last_charged: int) -> int:
    """Steps ``checkpoint_step``..``last_charged`` are charged in the ledger but their updates
    are lost (they came after the last checkpoint). They stay charged and are never re-run, so
    none is released twice: return the step to continue at. Refuse (:class:`ResumeError`) when
    the noise is stateful: continuing would break the correlation the accountant assumes."""
    if noise_is_stateful(strategy):
        raise ResumeError(
            f"steps {checkpoint_step}..{last_charged} are charged in the ledger after the last "
            "checkpoint and the correlated-noise state they advanced is lost; continuing would "
            "break the noise correlation the accountant assumes. Keep the ledger (it stays "
            "charged) and use coordinator.checkpoint_every = 1 for correlated-noise strategies"
        )
    log.warning(
        "ledger charges steps up to %d but the checkpoint is at step %d: %d step(s) were lost; "
        "they stay charged; continuing at step %d",
        last_charged,
        checkpoint_step,
        last_charged + 1 - checkpoint_step,
        last_charged + 1,
    )
    return last_charged + 1


def checkpoint_problem(
    checkpoint: Checkpoint, charged: Sequence[int], released_versions: Mapping[int, int]
) -> str | None:
    """Why ``checkpoint`` disagrees with the ledger's charged steps (in file order) and the
    release journal (step → model version broadcast), or None when it agrees."""
    entries, follows = checkpoint.ledger_entries, checkpoint.step - 1
    if entries > len(charged):
        return f"it follows {entries} ledger records but the ledger holds {len(charged)}"
    if follows >= 0 and follows not in charged[:entries]:
        return f"the ledger does not charge step {follows}, which it follows"
    broadcast = released_versions.get(follows)
    if broadcast is not None and broadcast > checkpoint.model_version:
        return (
            f"the release journal broadcast step {follows} as model version {broadcast}, after "
            f"the checkpoint's version {checkpoint.model_version}"
        )
    return None


def restore_resume_point(
    directory: str | Path,
    params: Mapping[str, torch.Tensor],
    strategy: Any,
    charged: Sequence[int],
) -> Checkpoint | None:
    """Restore the newest checkpoint in ``directory`` that verifies against the ledger's
    ``charged`` steps and the release journal in ``directory`` (module docstring) into
    ``params`` and ``strategy``; None when there is none yet. :class:`ResumeError` when the
    journal shows a step released that ``charged`` lacks."""
    journal = read_release_records(directory)
    charged = list(charged)
    uncharged = sorted({r["step"] for r in journal} - set(charged) - {UNREADABLE_RELEASE})
    if uncharged:
        raise ResumeError(
            f"the release journal in {directory} shows step(s) {uncharged[:5]} released but the "
            "ledger does not charge them (it lost records): restore ledger.jsonl from a backup; "
            "resuming would release them again"
        )
    versions = {r["step"]: int(r["model_version"]) for r in journal if "model_version" in r}
    return restore_latest(
        directory, params, strategy, check=lambda c: checkpoint_problem(c, charged, versions)
    )
