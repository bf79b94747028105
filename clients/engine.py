"""The worker's compute engine: the SUM of per-unit clipped gradients of a task's units.

    sums = Σ_u c_u·g_u,   g_u = ∇ (1/n_u) Σ_{e∈u} mean_t CE_e,t,   c_u = min(1, C/‖g_u‖)

over ALL trainable parameters jointly (Algorithms 1 and 2 of "Fine-Tuning Large Language Models
with User-Level Differential Privacy": a user's gradient is the mean of its examples' unclipped
gradients, clipped once; an example-level unit has one example). No
normalization and no noise: those are the coordinator's. Loss layout, padding and the token
budget are in :mod:`userdp.clients.batching`; clipping arithmetic in
:mod:`userdp.clients.clipping`.

Three clipping engines behind :meth:`ClippingEngine.run`, which takes one task as one
:class:`EngineRequest` (``clipped_sum`` is its keyword form) and dispatches through the registry
:data:`CLIPPED_SUMS` (docs/worker.md):

- ``loop``: one forward/backward per unit (reference, always correct).
- ``vectorized``: many units per micro-batch; exact per-unit norms from per-layer factors
  captured by hooks, then the clipped sum by book-keeping (:mod:`userdp.clients.vectorized`,
  :mod:`userdp.clients.ghost`).
- ``randomized``: the same pass with norm ESTIMATES from fresh Gaussian probes, Hutchinson or
  Hutch++ (DP-SGD-RC, "Efficient DP-SGD for LLMs with Randomized Clipping";
  :mod:`userdp.clients.sketch`); only for the randomized-clipping strategy, whose accountant
  covers the estimate.

With ``local_steps ≥ 1`` (DP-FedAvg) the clipped quantity is each unit's local model delta
(:mod:`userdp.clients.fedavg`).

:func:`build_engine` builds the model of the config (:func:`userdp.clients.model.build_model`)
and wraps it with DeepSpeed (:mod:`userdp.clients.distributed`). Inside one worker with
torch.distributed initialized (world size > 1), ``run`` is a collective: every rank must call
it with the same units; ranks split the units and all-reduce the clipped sums, after
all-reducing a failure flag so that one rank's error fails the call on every rank. Under ZeRO-3
the clipped sums are instead reduce-scattered to the partition owners as each pass ends and
gathered to rank 0 at the end (:mod:`userdp.clients.sharded_sums`). A worker's
ranks are driven by :mod:`userdp.clients.ranks` (rank 0 broadcasts each task to the others).
An engine is not thread-safe: the vectorized engines attach hooks to the shared module per call.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from userdp.clients.batching import EngineError, Unit, prepare_units
from userdp.clients.clipping import Accumulator, UnitWork, loop_clipped_sum
from userdp.clients.deepspeed_config import read_deepspeed_json
from userdp.clients.distributed import (
    all_reduce_statistics,
    all_reduce_sums,
    partitioned_build,
    prepare_deepspeed,
    raise_if_any_rank_failed,
    split_units,
    world,
    wrap_with_deepspeed,
)
from userdp.clients.engine_request import EngineRequest
from userdp.clients.fedavg import fedavg_clipped_sum
from userdp.clients.model import build_model, model_shape
from userdp.clients.sharded_sums import ShardedAccumulator
from userdp.clients.sketch import SKETCHES, GaussianProbes, ProbeSource
from userdp.clients.unit_cost import device_rates
from userdp.clients.vectorized import vectorized_clipped_sum
from userdp.clients.zero3 import Lockstep, any_partitioned, offload_device
from userdp.proto.results import TaskSum

__all__ = [
    "CLIPPED_SUMS",
    "ENGINES",
    "ClippingEngine",
    "EngineError",
    "EngineRequest",
    "Unit",
    "build_engine",
]

ENGINES = ("loop", "vectorized", "randomized")
_ALIASES = {"ghost": "vectorized"}


class ClippingEngine:
    """Sums of clipped unit gradients on ``module`` (see the module docstring).

    module: the torch model (for DeepSpeed, the engine's ``.module``); its trainable
        ``named_parameters()`` (tied parameters once) are the keys of ``sums``.
    engine: default clipping engine; a task may name another one per call.
    probes: default probes k for ``randomized`` (Hutch++: k per probe matrix, S and P).
    estimator: default norm estimator for ``randomized``: ``"hutchinson"`` or ``"hutch++"``.
    token_budget: default padded tokens per micro-batch.
    pad_id: token id written into padded positions (never a target).
    tensor_core_matmul: vectorized engines on a bf16 CUDA model: bf16 tensor-core GEMMs for the
        norms and book-keeping, each unit clipped by a proven bound on what it releases
        (``workers.tensor_core_matmul``, the default; :mod:`userdp.clients.tensor_core_bound`);
        false: IEEE float32 GEMMs.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        *,
        engine: str = "vectorized",
        probes: int = 32,
        estimator: str = "hutchinson",
        token_budget: int = 8192,
        pad_id: int = 0,
        deepspeed_engine: Any = None,
        tensor_core_matmul: bool = True,
    ) -> None:
        self.module = module
        self.engine = self._engine_name(engine)
        self.probes = int(probes)
        self.estimator = self._estimator_name(estimator)
        self.token_budget = int(token_budget)
        self.pad_id = int(pad_id)
        self.deepspeed_engine = deepspeed_engine
        self.tensor_core_matmul = bool(tensor_core_matmul)
        # the vectorized engines check their per-unit attribution against one plain batch
        # gradient on their first all-finite micro-batch (clients/attribution.py)
        self.attribution_verified = False
        self.params = {n: p for n, p in module.named_parameters() if p.requires_grad}
        if not self.params:
            raise EngineError("the model has no trainable parameters")
        self.device = next(iter(self.params.values())).device
        device_rates(self.device)  # a GPU's, measured now, before any activation is in memory
        config = getattr(module, "config", None)
        self.max_positions = getattr(config, "n_positions", None) or getattr(
            config, "max_position_embeddings", None
        )

    @staticmethod
    def _engine_name(name: str) -> str:
        name = _ALIASES.get(name, name)
        if name not in ENGINES:
            raise EngineError(f"engine {name!r} is not one of {ENGINES} (or 'ghost')")
        return name

    @staticmethod
    def _estimator_name(name: str) -> str:
        if name not in SKETCHES:
            raise EngineError(f"estimator {name!r} is not one of {tuple(SKETCHES)}")
        return name

    def trainable_parameters(self) -> dict[str, torch.Tensor]:
        return dict(self.params)

    def run(self, request: EngineRequest) -> TaskSum:
        """Σ_u clip(g_u, C) over ``request.units`` and its statistics (:class:`TaskSum`); the
        task's options are those of :class:`EngineRequest`. Under ZeRO-3 only rank 0 (the one
        that sends the result) gets the sums; the other ranks get the statistics and an empty
        ``sums``."""
        clip_norm = request.clip_norm
        if not (clip_norm > 0 and clip_norm < float("inf")):
            raise EngineError(f"clip_norm must be a positive finite number, got {clip_norm!r}")
        rank, world_size = world()
        error: Exception | None = None
        try:
            acc = self._local_sum(request, rank, world_size)
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the ranks agree
            error = exc
        if world_size > 1:
            # every rank learns whether any rank failed BEFORE the result all-reduce: one
            # rank raising alone would leave the others blocked in that collective forever
            raise_if_any_rank_failed(
                error,
                self.device,
                f"rank {rank}: another rank of this worker failed on the same task (its log has "
                "the error); this task's result is discarded on every rank",
            )
            if isinstance(acc, ShardedAccumulator):  # reduce-scattered already; rank 0 gathers
                return all_reduce_statistics(acc.result(), self.device)
            all_reduce_sums(acc)
            return all_reduce_statistics(acc.result(), self.device)
        if error is not None:
            raise error
        return acc.result()

    def clipped_sum(self, units: Sequence[Unit], clip_norm: float, **options: Any) -> TaskSum:
        """:meth:`run` of ``EngineRequest(units, clip_norm, **options)``: the keyword form that
        tests, benchmarks and tools call (``options``: the fields of :class:`EngineRequest`)."""
        return self.run(EngineRequest(tuple(units), clip_norm, **options))

    def _local_sum(self, request: EngineRequest, rank: int, world_size: int) -> Accumulator:
        """This rank's share of :meth:`run` (all of it in a single process)."""
        request = self._with_defaults(request)
        prepared = prepare_units(request.units, self.max_positions)
        mine = list(range(len(prepared)))
        if world_size > 1:
            costs = [max(1, u.positions) for u in prepared]
            mine = split_units(costs, world_size)[rank]
        if request.local_steps and any_partitioned(self.params):
            raise EngineError(
                "DP-FedAvg (strategy.local_steps >= 1) takes SGD steps on a private copy of "
                "the whole model per unit, which a ZeRO-3 worker does not hold: use "
                "model.zero_stage <= 2"
            )
        acc, lockstep = self._accumulator(request.clip_norm, world_size)
        acc.skipped_examples = sum(prepared[i].skipped for i in mine)
        work = UnitWork(
            self.module,
            self.params,
            prepared,
            mine,
            acc,
            request.token_budget,
            self.pad_id,
            lockstep,
        )
        CLIPPED_SUMS["fedavg" if request.local_steps else request.engine](self, work, request)
        return acc

    def _with_defaults(self, request: EngineRequest) -> EngineRequest:
        """``request`` with this engine's defaults for the options it leaves open, checked."""
        engine, budget = request.engine, request.token_budget
        return dataclasses.replace(
            request,
            engine=self._engine_name(engine) if engine else self.engine,
            token_budget=int(budget) if budget else self.token_budget,
            probes=self.probes if request.probes is None else int(request.probes),
            estimator=(
                self._estimator_name(request.estimator) if request.estimator else self.estimator
            ),
        )

    def _accumulator(
        self, clip_norm: float, world_size: int
    ) -> tuple[Accumulator, Lockstep | None]:
        """This rank's accumulator and, under ZeRO-3 over ranks, the lockstep of its passes."""
        if world_size > 1 and any_partitioned(self.params):  # ZeRO-3 (clients/zero3.py)
            lockstep = Lockstep(self.device, self.pad_id, self.max_positions)
            return ShardedAccumulator(self.params, float(clip_norm)), lockstep
        acc = Accumulator(self.params, float(clip_norm), device=offload_device(self.params))
        # one process: the sums start for host memory during the last micro-batch; ranks
        # first sum them on the device (all_reduce_sums)
        acc.early_copy = world_size == 1 and acc.flat.device.type == "cuda"
        return acc, None


def _loop(engine: ClippingEngine, work: UnitWork, request: EngineRequest) -> None:
    loop_clipped_sum(work)


def _vectorized(
    engine: ClippingEngine,
    work: UnitWork,
    request: EngineRequest,
    probes: ProbeSource | None = None,
) -> None:
    verified = vectorized_clipped_sum(
        work,
        probes=probes,
        verify=not engine.attribution_verified,
        tensor_cores=engine.tensor_core_matmul,
    )
    engine.attribution_verified = engine.attribution_verified or verified


def _randomized(engine: ClippingEngine, work: UnitWork, request: EngineRequest) -> None:
    probes = None
    if request.probes > 0:  # k = 0: exact norms (the proto's "0 = exact")
        probes = GaussianProbes(
            request.probes, seed=request.probe_seed, estimator=request.estimator
        )
    _vectorized(engine, work, request, probes)


def _fedavg(engine: ClippingEngine, work: UnitWork, request: EngineRequest) -> None:
    fedavg_clipped_sum(
        work,
        local_steps=int(request.local_steps),
        local_lr=float(request.local_lr),
        local_batch_size=int(request.local_batch_size),
    )


CLIPPED_SUMS: dict[str, Callable[[ClippingEngine, UnitWork, EngineRequest], None]] = {
    "loop": _loop,
    "vectorized": _vectorized,
    "randomized": _randomized,
    "fedavg": _fedavg,
}
"""Engine name -> the function that adds this rank's share of a task (:class:`UnitWork`) with
the request's own options (defaults filled in). ``fedavg`` runs whenever the request has
``local_steps >= 1``, whatever its ``engine``."""


def build_engine(
    config: Any,
    manifest: Any,
    *,
    seed: int | None = None,
    use_deepspeed: bool = True,
    on_phase: Callable[[str], None] | None = None,
) -> ClippingEngine:
    """The worker's engine for a validated :class:`userdp.config.Config` and shard manifest.

    Builds the model (``model`` section; ``data.seq_len`` context), wraps it with DeepSpeed (the
    ``model.deepspeed_config`` JSON if given, ZeRO ``model.zero_stage`` unless that file sets
    one, bf16 when ``model.dtype = "bf16"``) unless ``use_deepspeed`` is False
    (in-process tests and tools), and takes the engine, probes, estimator and token budget from
    ``strategy.engine``, ``strategy.probes``, ``strategy.estimator`` and
    ``workers.token_budget``. Its initial weights are replaced by the coordinator's broadcast;
    ``seed`` (default ``output.seed``, else 0) only makes research runs reproducible.
    ``on_phase`` hears the start-up phases (loading the model, building DeepSpeed ops,
    initializing DeepSpeed) for worker progress reports."""
    shape = model_shape(manifest, config.data.seq_len)
    if seed is None:
        seed = config.output.seed if config.output.seed is not None else 0
    device = torch.device(config.workers.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise EngineError("workers.device = 'cuda' but no CUDA device is visible; use 'cpu'")
    bf16, user_json = (
        config.model.dtype == "bf16",
        read_deepspeed_json(config.model.deepspeed_config),
    )
    building = contextlib.nullcontext()
    if use_deepspeed:  # ZeRO-3 over ranks: the model is built partitioned
        prepare_deepspeed(device.type, on_phase)
        building = partitioned_build(config.model.zero_stage, bf16, user_json)
    if on_phase is not None:
        on_phase("loading model")
    with building:
        module = build_model(config.model, shape, seed)
    ds_engine = None
    if use_deepspeed:
        ds_engine = wrap_with_deepspeed(
            module, config.model.zero_stage, bf16, device.type, on_phase, user_json
        )
        module = ds_engine.module
    else:
        module = module.to(device)
    pad_id = shape.pad_id if shape.pad_id is not None else 0
    return ClippingEngine(
        module,
        engine=config.strategy.engine,
        probes=config.strategy.probes,
        estimator=config.strategy.estimator,
        token_budget=config.workers.token_budget,
        pad_id=pad_id,
        tensor_core_matmul=config.workers.tensor_core_matmul,
        deepspeed_engine=ds_engine,
    )
