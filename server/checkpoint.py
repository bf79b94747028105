"""Coordinator checkpoints: safetensors for tensors + JSON for everything else, written atomically.

A checkpoint is a directory ``ckpt-<step>`` holding ``tensors.safetensors`` and ``state.json``,
written under a temporary name, fsync'd, then renamed; ``LATEST``, replaced durably and
atomically (:func:`userdp.accounting.durable.atomic_write`), names the newest complete one. A
crash at any point leaves either the old or the new checkpoint, never a mix. A write that fails,
whatever raised (safetensors reports a full disk with its own exception type, not ``OSError``),
removes its temporary folder and raises :class:`CheckpointWriteError`, one line naming the cause
and what to do. Nested state (``state_dict()`` of a model, optimizer or strategy: dicts, lists,
numbers, strings, tensors, numpy arrays) is flattened: tensors go to safetensors under a path key
and are replaced in the JSON tree by ``{"__tensor__": key}``. No pickle anywhere.

``state.json`` records ``step`` (the next step to run), ``model_version``, ``ledger_entries``
(how many ledger entries existed when it was written), ``tensors_sha256`` (of the tensors file)
and ``sha256`` (of its own content without that field): on resume the ledger, not this file,
says what was spent (:mod:`userdp.server.coordinator`). Reading (:func:`load_latest`) takes the
checkpoint ``LATEST`` names or, when that one is missing, does not match its checksums or fails
the caller's check (:mod:`userdp.server.resume_point`), the newest older one that verifies.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from userdp.accounting.durable import atomic_write_text, fsync_path

log = logging.getLogger(__name__)

FORMAT = "userdp-coordinator-checkpoint"
FORMAT_VERSION = 1
LATEST = "LATEST"


class CheckpointError(ValueError):
    """A checkpoint directory is unreadable or from an unknown format version."""


@dataclass(frozen=True)
class Checkpoint:
    """A loaded checkpoint. ``passed_over``: newer checkpoint folders :func:`load_latest` did not
    take, and ``fallback`` why (None when it took the one ``LATEST`` names)."""

    path: Path
    step: int
    model_version: int
    ledger_entries: int
    state: dict[str, Any]
    fallback: str | None = None
    passed_over: tuple[Path, ...] = ()


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
    meta: dict[str, Any] = {
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
        meta["tensors_sha256"] = _file_sha256(tmp / "tensors.safetensors")
        meta["sha256"] = _meta_sha256(meta)
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


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _meta_sha256(meta: Mapping[str, Any]) -> str:
    """sha256 of ``state.json``'s content without its own ``sha256`` field (sorted keys)."""
    body = {k: v for k, v in meta.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, allow_nan=True).encode()).hexdigest()


def load_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint in folder ``path``, verified: its format, and the checksums of
    ``state.json`` and ``tensors.safetensors`` (checkpoints written without them load
    unchecked). :class:`CheckpointError` says what is wrong."""
    path = Path(path)
    try:
        meta = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: state.json unreadable ({exc})") from None
    if meta.get("format") != FORMAT or meta.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format {meta.get('format')!r} v{meta.get('format_version')} is not "
            f"{FORMAT} v<={FORMAT_VERSION}"
        )
    if "sha256" in meta and meta["sha256"] != _meta_sha256(meta):
        raise CheckpointError(f"{path}: state.json does not match its checksum")
    tensors_file = path / "tensors.safetensors"
    try:
        if "tensors_sha256" in meta and meta["tensors_sha256"] != _file_sha256(tensors_file):
            raise CheckpointError(f"{path}: tensors.safetensors does not match its checksum")
        tensors = load_file(str(tensors_file))
        state = unflatten_state(meta["state"], tensors)
        return Checkpoint(
            path=path,
            step=int(meta["step"]),
            model_version=int(meta["model_version"]),
            ledger_entries=int(meta["ledger_entries"]),
            state=state,
        )
    except CheckpointError:
        raise
    except Exception as exc:  # safetensors raises its own type; a bad tree a KeyError
        message = " ".join(str(exc).split()) or type(exc).__name__
        raise CheckpointError(f"{path}: unreadable ({message})") from None


def _step_of(name: str) -> int | None:
    digits = name.removeprefix("ckpt-")
    return int(digits) if name.startswith("ckpt-") and digits.isdigit() else None


def load_latest(
    directory: str | Path, check: Callable[[Checkpoint], str | None] | None = None
) -> Checkpoint | None:
    """The checkpoint ``LATEST`` names or, when it does not verify (:func:`load_checkpoint`,
    then ``check``, which returns why a checkpoint is unusable or None), the newest older one
    that does, with :attr:`Checkpoint.fallback` saying why. None when there is no checkpoint
    yet; :class:`CheckpointError` when there are checkpoints and none verifies."""
    directory = Path(directory)
    folders = {
        step: p
        for p in directory.glob("ckpt-*")
        if p.is_dir() and (step := _step_of(p.name)) is not None
    }
    pointer = directory / LATEST
    try:
        named = pointer.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        named = None
    except OSError as exc:
        named = f"unreadable ({exc.strerror or exc})"
    if named is None and not folders:
        return None
    newest = _step_of(named) if named is not None else None
    candidates = [directory / named] if newest is not None else []
    candidates += [
        folders[s] for s in sorted(folders, reverse=True) if newest is None or s < newest
    ]
    reasons: list[str] = [] if newest is not None else [f"{LATEST} is {named or 'missing'}"]
    for path in candidates:
        try:
            checkpoint = load_checkpoint(path)
            problem = check(checkpoint) if check is not None else None
        except CheckpointError as exc:
            problem = str(exc).removeprefix(f"{path}: ")
        if problem is None:
            if not reasons:
                return checkpoint
            passed = tuple(p for p in candidates[: candidates.index(path)] if p.is_dir())
            return replace(checkpoint, fallback="; ".join(reasons), passed_over=passed)
        reasons.append(f"{path.name}: {problem}")
    raise CheckpointError(
        f"no checkpoint in {directory} verifies ({'; '.join(reasons)}): restore one from a "
        f"backup, or move the ckpt-* folders and {LATEST} out of it to continue from the "
        "initial model (the charged steps stay charged and are not re-run)"
    )


def restore_latest(
    directory: str | Path,
    params: Mapping[str, torch.Tensor],
    strategy: Any,
    check: Callable[[Checkpoint], str | None] | None = None,
) -> Checkpoint | None:
    """Copy the parameters of :func:`load_latest`'s checkpoint into ``params`` and its strategy
    state into ``strategy``; return the checkpoint, or None when there is none yet. After a
    fallback it logs which checkpoint it took and why (one line), renames the newer folders it
    passed over to ``unverified-ckpt-*`` (kept for inspection, never loaded or pruned), and
    points ``LATEST`` at the one it took."""
    directory = Path(directory)
    checkpoint = load_latest(directory, check)
    if checkpoint is None:
        return None
    for name, value in checkpoint.state["params"].items():
        params[name].copy_(value)
    strategy.load_state_dict(checkpoint.state["strategy"])
    if checkpoint.fallback is not None:
        moved = [_set_aside(path) for path in checkpoint.passed_over]
        atomic_write_text(directory / LATEST, checkpoint.path.name + "\n")
        log.warning(
            "resuming from %s (step %d), the newest checkpoint that verifies: %s%s",
            checkpoint.path.name,
            checkpoint.step,
            checkpoint.fallback,
            f" (kept as {', '.join(moved)})" if moved else "",
        )
    return checkpoint


def _set_aside(path: Path) -> str:
    """Rename a checkpoint folder that did not verify out of the ``ckpt-*`` names."""
    target = path.with_name(f"unverified-{path.name}")
    if target.exists():
        target = path.with_name(f"unverified-{path.name}-{uuid.uuid4().hex[:8]}")
    os.rename(path, target)
    return target.name
