"""DeepSpeed around the worker's model, and the cross-rank reduction of clipped sums.

Decision (docs/worker.md, "DeepSpeed"): DeepSpeed wraps the model for device
placement, process-group setup (gloo on CPU, NCCL on GPU), bf16 and ZeRO stage 0–3 partitioning
(stage 3: :mod:`userdp.clients.zero3`), but per-unit gradients are computed with
``torch.autograd.grad`` on ``engine.module`` into our own buffers. ``autograd.grad`` never runs the AccumulateGrad nodes on which ZeRO-1/2 hang their
bucketing/reduction hooks, so no unclipped unit gradient is ever reduced across ranks. Inside one
worker the ranks split the UNITS (a unit is never split); :func:`all_reduce_sums` sums the
clipped task sums on the device and :func:`all_reduce_statistics` the statistics. ZeRO-1/2 require an optimizer: a torch SGD with lr 0 is
passed and never stepped (the coordinator owns the update; the worker only copies parameters).
ZeRO-3 gets none: DeepSpeed then only partitions and gathers parameters.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from userdp.clients.batching import EngineError
from userdp.clients.deepspeed_config import deepspeed_json_problem
from userdp.clients.deepspeed_ops import build_startup_ops
from userdp.clients.zero3 import partition_summary
from userdp.proto.collectives import failure_count
from userdp.proto.results import TaskSum
from userdp.strategies.unit_stats import UnitStats

if TYPE_CHECKING:
    from userdp.clients.clipping import Accumulator

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _default_env() -> None:
    """Single-process defaults for torch.distributed's env:// rendezvous.

    A multi-rank launch (WORLD_SIZE > 1) keeps the launcher's MASTER_ADDR/PORT. A single rank
    always takes a fresh free port: a MASTER_PORT inherited from a parent that initialized its
    own process group is still held by that parent (two workers would collide on it)."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if os.environ.get("WORLD_SIZE", "1") == "1" or "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")


# Keys of a user's DeepSpeed config that userdp sets itself: workers never step an optimizer
# (the coordinator owns the update) and feed DeepSpeed one micro-batch per call.
CONTROLLED = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 1 << 62,
}
DROPPED = ("train_batch_size", "optimizer", "scheduler", "fp16", "amp")


def deepspeed_config(
    zero_stage: int, bf16: bool, user: dict[str, Any] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """The config passed to ``deepspeed.initialize``: the user's DeepSpeed JSON (``user``,
    DeepSpeed's own format) with the keys userdp controls set (:data:`CONTROLLED`, bf16 from
    ``model.dtype``) or removed (:data:`DROPPED`: the batch size DeepSpeed derives, the optimizer
    and scheduler userdp never steps, fp16/amp), and ZeRO's stage from the user's file or else
    ``zero_stage``. Returns the config and one note per user value that was overridden. Raises
    EngineError for keys that partition a unit's parameters or tokens
    (:func:`~userdp.clients.deepspeed_config.deepspeed_json_problem`)."""
    config = dict(user or {})
    problem = deepspeed_json_problem(config)
    if problem:
        raise EngineError(f"model.deepspeed_config {problem}")  # checked at load; also here
    notes = []
    for key, value in CONTROLLED.items():
        if key in config and config[key] != value:
            notes.append(f"{key}={config[key]!r} -> {value!r}")
        config[key] = value
    for key in DROPPED:
        if key in config:
            notes.append(f"{key} removed")
            del config[key]
    user_bf16 = config.get("bf16") if isinstance(config.get("bf16"), dict) else {}
    if user_bf16.get("enabled") is not None and bool(user_bf16["enabled"]) != bf16:
        notes.append(f"bf16.enabled={user_bf16['enabled']!r} -> {bf16!r} (model.dtype decides)")
    config["bf16"] = {**user_bf16, "enabled": bf16}
    zero = dict(config.get("zero_optimization") or {})
    zero.setdefault("stage", zero_stage)
    config["zero_optimization"] = zero
    return config, notes


def prepare_deepspeed(device: str, on_phase: Callable[[str], None] | None = None) -> None:
    """What DeepSpeed needs before its first use in a worker: its accelerator (CPU for
    ``device = "cpu"``, unless ``DS_ACCELERATOR`` is set), its comm op built or loaded
    (:mod:`userdp.clients.deepspeed_ops`) and the rendezvous environment of a single process."""
    global _ops_ready
    phase = on_phase or (lambda name: None)
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if not _ops_ready:  # build_engine prepares before the model is built, then wraps it
        phase("building DeepSpeed ops")  # the reporter repeats it while the build runs
        build_startup_ops()
        _ops_ready = True
    if not torch.distributed.is_initialized():
        _default_env()


_ops_ready = False


@contextmanager
def partitioned_build(
    zero_stage: int, bf16: bool, user_config: dict[str, Any] | None = None
) -> Iterator[None]:
    """At ZeRO stage 3 with more than one rank, or with parameters offloaded to host memory
    (``offload_param``), models built inside this context are built partitioned: transformers' ``from_pretrained`` / ``from_config`` run under
    ``deepspeed.zero.Init`` (each parameter partitioned as its module is created, a folder's
    weights loaded module by module into the partitions), so no rank holds the whole model.
    transformers reads that from a process-wide DeepSpeed config, set here and unset on exit, so
    that no other model of the process is built partitioned. Otherwise it does nothing."""
    config, _ = deepspeed_config(zero_stage, bf16, user_config)
    zero = config["zero_optimization"]
    offloaded = (zero.get("offload_param") or {}).get("device", "none") != "none"
    if zero["stage"] != 3 or (int(os.environ.get("WORLD_SIZE", "1")) < 2 and not offloaded):
        yield
        return
    import deepspeed
    from transformers.integrations import HfDeepSpeedConfig
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    if not torch.distributed.is_initialized():
        deepspeed.init_distributed()
    alive = HfDeepSpeedConfig(config)  # transformers keeps only a weak reference to it
    try:
        yield
    finally:
        unset_hf_deepspeed_config()
        del alive


def wrap_with_deepspeed(
    module: torch.nn.Module,
    zero_stage: int,
    bf16: bool,
    device: str = "cpu",
    on_phase: Callable[[str], None] | None = None,
    user_config: dict[str, Any] | None = None,
) -> Any:
    """``deepspeed.initialize`` around ``module``; returns the DeepSpeedEngine.

    ``user_config`` is ``model.deepspeed_config``'s JSON (:func:`deepspeed_config` says which of
    its keys userdp overrides; the overrides are logged in one line).
    ``device`` is ``workers.device``: for "cpu" DeepSpeed's CPU accelerator is selected
    (``DS_ACCELERATOR``, unless already set) and the placement is checked afterwards. On CPU
    DeepSpeed JIT-compiles its shared-memory comm op on first use, into ``$TORCH_EXTENSIONS_DIR``:
    setup builds it (:mod:`userdp.clients.deepspeed_ops`), and here it is loaded from that cache
    or built, healing a lock left by a killed build, before ``deepspeed.initialize`` would wait on
    it. ``on_phase`` hears the start-up phases (worker progress reports)."""
    phase = on_phase or (lambda name: None)
    prepare_deepspeed(device, on_phase)
    import deepspeed

    phase("initializing DeepSpeed")
    optimizer = None
    config, notes = deepspeed_config(zero_stage, bf16, user_config)
    if notes:
        log.warning("model.deepspeed_config: userdp overrides %s", "; ".join(notes))
    if config["zero_optimization"]["stage"] in (1, 2):  # ZeRO-3 runs without one: parameter
        # partitioning only, no fp32 master partitions and no gradient hooks (clients/zero3.py)
        trainable = [p for p in module.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(trainable, lr=0.0)
    try:
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
    except AssertionError as exc:  # DeepSpeed reports configuration problems as assertions
        raise EngineError(f"deepspeed.initialize refused the worker model: {exc}") from exc
    if config["zero_optimization"]["stage"] == 3:
        log.info("ZeRO-3: %s", partition_summary(engine.module))
    placed = next(engine.module.parameters()).device.type
    if placed != device:
        raise EngineError(
            f"DeepSpeed placed the model on {placed!r} but workers.device = {device!r}: set "
            f"workers.device = {placed!r} or DS_ACCELERATOR={device} before the worker starts"
        )
    return engine


def world() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def split_units(costs: list[int], world_size: int) -> list[list[int]]:
    """Deterministic balanced split of unit indices across ranks (largest cost first to the
    least-loaded rank); every rank computes the same split from the same unit list."""
    loads = [0] * world_size
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        shares[rank].append(index)
        loads[rank] += costs[index]
    return [sorted(share) for share in shares]


def any_rank_failed(failed: bool, device: torch.device) -> bool:
    """Whether any rank of the default process group reports a failure
    (:func:`userdp.proto.collectives.failure_count`; every rank must call it once per task,
    failed or not)."""
    return failure_count(failed, device=device) > 0


def raise_if_any_rank_failed(
    error: BaseException | None, device: torch.device, message: str
) -> None:
    """:func:`any_rank_failed` for a step every rank took: when any rank failed, each raises,
    the failing ones their own ``error``, the others an :class:`EngineError` with ``message``
    (so no rank goes on alone into a collective the failed one never reaches)."""
    if any_rank_failed(error is not None, device):
        if error is not None:
            raise error
        raise EngineError(message)


def all_reduce_sums(acc: Accumulator) -> None:
    """Sum the ranks' task sums where they are, in the accumulator's one flat buffer (the same
    layout on every rank: the same parameters in the same order), before the one copy to host
    memory."""
    acc.finish()
    torch.distributed.all_reduce(acc.flat, op=torch.distributed.ReduceOp.SUM)


def all_reduce_statistics(result: TaskSum, device: torch.device) -> TaskSum:
    """``result`` with the ranks' statistics summed (min/max for the norm extremes) and its sums
    as they are (already reduced: ZeRO-3's shards, :mod:`userdp.clients.sharded_sums`)."""
    dist = torch.distributed
    mine = result.stats
    totals = torch.tensor(
        [
            mine.count,
            mine.nonfinite,
            mine.clipped,
            mine.norm_sum,
            mine.norm_sum_sq,
            mine.loss_sum,
            mine.tokens,
            result.skipped_examples,
        ],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    big = torch.finfo(torch.float64).max
    lo = torch.tensor([mine.norm_min if mine.count else big], dtype=torch.float64)
    hi = torch.tensor([mine.norm_max], dtype=torch.float64)
    lo, hi = lo.to(device), hi.to(device)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    count, nonfinite, clipped, norm_sum, norm_sum_sq, loss_sum, tokens, skipped = totals.tolist()
    stats = UnitStats(
        count=int(count),
        nonfinite=int(nonfinite),
        clipped=int(clipped),
        norm_min=float(lo) if count else 0.0,
        norm_max=float(hi),
        norm_sum=norm_sum,
        norm_sum_sq=norm_sum_sq,
        loss_sum=loss_sum,
        tokens=int(tokens),
    )
    return TaskSum(result.sums, stats, skipped_examples=int(skipped))
