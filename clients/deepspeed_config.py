"""The DeepSpeed JSON a config may name (``model.deepspeed_config``), and why one cannot drive a
userdp worker: a ZeRO setting or a parallelism that splits a unit's gradient across ranks, or that
a model version could not reach."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ZERO_STAGES = (0, 1, 2, 3)

PARTITIONING = ("tensor_parallel", "sequence_parallel_size", "pipeline", "moe", "expert_parallel")
"""Keys that split a module's parameters or tokens across a worker's ranks: a rank would then
see only part of a unit's gradient (its norm) or of its tokens, so they are refused."""


def _zero_problem(zero: Any) -> str | None:
    if not isinstance(zero, dict):
        return "sets zero_optimization to something other than a JSON object"
    stage = zero.get("stage", 0)
    if stage not in ZERO_STAGES:
        return f"sets zero_optimization.stage = {stage!r}; it must be 0, 1, 2 or 3"
    offload = zero.get("offload_param") or {}
    if isinstance(offload, dict) and offload.get("device") == "nvme":
        return (
            "sets zero_optimization.offload_param.device = 'nvme': a worker writes each model "
            "version into its parameter partitions, which NVMe offload keeps swapped out; use "
            "'cpu' or 'none'"
        )
    if zero.get("zero_hpz_partition_size", 1) not in (None, 1):
        return (
            "sets zero_optimization.zero_hpz_partition_size: ZeRO++ keeps a second copy of each "
            "partition that a worker's model version would not reach; remove it"
        )
    return None


def deepspeed_json_problem(config: Any) -> str | None:
    """Why a DeepSpeed config object cannot drive a userdp worker (None when it can)."""
    if not isinstance(config, dict):
        return "must hold a JSON object (DeepSpeed's config format)"
    problem = _zero_problem(config.get("zero_optimization") or {})
    if problem:
        return problem
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
