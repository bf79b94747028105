"""The DeepSpeed JSON a config may name (``model.deepspeed_config``), and why one cannot drive a
userdp worker: a ZeRO stage or a parallelism that splits a unit's gradient across ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ZERO3_REFUSAL = (
    "ZeRO-3 is not supported: it keeps only a partition of each parameter on a rank outside a "
    "module's forward/backward, while the clipping engines read whole parameters (shapes, "
    "per-unit norms) and a worker applies the coordinator's broadcast to whole tensors; neither "
    "is implemented for partitioned parameters (docs/worker.md). Use stage 0-2"
)


PARTITIONING = ("tensor_parallel", "sequence_parallel_size", "pipeline", "moe", "expert_parallel")
"""Keys that split a module's parameters or tokens across a worker's ranks: a rank would then
see only part of a unit's gradient (its norm) or of its tokens, so they are refused."""


def deepspeed_json_problem(config: Any) -> str | None:
    """Why a DeepSpeed config object cannot drive a userdp worker (None when it can)."""
    if not isinstance(config, dict):
        return "must hold a JSON object (DeepSpeed's config format)"
    stage = (config.get("zero_optimization") or {}).get("stage", 0)
    if stage not in (0, 1, 2):
        return f"sets zero_optimization.stage = {stage!r}; {ZERO3_REFUSAL}"
    for key in PARTITIONING:
        value = config.get(key)
        if value not in (None, {}, False, 0, 1):
            return (
                f"sets {key!r}: it splits a module's parameters or tokens across the worker's "
                "ranks, so no rank sees a unit's whole gradient to clip it; remove it"
            )
    return None


def read_deepspeed_json(path: str | None) -> dict[str, Any] | None:
    """``model.deepspeed_config``'s JSON object (None when unset); ValueError naming the file and
    what is wrong when it is unreadable or cannot drive a userdp worker."""
    if not path:
        return None
    try:
        loaded = json.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(
            f"model.deepspeed_config = {path!r} is not a file (a DeepSpeed JSON config)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(
            f"model.deepspeed_config = {path!r} is not a readable JSON file: {exc}"
        ) from None
    problem = deepspeed_json_problem(loaded)
    if problem:
        raise ValueError(f"model.deepspeed_config = {path!r} {problem}")
    return loaded
