"""Coordinator checkpoints: safetensors for tensors + JSON for everything else, written atomically.

A checkpoint is a directory ``ckpt-<step>`` holding ``tensors.safetensors`` and ``state.json``,
written under a temporary name, fsync'd, then renamed; ``LATEST``, replaced durably and
atomically (:func:`userdp.accounting.durable.atomic_write`), names the newest complete one. A crash at any point leaves either the old or the new checkpoint,
never a mix. A write that fails, whatever raised (safetensors reports a full disk with its own
exception type, not ``OSError``), removes its temporary folder and raises
:class:`CheckpointWriteError`, one line naming the cause and what to do. Nested state (``state_dict()`` of a model, optimizer or strategy: dicts, lists,
numbers, strings, tensors, numpy arrays) is flattened: tensors go to safetensors under a path key
and are replaced in the JSON tree by ``{"__tensor__": key}``. No pickle anywhere.

``state.json`` records ``step`` (the next step to run), ``model_version`` and ``ledger_entries``
(how many ledger entries existed when it was written): on resume the ledger, not this file,
says what was spent (:mod:`userdp.server.coordinator`).
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from userdp.accounting.durable import atomic_write_text, fsync_path

FORMAT = "userdp-coordinator-checkpoint"
FORMAT_VERSION = 1
LATEST = "LATEST"


class CheckpointError(ValueError):
    """A checkpoint directory is unreadable or from an unknown format version."""


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int
    model_version: int
    ledger_entries: int
    state: dict[str, Any]


def flatten_state(tree: Any, tensors: dict[str, torch.Tensor], prefix: str = "") -> Any:
    """JSON-able copy of ``tree`` with tensors moved into ``tensors`` (see the module docstring)."""
    if isinstance(tree, torch.Tensor | np.ndarray):
        key = prefix or "_"
        if key in tensors:
            raise CheckpointError(f"duplicate tensor key {key!r}")
        value = (
            torch.from_numpy(np.ascontiguousarray(tree)) if isinstance(tree, np.ndarray) else tree
        )
        tensors[key] = value.detach().cpu().contiguous().clone()
        return {"__tensor__": key, "numpy": isinstance(tree, np.ndarray)}
    if isinstance(tree, Mapping):
        items = [
            (k, flatten_state(v, tensors, f"{prefix}.{k}" if prefix else str(k)))
            for k, v in tree.items()
        ]
        if all(isinstance(k, str) for k, _ in items) and "__tensor__" not in tree:
            return {k: v for k, v in items}
        return {"__items__": [[k, v] for k, v in items]}
    if isinstance(tree, list | tuple):
        out = [flatten_state(v, tensors, f"{prefix}.{i}") for i, v in enumerate(tree)]
        return out if isinstance(tree, list) else {"__tuple__": out}
    if tree is None or isinstance(tree, bool | int | float | str):
        return tree
    if isinstance(tree, np.generic):
        return tree.item()
    raise CheckpointError(f"cannot checkpoint {type(tree).__name__} at {prefix!r} (no pickle)")


def unflatten_state(tree: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if "__tensor__" in tree:
            value = tensors[tree["__tensor__"]]
            return value.numpy() if tree.get("numpy") else value
        if "__items__" in tree:
            return {k: unflatten_state(v, tensors) for k, v in tree["__items__"]}
        if "__tuple__" in tree:
            return tuple(unflatten_state(v, tensors) for v in tree["__tuple__"])
        return {k: unflatten_state(v, tensors) for k, v in tree.items()}
    if isinstance(tree, list):
        return [unflatten_state(v, tensors) for v in tree]
    return tree


class CheckpointWriteError(OSError):
    """A checkpoint was not written (a full disk, an I/O error, the serializer failing): its
    temporary folder is removed and ``LATEST`` still names the checkpoint it named before."""


def failure_errno(exc: BaseException) -> int | None:
    """The errno behind a write failure: an ``OSError``'s own, or the ``os error N`` that
    safetensors puts in the message of its own exception type (it raises no ``OSError``)."""
    if isinstance(exc, OSError) and exc.errno is not None:
        return exc.errno
    found = re.search(r"\(os error (\d+)\)", str(exc))
    return int(found.group(1)) if found else None


def write_failure(exc: BaseException, name: str, directory: Path) -> CheckpointWriteError:
    """One line for a failed write of checkpoint ``name``: the cause, what ``LATEST`` still
    names, and what to do."""
    code = failure_errno(exc)
    if code in (errno.ENOSPC, errno.EDQUOT):
        cause = f"disk full: {os.strerror(code)}"
        action = f"free space in {directory}"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        cause = os.strerror(code)
        action = f"make {directory} writable"
    elif code is not None:
        cause = os.strerror(code)
        action = f"fix the storage of {directory}"
    else:
        cause = " ".join(str(exc).split()) or type(exc).__name__
        action = f"check that {directory} is writable and has space"
    try:
        latest = (directory / LATEST).read_text(encoding="utf-8").strip()
    except OSError:
        latest = ""
    kept = f"{latest} stays the latest checkpoint" if latest else "there is no earlier checkpoint"
    error = CheckpointWriteError(
        f"checkpoint {name} was not written ({cause}); {kept}: {action}, then run the same "
        "command to resume"
    )
    error.errno = code
    return error


def save_checkpoint(
    directory: str | Path,
    *,
    step: int,
    model_version: int,
    ledger_entries: int,
    state: Mapping[str, Any],
    keep: int = 2,
) -> Path:
    """Write ``state`` atomically as ``ckpt-<step>`` and point ``LATEST`` at it; keep the newest
    ``keep`` checkpoints."""
    directory = Path(directory)
    tensors: dict[str, torch.Tensor] = {}
    tree = flatten_state(dict(state), tensors)
    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "model_version": model_version,
        "ledger_entries": ledger_entries,
        "state": tree,
    }
    name = f"ckpt-{step:09d}"
    final = directory / name
    tmp = directory / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        save_file(tensors, str(tmp / "tensors.safetensors"))
        fsync_path(tmp / "tensors.safetensors")
        atomic_write_text(tmp / "state.json", json.dumps(meta, allow_nan=True))  # fsyncs tmp
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
        atomic_write_text(directory / LATEST, name + "\n")  # fsyncs directory: rename included
    except Exception as exc:  # any failure, the serializer's own error types included
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failure(exc, name, directory) from exc
    checkpoints = sorted(p for p in directory.glob("ckpt-*") if p.is_dir())
    for old in checkpoints[:-keep] if keep > 0 else []:
        if old != final:
            shutil.rmtree(old, ignore_errors=True)
    for stale in directory.glob(".tmp-ckpt-*"):
        shutil.rmtree(stale, ignore_errors=True)
    for stale in directory.glob(f".{LATEST}.*.tmp"):  # a crash's leftover pointer
        stale.unlink(missing_ok=True)
    return final


def load_latest(directory: str | Path) -> Checkpoint | None:
    """The checkpoint ``LATEST`` names, or None when there is none yet."""
    directory = Path(directory)
    pointer = directory / LATEST
    if not pointer.is_file():
        return None
    path = directory / pointer.read_text(encoding="utf-8").strip()
    try:
        meta = json.loads((path / "state.json").read_text(encoding="utf-8"))
        tensors = load_file(str(path / "tensors.safetensors"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc})") from None
    if meta.get("format") != FORMAT or meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format {meta.get('format')!r} v{meta.get('format_version')} is not "
            f"{FORMAT} v<={FORMAT_VERSION}"
        )
    return Checkpoint(
        path=path,
        step=int(meta["step"]),
        model_version=int(meta["model_version"]),
        ledger_entries=int(meta["ledger_entries"]),
        state=unflatten_state(meta["state"], tensors),
    )


def restore_latest(
    directory: str | Path, params: Mapping[str, torch.Tensor], strategy: Any
) -> Checkpoint | None:
    """Copy the latest checkpoint's parameters into ``params`` and its strategy state into
    ``strategy``; return the checkpoint, or None when there is none yet."""
    checkpoint = load_latest(directory)
    if checkpoint is not None:
        for name, value in checkpoint.state["params"].items():
            params[name].copy_(value)
        strategy.load_state_dict(checkpoint.state["strategy"])
    return checkpoint
