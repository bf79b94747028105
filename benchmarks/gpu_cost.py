"""A cost model of the worker's GPU step that runs without a GPU: count on CPU, predict H100/H200.

For a model shape, one non-private step and the private steps (``ClippingEngine.clipped_sum``,
ULS G=g and ELS, with the norm GEMMs in IEEE float32 or as bf16 tensor-core GEMMs) of the real
engine (``userdp.clients.engine.build_engine``, bf16, ZeRO 0, built and driven by the helpers of
``benchmarks/end_to_end.py``) run on the CPU under a ``TorchDispatchMode`` that sees every aten
op and counts, per engine phase (the ``userdp.*`` ranges of ``clients/vectorized.py`` and
``clients/ghost.py``):

* **launches**: one per aten op that would be a GPU kernel. Not kernels: views and other
  metadata ops (every return aliases an input without writing it, and ``_unsafe_view``),
  allocations (``empty*``, ``resize_``), ``item()``, ops with empty outputs, and ops on the
  host-side token layout (``Layout.of``, ``Padded.of``, ``make_batch``). One aten op may be a
  few kernels on a GPU (a norm's two-pass reduction, the embedding backward); the fitted
  per-launch time absorbs the average.
* **GEMM FLOPs by precision**, from torch's FLOP counter formulas (``torch.utils.flop_counter``:
  mm, addmm, bmm, baddbmm, convolution, attention; CPU flash attention takes the GPU flash
  formula). The engine routes its norm and book-keeping GEMMs by operand dtype
  (``clients/matmul_precision.py``): ``mm32`` widens bf16 operands to float32 and runs IEEE
  float32 GEMMs under ``exact_matmul`` (TF32 off), or, with ``workers.tensor_core_matmul``,
  passes bf16 operands to ``mm(..., out_dtype=float32)``. The model's own GEMMs take its bf16
  activations. So a GEMM is classified by what the GPU does with its operands: bf16 →
  "bf16 tensor core", float32 → "IEEE float32" (or "tf32 tensor core" where the CUDA matmul
  precision flag allows TF32 at that moment; nothing in the step sets it). GEMMs are also
  counted by the bytes they move and kept per call site (the two innermost frames outside
  torch), so that the roofline is applied to the extrapolated step: a site whose bytes take
  longer than its FLOPs (the retained gradients' Σ_u c_u M_u, a [1, U] × [U, n] product; the
  ghost norms' T×T grams on tensor cores) is timed by its bytes.
* **bytes moved** by the other kernels: the distinct elements of their tensor inputs
  (stride-0 dimensions once) plus their outputs, at the dtype of the run, which is the GPU's:
  the model runs in bf16 as on the GPU, so the engine's float32 widening copies and float32
  buffers appear as themselves. Write-only destinations (``out=``, ``copy_``/``fill_``/
  ``zero_``'s self) are not read, nor is the log-probability matrix that ``nll_loss_backward``
  takes for its shape; gathers (embedding, index, gather, ``nll_loss_forward``) read only what
  they output plus the index. The bytes of bf16 → float32 copies are also reported alone.

The CPU run uses the GPU's dtypes, not float32: an AVX2 CPU has no bf16 GEMM (1.5 GFLOP/s), so
the counting mode computes bf16 GEMMs (and ``mm/bmm(..., out_dtype)``, which CPUs lack) in
float32 and rounds the result to the op's dtype; everything else runs as called. The GPU code
paths are taken on the CPU by one adapter (:func:`gpu_code_paths`): the engine's "is this a CUDA
tensor" tests in ``matmul_precision`` and its CPU-only chunking of retained per-unit gradients.
Not visible on a CPU: host↔device copies (``.to(device)``, ``.cpu()`` are no-ops there) and the
syncs they imply; the one copy of the clipped sums to host memory per step is added as bytes
over the host link.

Extrapolation: a micro-batch is counted at two sizes (u₁ < u₂ units, ``--count-tokens``), every
count is fitted as a + b·units per micro-batch (per-weight work is constant, token work linear;
a chunk count that steps with the units is approximated), and the step is the sum over the
micro-batches ``pack_units`` makes of ``--tokens-per-step`` at ``--token-budget``, plus what a
later micro-batch costs beyond a first (accumulating gradients or clipped sums instead of a
first write), counted once on one-example micro-batches. ``--check`` (on in ``--quick``)
compares this with a direct count of the whole step. ELS units are G=1 units: ELS rows reuse the
G=1 counts.

Predicted GPU time per step, per device (peaks from the NVIDIA H100 Tensor Core GPU datasheet
and the NVIDIA H200 Tensor Core GPU datasheet, SXM, dense: bf16 tensor core 989 TFLOP/s, TF32
495, float32 without tensor cores 67 TFLOP/s, HBM 3.35 TB/s H100 / 4.8 TB/s H200; host link
PCIe 5.0 x16, 64 GB/s):

    T = F_bf16/(989T·e_tc) + F_tf32/(495T·e_tc) + F_fp32/(67T·e_fp32) + B/(HBM·e_mem)
        + launches·t_launch + host bytes/64 GB/s

(in a private step's prediction, the host copy only where it outlasts the last micro-batch's
book-keeping, which it overlaps: :func:`exposed_host_copy`)

(a GEMM site's F or its bytes, whichever takes longer). The terms add: no overlap of launches
with kernels, no L2 reuse. e_tc, e_fp32, e_mem and t_launch are fitted by least squares (log
residuals) to the measured H200 rows that were counted (:data:`H200_RATIOS`; the fitted rows of
:data:`H200_PROFILE`: step times, and the float32 GEMM time, which alone tells e_fp32 from e_tc
and e_mem); the profile's other parts are predicted as a check. Fitted values and residuals go
into the results, with the fit repeated at fixed per-launch times: where the rows cannot tell
launch time from bytes, that table shows how an overhead's split between the two moves. Without
counted H200 rows, ``--calibration FILE`` (a results JSON) supplies the fit.

    .venv/bin/python benchmarks/gpu_cost.py --quick        # gpt2-tiny, seq 64: < 1 min
    .venv/bin/python benchmarks/gpu_cost.py --models gpt2-small --seq-lens 128 --groups 1 8

Prints JSON, then markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from end_to_end import (  # benchmarks/end_to_end.py: this script's folder is on sys.path
    GPT2_VOCAB,
    HarnessUnavailable,
    _config,
    _load_engine_api,
    _manifest,
    _non_private,
    _units,
)
from torch.utils import flop_counter
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only

aten = torch.ops.aten
RESULTS = Path(__file__).resolve().parent / "results"
PRECISIONS = {"ieee": False, "tensor cores": True}  # label -> workers.tensor_core_matmul

# private/non-private tokens/s on one H200, benchmarks/end_to_end.py (bf16, ZeRO 0, 65,536 tokens
# per step in 16,384-token micro-batches); key: (model, seq, run, precision)
H200_RATIOS = {
    ("gpt2-small", 128, "uls G=1", "ieee"): 0.38,
    ("gpt2-small", 128, "uls G=8", "ieee"): 0.43,
    ("gpt2-small", 128, "els", "ieee"): 0.38,
    ("gpt2-small", 1024, "uls G=1", "ieee"): 0.43,
    ("gpt2-small", 1024, "uls G=8", "ieee"): 0.41,
    ("gpt2-small", 1024, "els", "ieee"): 0.44,
    ("gpt2-small", 128, "uls G=1", "tensor cores"): 0.50,
    ("gpt2-small", 128, "uls G=8", "tensor cores"): 0.73,
    ("gpt2-small", 128, "els", "tensor cores"): 0.50,
}
# one ULS G=8 step and the non-private step of GPT-2 small, seq 128, IEEE float32 norms, under
# torch.profiler on the H200 (end_to_end.py --profile): GPU seconds of the step or of one part;
# (model, seq, run, precision, what, seconds, fitted): what is "step", a term, a phase or
# "widening copies"; the parts not fitted are a check of the breakdown
H200_PROFILE = [
    ("gpt2-small", 128, "uls G=8", "ieee", "step", 0.684, True),
    ("gpt2-small", 128, "non-private", "ieee", "step", 0.302, True),
    ("gpt2-small", 128, "uls G=8", "ieee", "IEEE float32", 0.295, True),
    ("gpt2-small", 128, "uls G=8", "ieee", "userdp.norms", 0.425, False),
    ("gpt2-small", 128, "uls G=8", "ieee", "widening copies", 0.086, False),
    ("gpt2-small", 128, "uls G=8", "ieee", "userdp.bookkeeping", 0.033, False),
]


@dataclass(frozen=True)
class Device:
    """Datasheet peaks (dense)."""

    bf16_flops: float
    tf32_flops: float
    fp32_flops: float
    memory_bytes: float
    host_link_bytes: float


def _datasheet_rates():
    """The H200's datasheet rates as the engine's cost rule takes them (bf16, float32, memory)."""
    from userdp.clients.unit_cost import DeviceRates

    return DeviceRates(_H200.bf16_flops, _H200.fp32_flops, _H200.memory_bytes)


DEVICES = {
    "H100 SXM": Device(989e12, 495e12, 67e12, 3.35e12, 64e9),
    "H200": Device(989e12, 495e12, 67e12, 4.8e12, 64e9),
}
_H200 = DEVICES["H200"]


@dataclass(frozen=True)
class Efficiency:
    """The fitted fractions of peak and the time per kernel launch."""

    tensor_core: float = 1.0
    fp32: float = 1.0
    memory: float = 1.0
    launch_s: float = 0.0


# ---- counting --------------------------------------------------------------------------------

LOW = (torch.bfloat16, torch.float16)
GEMMS = {"mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution"}
CPU_ATTENTION = {
    "_scaled_dot_product_flash_attention_for_cpu": flop_counter.sdpa_flop_count,
    "_scaled_dot_product_flash_attention_for_cpu_backward": flop_counter.sdpa_backward_flop_count,
}
NOT_KERNELS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
NOT_KERNELS |= {"resize_", "set_", "_local_scalar_dense", "_unsafe_view", "_reshape_alias"}
WRITE_ONLY_SELF = {"copy_", "fill_", "zero_"}
GATHERS = {"embedding", "index", "index_select", "gather", "nll_loss_forward"}
SHAPE_ONLY = {"nll_loss_backward": 1}  # an argument read for its shape only
SCATTERS = {"index_put", "index_add"}  # in place: only the rows they add to are read and written


def _distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements of ``t`` (a stride-0 dimension counts once)."""
    return math.prod(s for s, st in zip(t.shape, t.stride(), strict=True) if st) * t.element_size()


def _host_codes() -> set:
    from userdp.clients.batching import make_batch
    from userdp.clients.capture import Layout
    from userdp.clients.norms import Padded

    return {Layout.of.__func__.__code__, Padded.of.__func__.__code__, make_batch.__code__}


def _float32_gemm(func, name: str, args: tuple, kwargs: dict):
    """A bf16 GEMM (or attention) computed in float32, rounded to the op's output dtype."""
    up_args, up_kwargs = tree_map_only(
        torch.Tensor, lambda t: t.float() if t.dtype in LOW else t, (args, kwargs)
    )
    low = next(t.dtype for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.dtype in LOW)
    if func._overloadname == "dtype":  # mm/bmm(..., out_dtype=float32): the tensor-core path
        return getattr(aten, name).default(up_args[0], up_args[1])
    base = getattr(aten, name.rstrip("_")).default
    result = base(*up_args, **{k: v for k, v in up_kwargs.items() if k != "out"})
    if name.endswith("_") or "out" in kwargs:  # in place / out=: write the float32 result back
        target = args[0] if name.endswith("_") else kwargs["out"]
        return target.copy_(result)
    if isinstance(result, tuple):  # attention: (output, logsumexp) or (dq, dk, dv)
        keep = (1,) if name.endswith("_for_cpu") else ()
        return tuple(r if i in keep else r.to(low) for i, r in enumerate(result))
    return result.to(low)


class KernelCounter(TorchDispatchMode):
    """Counts launches, GEMM FLOPs by precision and bytes moved per phase (module docstring)."""

    def __init__(self, default_phase: str) -> None:
        super().__init__()
        self.default_phase = default_phase
        self.ranges: list[str] = []
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.host_codes = _host_codes()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "profiler":  # record_function: the engine's phases
            if func.overloadpacket.__name__.startswith("_record_function_enter"):
                self.ranges.append(str(args[0]))
            elif self.ranges:
                self.ranges.pop()
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        emulate = name.rstrip("_") in GEMMS | set(CPU_ATTENTION) and any(
            t.dtype in LOW for t in tensors
        )
        out = _float32_gemm(func, name, args, kwargs) if emulate else func(*args, **kwargs)
        if func.namespace == "aten":
            self._record(func, name, args, kwargs, tensors, out)
        return out

    def _phase(self) -> tuple[str, str]:
        """The op's phase and call site (the two innermost frames outside torch)."""
        frame, outside, innermost = sys._getframe(3), [], ""
        while frame is not None:
            path = frame.f_code.co_filename
            if frame.f_code in self.host_codes:
                return "host", ""
            if f"{os.sep}torch{os.sep}" not in path and len(outside) < 2:
                innermost = innermost or path
                outside.append(f"{Path(path).name}:{frame.f_lineno}")
            frame = frame.f_back
        site = "<".join(outside)
        named = [r for r in self.ranges if r.startswith("userdp.")]
        if named:
            return named[-1], site
        if torch._C._current_graph_task_id() != -1:
            return "backward", site
        if f"{os.sep}deepspeed{os.sep}" in innermost:
            return "deepspeed", site
        return self.default_phase, site

    def _record(self, func, name, args, kwargs, tensors, out) -> None:
        returns = func._schema.returns
        if name in NOT_KERNELS or (
            returns and all(r.alias_info and not r.alias_info.is_write for r in returns)
        ):
            return  # metadata, allocation or item(): no kernel
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs or all(t.numel() == 0 for t in outputs):
            return
        phase, site = self._phase()
        counts = self.counts[phase]
        if phase == "host":
            counts["host ops"] += 1
            return
        counts["launches"] += 1
        moved = _moved_bytes(name, args, kwargs, tensors, outputs)
        if name.rstrip("_") in GEMMS or name in CPU_ATTENTION:
            # per call site: the roofline is applied to the extrapolated step (predict_terms)
            key = f"gemm|{_precision(tensors)}|{site}"
            counts[f"{key}|flops"] += _gemm_flops(func, name, args, kwargs, out)
            counts[f"{key}|bytes"] += moved
            return
        counts["bytes"] += moved
        if name in ("_to_copy", "copy_") and outputs[0].dtype == torch.float32:
            if any(t.dtype in LOW for t in tensors):
                counts["widening bytes"] += moved
                counts["widening launches"] += 1


def _moved_bytes(name: str, args, kwargs, tensors, outputs) -> int:
    """Bytes read and written by one kernel (module docstring)."""
    written = [kwargs["out"]] if "out" in kwargs else []
    if name in WRITE_ONLY_SELF:
        written.append(args[0])
    if name in SHAPE_ONLY:
        written.append(args[SHAPE_ONLY[name]])
    reads = {id(t): t for t in tensors if not any(t is w for w in written)}
    write_bytes = sum(map(_distinct_bytes, outputs))
    if name.rstrip("_") in SCATTERS:  # the index and the added rows, and those rows of self
        target = args[0]
        others = [t for t in tensors if t is not target]
        added = sum(t.numel() for t in others if t.is_floating_point())
        return sum(map(_distinct_bytes, others)) + 2 * added * target.element_size()
    if name.rstrip("_") in GATHERS:  # reads the selected elements and the index only
        index = [t for t in reads.values() if not t.is_floating_point()]
        return 2 * write_bytes + sum(map(_distinct_bytes, index))
    return sum(map(_distinct_bytes, reads.values())) + write_bytes


def _precision(tensors: list[torch.Tensor]) -> str:
    dtypes = {t.dtype for t in tensors if t.is_floating_point()}
    if dtypes & set(LOW):
        return "bf16 tensor core"
    matmul = torch.backends.cuda.matmul
    return "tf32 tensor core" if getattr(matmul, "fp32_precision", "") == "tf32" else "IEEE float32"


def _gemm_flops(func, name: str, args: tuple, kwargs: dict, out) -> int:
    if name in CPU_ATTENTION:
        q = 1 if name.endswith("backward") else 0  # backward: (grad_out, query, key, value, ...)
        return CPU_ATTENTION[name](*(t.shape for t in args[: q + 3]))
    packet = getattr(aten, name.rstrip("_"))
    tensor_args = args[:2] if func._overloadname == "dtype" else args
    return flop_counter.flop_registry[packet](*tensor_args, out_val=out, **kwargs)


@contextlib.contextmanager
def gpu_code_paths() -> Iterator[None]:
    """The engine's GPU code paths on a CPU: ``bf16_exact`` and ``tensor_cores_active`` without
    their CUDA test, the retained per-unit gradients of a weight in one chunk (their CPU-only
    16 MiB chunking off), onehot rows added in place as on a GPU (``scatters_in_place``), and
    an H200's datasheet rates where the engine prices retained against book-kept weights
    (``clients/unit_cost.py``; it measures them on a GPU). The one place this benchmark reaches
    into the engine; it fails loudly if a name moved."""
    from userdp.clients import ghost, matmul_precision, unit_gradients

    flag = matmul_precision._TENSOR_CORES
    patches = [
        (
            matmul_precision,
            "bf16_exact",
            lambda *ts: flag.get() and all(t.dtype in LOW for t in ts),
        ),
        (ghost, "tensor_cores_active", lambda device: flag.get()),
        (ghost, "device_rates", lambda device: _datasheet_rates()),
        (matmul_precision, "scatters_in_place", lambda total: True),
        (unit_gradients, "RETAINED_CHUNK_ELEMENTS", 1 << 62),
    ]
    saved = []
    for module, attr, value in patches:
        if not hasattr(module, attr):
            raise HarnessUnavailable(f"{module.__name__}.{attr} is gone: update gpu_code_paths")
        saved.append((module, attr, getattr(module, attr)))
        setattr(module, attr, value)
    try:
        yield
    finally:
        for module, attr, value in saved:
            setattr(module, attr, value)


def count_call(fn: Callable[[], Any], default_phase: str) -> dict[str, Counter]:
    with gpu_code_paths(), KernelCounter(default_phase) as counter:
        fn()
    return {phase: Counter(c) for phase, c in counter.counts.items() if phase != "host"}


def _combine(terms: list[tuple[float, dict]]) -> dict[str, Counter]:
    """Σ weight·counts, phase by phase."""
    out: dict[str, Counter] = defaultdict(Counter)
    for weight, counts in terms:
        for phase, row in counts.items():
            for key, value in row.items():
                out[phase][key] += weight * value
    return out


def _checked(totals: dict[str, float]) -> dict[str, float]:
    """The quantities ``--check`` compares: launches, bytes, GEMM FLOPs and bytes."""
    sites = gemm_sites(totals).values()
    out = {"launches": totals.get("launches", 0), "bytes": totals.get("bytes", 0)}
    return {**out, **gemm_flops(totals), "GEMM bytes": sum(moved for _, moved in sites)}


def _totals(phases: dict[str, dict]) -> dict[str, float]:
    total: Counter = Counter()
    for row in phases.values():
        total.update(row)
    return dict(total)


class StepCounter:
    """Counts of one engine's steps: non-private or private (precision set per call)."""

    def __init__(self, api, engine, seq_len: int, vocab: int) -> None:
        self.api, self.engine, self.seq_len, self.vocab = api, engine, seq_len, vocab

    def units(self, n: int, group: int) -> list:
        return _units(self.api, n, group, self.seq_len, self.vocab, 1000 * group + n)

    def count(self, label: str, units: list, budget: int | None = None) -> dict[str, Counter]:
        """One call on ``units`` (micro-batches of ``budget`` padded tokens, default the
        engine's)."""
        engine, saved = self.engine, self.engine.token_budget
        engine.token_budget = budget or saved
        try:
            if label == "non-private":
                return count_call(_non_private(self.api, engine, units), "forward")
            return count_call(lambda: engine.clipped_sum(units, 1.0), "other")
        finally:
            engine.token_budget = saved

    def later_batch_delta(self, label: str) -> dict[str, Counter]:
        """What a step's second micro-batch costs beyond its first (gradient or clipped-sum
        accumulation instead of a first write), from one-example micro-batches."""
        one, two = self.units(1, 1), self.units(2, 1)
        budget = self.seq_len - 1
        return _combine([(1, self.count(label, two, budget)), (-2, self.count(label, one))])

    def step(self, label: str, group: int, per_batch: list[int], count_tokens: int) -> tuple:
        """The step's counts, extrapolated from micro-batches of u1 < u2 units (module
        docstring): Σ_mb (a + b·units) + (micro-batches − 1)·(later-batch delta)."""
        u2 = min(max(per_batch), max(2, count_tokens // (group * (self.seq_len - 1))))
        u1 = max(1, u2 // 2)
        c1 = self.count(label, self.units(u1, group))
        c2 = self.count(label, self.units(u2, group)) if u2 > u1 else c1
        slope = _combine([(1 / max(u2 - u1, 1), c2), (-1 / max(u2 - u1, 1), c1)])
        terms = [(len(per_batch), c1), (sum(per_batch) - u1 * len(per_batch), slope)]
        if len(per_batch) > 1:
            terms.append((len(per_batch) - 1, self.later_batch_delta(label)))
        return _combine(terms), [u1, u2]


def count_shape(api, model: str, seq_len: int, args: argparse.Namespace) -> list[dict]:
    """Counts of one step per run (non-private, ULS G=g, ELS) and precision, extrapolated."""
    config = _config(model, seq_len, "cpu", "vectorized", args)
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed prints its memory use
        engine = api.build_engine(config, _manifest(args.vocab))
    engine.attribution_verified = True  # end_to_end.py's timed calls follow a verifying warm-up
    n_params = sum(p.numel() for p in engine.params.values())
    counter = StepCounter(api, engine, seq_len, args.vocab)
    per_example = max(1, args.tokens_per_step // seq_len)
    rows = []
    runs = [("non-private", 1)] + [(f"uls G={g}", g) for g in args.groups]
    runs += [] if 1 in args.groups else [("els", 1)]
    for label, group in runs:
        full = counter.units(max(1, per_example // group), group)
        prepared = api.prepare_units(full, engine.max_positions)
        batches, oversized = api.pack_units(prepared, engine.token_budget)
        if oversized:
            print(
                f"gpu_cost.py: {model} seq {seq_len} {label}: units over the token budget run "
                "the loop engine, not modelled; skipped",
                file=sys.stderr,
            )
            continue
        per_batch = [len(b) for b in batches]
        for precision, tensor_cores in PRECISIONS.items():
            if label == "non-private" and tensor_cores:
                continue
            engine.tensor_core_matmul = tensor_cores
            started = time.process_time()
            phases, counted = counter.step(label, group, per_batch, args.count_tokens)
            if label != "non-private":  # the clipped sums' one copy to host memory per step
                phases["other"]["host copy bytes"] = 4.0 * n_params
            row = {
                "model": model,
                "seq_len": seq_len,
                "run": label,
                "precision": precision,
                "tokens_per_step": sum((seq_len - 1) * group * u for u in per_batch),
                "micro_batches": len(per_batch),
                "units_per_micro_batch": per_batch,
                "counted_units": counted,
                "phases": {k: dict(v) for k, v in phases.items()},
                "totals": _totals(phases),
            }
            if args.check:  # the whole step counted directly, against the extrapolation
                direct = _totals(counter.count(label, full))
                mine, theirs = _checked(row["totals"]), _checked(direct)
                row["check"] = {k: round(mine.get(k, 0) / v - 1, 4) for k, v in theirs.items() if v}
            row["count_cpu_s"] = round(time.process_time() - started, 1)
            rows.append(row)
            if label == "uls G=1":  # an ELS unit is a G=1 unit: the same op stream
                rows.append({**row, "run": "els"})
    engine.tensor_core_matmul = False
    return rows


# ---- the model of GPU time -------------------------------------------------------------------


def gemm_sites(totals: dict[str, float]) -> dict[tuple[str, str], list[float]]:
    """(precision, call site) -> [FLOPs, bytes] of the GEMMs counted there."""
    sites: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    for key, value in totals.items():
        if key.startswith("gemm|"):
            _, precision, site, what = key.split("|")
            sites[precision, site][what == "bytes"] += value
    return sites


def gemm_flops(totals: dict[str, float]) -> dict[str, float]:
    """GEMM FLOPs per precision."""
    out: Counter = Counter()
    for (precision, _), (flops, _) in gemm_sites(totals).items():
        out[precision] += flops
    return dict(out)


def predict_terms(totals: dict[str, float], device: Device, eff: Efficiency) -> dict[str, float]:
    """Seconds per term of the module docstring's T; the GEMMs of a call site whose bytes take
    longer than their FLOPs (below the roofline's ridge) go to the memory term."""
    peak = {
        "bf16 tensor core": device.bf16_flops * eff.tensor_core,
        "tf32 tensor core": device.tf32_flops * eff.tensor_core,
        "IEEE float32": device.fp32_flops * eff.fp32,
    }
    bandwidth = device.memory_bytes * eff.memory
    terms = dict.fromkeys(peak, 0.0)
    terms["memory"] = totals.get("bytes", 0) / bandwidth
    for (precision, _), (flops, moved) in gemm_sites(totals).items():
        compute, memory = flops / peak[precision], moved / bandwidth
        terms[precision if compute >= memory else "memory"] += max(compute, memory)
    terms["launches"] = totals.get("launches", 0) * eff.launch_s
    terms["host copy"] = totals.get("host copy bytes", 0) / device.host_link_bytes
    return terms


def _lookup(rows: list[dict]) -> dict[tuple, dict]:
    return {(r["model"], r["seq_len"], r["run"], r["precision"]): r for r in rows}


def _seconds(totals: dict[str, float], eff: Efficiency, device: str = "H200") -> float:
    return sum(predict_terms(totals, DEVICES[device], eff).values())


def _profiled(row: dict, what: str, eff: Efficiency) -> float:
    """Predicted H200 seconds of ``what`` (see :data:`H200_PROFILE`) in a counted step."""
    if what == "step":
        return _seconds(row["totals"], eff)
    if what == "widening copies":
        return row["totals"].get("widening bytes", 0) / (_H200.memory_bytes * eff.memory)
    if what in row["phases"]:
        return _seconds(row["phases"][what], eff)
    return predict_terms(row["totals"], _H200, eff)[what]


def _residuals(rows: list[dict], eff: Efficiency, fitted: bool = True) -> list[dict]:
    """log(predicted/measured) of the counted H200 rows (with ``fitted``: those fitted)."""
    counted, out = _lookup(rows), []
    for (model, seq, run, precision), measured in H200_RATIOS.items():
        key, base = (model, seq, run, precision), (model, seq, "non-private", "ieee")
        if key in counted and base in counted:
            predicted = _seconds(counted[base]["totals"], eff) / _seconds(
                counted[key]["totals"], eff
            )
            out.append(
                {
                    "row": f"{model} seq {seq} {run} {precision}: private/non-private",
                    "measured": measured,
                    "predicted": predicted,
                    "residual": math.log(predicted / measured),
                    "fitted": True,
                }
            )
    for model, seq, run, precision, what, measured, is_fitted in H200_PROFILE:
        key = (model, seq, run, precision)
        if key in counted and (is_fitted or not fitted):
            predicted = _profiled(counted[key], what, eff)
            out.append(
                {
                    "row": f"{model} seq {seq} {run} {precision}: {what} GPU s (profile)",
                    "measured": measured,
                    "predicted": predicted,
                    "residual": math.log(predicted / measured),
                    "fitted": is_fitted,
                }
            )
    return out


LAUNCH_SENSITIVITY_US = (0.1, 2.0, 5.0, 10.0, 20.0)


def _fit(rows: list[dict], launch_s: float | None = None) -> tuple[Efficiency, float]:
    """Least squares over the fitted H200 rows in log parameters (``launch_s`` fixed if given);
    the efficiencies and the rms log residual."""
    from scipy.optimize import least_squares

    free = 4 if launch_s is None else 3

    def eff(x):
        return Efficiency(*np.exp(x[:3]), np.exp(x[3]) * 1e-6 if launch_s is None else launch_s)

    fit = least_squares(
        lambda x: [r["residual"] for r in _residuals(rows, eff(x))],
        x0=np.log([0.5, 0.5, 0.5, 5.0][:free]),
        bounds=(np.log([0.01, 0.01, 0.01, 0.05][:free]), np.log([1.0, 1.0, 1.0, 200.0][:free])),
    )
    return eff(fit.x), float(np.sqrt(np.mean(np.square(fit.fun))))


def calibrate(rows: list[dict]) -> dict | None:
    """The fit (:func:`_fit`), every H200 row's residual, and the fit again at fixed per-launch
    times (which term an overhead is put in where the rows do not tell launches from bytes);
    None with fewer counted rows than parameters."""
    if len(_residuals(rows, Efficiency())) < 4:
        return None
    best, rms = _fit(rows)
    sensitivity = []
    for micro_s in LAUNCH_SENSITIVITY_US:
        eff, fixed_rms = _fit(rows, micro_s * 1e-6)
        h200 = [p for p in predictions(rows, eff) if p["device"] == "H200" and p["run"] != "els"]
        sensitivity.append(
            {
                "parameters": {k: round(float(v), 9) for k, v in asdict(eff).items()},
                "rms_log_residual": round(fixed_rms, 4),
                "h200": {
                    f"{p['run']} {p['precision']}": {
                        "ratio": p["predicted_ratio"],
                        "extra_memory_ms": p["extra_terms_ms"]["memory"],
                        "extra_launches_ms": p["extra_terms_ms"]["launches"],
                    }
                    for p in h200
                },
            }
        )
    return {
        "parameters": {k: float(v) for k, v in asdict(best).items()},
        "rms_log_residual": rms,
        "rows": [
            {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}
            for r in _residuals(rows, best, fitted=False)
        ],
        "launch_sensitivity": sensitivity,
    }


def exposed_host_copy(row: dict, device: Device, eff: Efficiency) -> float:
    """Seconds of the sums' copy to host memory not hidden behind the last micro-batch's
    book-keeping: the engine copies ranges of final sums on a side stream while that
    book-keeping runs (``Accumulator.last_pass``); a step's micro-batches are taken as equal."""
    copy = row["totals"].get("host copy bytes", 0) / device.host_link_bytes
    book = row["phases"].get("userdp.bookkeeping")
    last = sum(predict_terms(book, device, eff).values()) / row["micro_batches"] if book else 0.0
    return max(0.0, copy - last)


def predictions(rows: list[dict], eff: Efficiency) -> list[dict]:
    """Per private row and device: the predicted ratio, step times and terms."""
    counted, out = _lookup(rows), []
    for (model, seq, run, precision), row in counted.items():
        base = counted.get((model, seq, "non-private", "ieee"))
        if run == "non-private" or base is None:
            continue
        for name, device in DEVICES.items():
            private = predict_terms(row["totals"], device, eff)
            private["host copy"] = exposed_host_copy(row, device, eff)
            plain = predict_terms(base["totals"], device, eff)
            extra = {k: private[k] - plain[k] for k in private}
            measured = H200_RATIOS.get((model, seq, run, precision)) if name == "H200" else None
            out.append(
                {
                    "model": model,
                    "seq_len": seq,
                    "run": run,
                    "precision": precision,
                    "device": name,
                    "predicted_ratio": round(sum(plain.values()) / sum(private.values()), 3),
                    "measured_ratio": measured,
                    "private_ms": round(1e3 * sum(private.values()), 1),
                    "non_private_ms": round(1e3 * sum(plain.values()), 1),
                    "private_terms_ms": {k: round(1e3 * v, 1) for k, v in private.items()},
                    "extra_terms_ms": {k: round(1e3 * v, 1) for k, v in extra.items()},
                    "dominant_extra": max(extra, key=extra.get),
                }
            )
    return out


def phase_breakdown(rows: list[dict], eff: Efficiency, device: str = "H200") -> list[dict]:
    """Predicted ms per engine phase and term (the profile's view of a step)."""
    out = []
    for row in rows:
        if row["run"] == "els":
            continue
        for phase, totals in sorted(row["phases"].items()):
            terms = predict_terms(totals, DEVICES[device], eff)
            out.append(
                {
                    "model": row["model"],
                    "seq_len": row["seq_len"],
                    "run": row["run"],
                    "precision": row["precision"],
                    "phase": phase,
                    "ms": round(1e3 * sum(terms.values()), 1),
                    "terms_ms": {k: round(1e3 * v, 1) for k, v in terms.items() if v},
                    "launches": round(totals.get("launches", 0)),
                    "widening_ms": round(
                        1e3
                        * totals.get("widening bytes", 0)
                        / (DEVICES[device].memory_bytes * eff.memory),
                        1,
                    ),
                }
            )
    return out


# ---- CLI -------------------------------------------------------------------------------------


def markdown(report: dict) -> str:
    lines = []
    cal = report["calibration"]
    if cal:
        p = cal["parameters"]
        lines += [
            f"Calibration ({cal['source']}): e_tc = {p['tensor_core']:.3f}, e_fp32 = {p['fp32']:.3f}, "
            f"e_mem = {p['memory']:.3f}, t_launch = {1e6 * p['launch_s']:.1f} µs; "
            f"rms log residual {cal['rms_log_residual']:.3f}",
            "",
        ]
        if cal.get("rows"):
            lines += [
                "| H200 row | measured | predicted | log residual | fitted |",
                "|---|---|---|---|---|",
            ]
            lines += [
                f"| {r['row']} | {r['measured']} | {r['predicted']:.3f} | {r['residual']:+.3f} | "
                f"{'yes' if r['fitted'] else 'no (check)'} |"
                for r in cal["rows"]
            ]
            lines.append("")
        if cal.get("launch_sensitivity"):
            runs = list(cal["launch_sensitivity"][0]["h200"])
            lines += [
                "| t_launch fixed (µs) | e_tc | e_fp32 | e_mem | rms | "
                + " | ".join(f"{r}: ratio, extra memory / launches ms" for r in runs)
                + " |",
                "|---|---|---|---|---|" + "---|" * len(runs),
            ]
            for fit in cal["launch_sensitivity"]:
                q, h = fit["parameters"], fit["h200"]
                cells = [
                    f"{h[r]['ratio']:.0%}, {h[r]['extra_memory_ms']} / {h[r]['extra_launches_ms']}"
                    for r in runs
                ]
                lines.append(
                    f"| {1e6 * q['launch_s']:.1f} | {q['tensor_core']:.3f} | {q['fp32']:.3f} | "
                    f"{q['memory']:.3f} | {fit['rms_log_residual']:.3f} | "
                    + " | ".join(cells)
                    + " |"
                )
            lines.append("")
    lines += [
        "| model | seq | run | precision | device | predicted | measured | private ms | non-private ms | extra ms: bf16 TC / fp32 / memory / launches / host | dominant extra |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["predictions"]:
        e = r["extra_terms_ms"]
        measured = "" if r["measured_ratio"] is None else f"{r['measured_ratio']:.0%}"
        lines.append(
            f"| {r['model']} | {r['seq_len']} | {r['run']} | {r['precision']} | {r['device']} | "
            f"{r['predicted_ratio']:.0%} | {measured} | {r['private_ms']} | {r['non_private_ms']} | "
            f"{e['bf16 tensor core']} / {e['IEEE float32']} / {e['memory']} / {e['launches']} / "
            f"{e['host copy']} | {r['dominant_extra']} |"
        )
    lines += [
        "",
        "| model | seq | run | precision | bf16 TC TFLOP | fp32 TFLOP | GB moved | widening GB | launches | counted units | check | count CPU s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["counts"]:
        t = r["totals"]
        flops = gemm_flops(t)
        lines.append(
            f"| {r['model']} | {r['seq_len']} | {r['run']} | {r['precision']} | "
            f"{flops.get('bf16 tensor core', 0) / 1e12:.2f} | {flops.get('IEEE float32', 0) / 1e12:.2f} | "
            f"{t.get('bytes', 0) / 1e9:.1f} | {t.get('widening bytes', 0) / 1e9:.1f} | "
            f"{t.get('launches', 0):.0f} | {r['counted_units']} | {r.get('check', '')} | {r['count_cpu_s']} |"
        )
    lines += [
        "",
        "| model | seq | run | precision | phase (H200) | ms | launches | widening ms | terms ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["phases"]:
        lines.append(
            f"| {r['model']} | {r['seq_len']} | {r['run']} | {r['precision']} | {r['phase']} | "
            f"{r['ms']} | {r['launches']} | {r['widening_ms']} | {r['terms_ms']} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="gpt2-tiny, seq 64, 512 tokens, --check"
    )
    parser.add_argument("--models", nargs="+", default=["gpt2-small"])
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[128])
    parser.add_argument("--groups", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--tokens-per-step", type=int, default=65_536)
    parser.add_argument("--token-budget", type=int, default=16_384)
    parser.add_argument(
        "--count-tokens",
        type=int,
        default=1024,
        help="tokens of the larger counted micro-batch (the smaller has half the units)",
    )
    parser.add_argument("--check", action="store_true", help="also count the whole step directly")
    parser.add_argument("--vocab", type=int, default=GPT2_VOCAB)
    parser.add_argument(
        "--calibration",
        type=Path,
        default=RESULTS / "cpu-2c-gpu_cost.json",
        help="results JSON whose fit is used when no H200 row is counted",
    )
    parser.add_argument(
        "--keep-calibration",
        action="store_true",
        help="use --calibration's fit even where H200 rows are counted: the predictions for a "
        "changed engine, with the fit of the engine those H200 rows measured",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.seq_lens, args.groups = ["gpt2-tiny"], [64], [1, 2]
        args.tokens_per_step, args.token_budget, args.count_tokens, args.check = 512, 256, 128, True
    # the fields end_to_end.py's config builder reads
    args.dtype, args.zero_stage, args.probes, args.tensor_core_matmul = "bf16", 0, 32, False
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        api = _load_engine_api()
    except HarnessUnavailable as exc:
        print(f"gpu_cost.py: {exc}", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    started = time.time()
    rows = [r for m in args.models for s in args.seq_lens for r in count_shape(api, m, s, args)]
    calibration = None if args.keep_calibration else calibrate(rows)
    if calibration is not None:
        calibration["source"] = "fitted to the H200 rows counted in this run"
    elif args.calibration.exists():
        calibration = json.loads(args.calibration.read_text())["calibration"]
        calibration = {
            "source": f"read from {args.calibration.name}",
            "parameters": calibration["parameters"],
            "rms_log_residual": calibration["rms_log_residual"],
        }
    eff = Efficiency(**calibration["parameters"]) if calibration else Efficiency()
    report = {
        "benchmark": "gpu_cost",
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (counting only)",
        "torch": torch.__version__,
        "settings": {
            k: getattr(args, k)
            for k in (
                "models",
                "seq_lens",
                "groups",
                "tokens_per_step",
                "token_budget",
                "count_tokens",
                "check",
            )
        },
        "devices": {k: asdict(v) for k, v in DEVICES.items()},
        "calibration": calibration,
        "predictions": predictions(rows, eff),
        "phases": phase_breakdown(rows, eff),
        "counts": rows,
        "wall_s": round(time.time() - started, 1),
    }
    print(json.dumps(report, indent=2, default=float))
    print()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
