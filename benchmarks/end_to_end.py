"""End-to-end worker throughput: userdp's clipped sums next to a non-private baseline.

For each model shape (GPT-2 small 124M / medium 355M presets, random init, bf16) and sequence
length, one run measures, on the SAME DeepSpeed-wrapped module built by
``userdp.clients.engine.build_engine``:

* ``non-private``: the plain gradient of the same tokens (same micro-batches of
  ``--token-budget`` padded tokens, the same weighted next-token loss), one backward per
  micro-batch through the DeepSpeed engine (``engine.backward``), no per-unit work;
* ``uls G=g``: ``ClippingEngine.clipped_sum`` over users of g examples each (g ∈ ``--groups``);
* ``els``: ``clipped_sum`` over single-example units (example-level DP);
* ``--rc-seq-len`` (default 4096, GPT-2 small): the randomized-clipping engine
  (Hutchinson, ``--probes``) against the exact (``vectorized``) engine: time and peak memory.

Every row reports tokens/s (predicted tokens per second, median over ``--repeats`` timed calls
after one warm-up call), peak GPU memory (``torch.cuda.max_memory_allocated``) and the ratio to
the non-private tokens/s of the same shape. Goals: ULS ≥ 85 %, ELS ≥ 70 % of non-private.

    .venv/bin/python benchmarks/end_to_end.py                  # GPU: the full grid
    .venv/bin/python benchmarks/end_to_end.py --quick          # GPU: GPT-2 small, seq 128 only
    .venv/bin/python benchmarks/end_to_end.py --device cpu --models gpt2-tiny --seq-lens 64 \\
        --groups 1 4 --tokens-per-step 2048 --rc-seq-len 0     # CPU smoke test of the harness

Needs ``userdp.clients.engine.build_engine`` (the worker engine); without it, or without a CUDA
device for ``--device cuda``, it exits with status 2 and says why. Prints JSON, then a markdown
table.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

GPT2_VOCAB = 50257
GOALS = {"uls": 0.85, "els": 0.70}


class HarnessUnavailable(RuntimeError):
    """The harness cannot run here (no engine module, no CUDA device); the message says why."""


def _load_engine_api() -> SimpleNamespace:
    try:
        from userdp.clients import engine as engine_module
        from userdp.clients.batching import make_batch, pack_units, prepare_units, token_losses
    except ImportError as exc:
        raise HarnessUnavailable(
            f"userdp.clients.engine.build_engine is not importable ({exc}); this benchmark "
            "measures the worker engine and needs it (clients/engine.py)"
        ) from None
    if not hasattr(engine_module, "build_engine"):
        raise HarnessUnavailable("userdp.clients.engine has no build_engine; update the checkout")
    return SimpleNamespace(
        build_engine=engine_module.build_engine,
        Unit=engine_module.Unit,
        make_batch=make_batch,
        pack_units=pack_units,
        prepare_units=prepare_units,
        token_losses=token_losses,
    )


def _manifest(vocab_size: int) -> SimpleNamespace:
    """The two manifest fields the model builder reads (a GPT-2-sized vocabulary)."""
    return SimpleNamespace(
        tokenizer=SimpleNamespace(vocab_size=vocab_size, pad_id=0, eos_id=vocab_size - 1)
    )


def _config(model: str, seq_len: int, device: str, engine: str, args: argparse.Namespace):
    from userdp.config import Config, DataConfig, ModelConfig, StrategyConfig, WorkersConfig

    return Config(
        data=DataConfig(seq_len=seq_len),
        model=ModelConfig(preset=model, dtype=args.dtype, zero_stage=args.zero_stage),
        strategy=StrategyConfig(engine=engine, probes=args.probes),
        workers=WorkersConfig(
            device=device,
            token_budget=args.token_budget,
            tensor_core_matmul=args.tensor_core_matmul,
        ),
    )


def _units(api, n_units: int, per_unit: int, seq_len: int, vocab: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    return [
        api.Unit(
            f"u{i}",
            [rng.integers(1, vocab, size=seq_len, dtype=np.int64) for _ in range(per_unit)],
        )
        for i in range(n_units)
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _measure(
    fn: Callable[[], Any], device: torch.device, repeats: int
) -> tuple[float, float | None]:
    """(median seconds over ``repeats`` calls after one warm-up, peak GPU memory GB of the
    calls; None on CPU)."""
    fn()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None
    return statistics.median(times), peak


def baseline_backward(engine) -> str:
    """How the non-private baseline runs backward: DeepSpeed's ``engine.backward`` (its
    gradient hooks, ZeRO reduction) when the DeepSpeed engine has an optimizer (ZeRO ≥ 1 in
    userdp's wrapper), else torch's backward on the same DeepSpeed-wrapped module (ZeRO 0:
    DeepSpeed refuses ``backward`` without an optimizer; nothing is reduced in one process)."""
    ds = engine.deepspeed_engine
    if ds is not None and getattr(ds, "optimizer", None) is not None:
        return "deepspeed engine.backward"
    return "torch backward on the DeepSpeed module" if ds is not None else "torch backward"


def _measure_or_oom(
    fn: Callable[[], Any], device: torch.device, repeats: int
) -> tuple[float | None, float | None, str | None]:
    """:func:`_measure`, but a CUDA out-of-memory error becomes a row, not a crash."""
    try:
        seconds, peak = _measure(fn, device, repeats)
    except torch.cuda.OutOfMemoryError:
        gc.collect()
        torch.cuda.empty_cache()
        return None, None, "CUDA out of memory"
    return seconds, peak, None


def profile(fn: Callable[[], Any], device: torch.device, title: str, rows: int = 30) -> None:
    """One call of ``fn`` (after a warm-up) under torch.profiler: the top ops by device time
    and by host time, to stderr (``--profile``)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        fn()
        _sync(device)
    table = prof.key_averages()
    device_key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"\n## profile: {title}", file=sys.stderr)
    for key in (device_key, "cpu_time_total"):
        print(table.table(sort_by=key, row_limit=rows, max_name_column_width=90), file=sys.stderr)


def _non_private(api, engine, units: list) -> Callable[[], None]:
    """The same tokens' plain gradient through the same module/DeepSpeed engine."""
    module = engine.module
    ds = engine.deepspeed_engine if baseline_backward(engine).startswith("deepspeed") else None
    prepared = api.prepare_units(units, engine.max_positions)
    batches, oversized = api.pack_units(prepared, engine.token_budget)
    batches += [[i] for i in oversized]  # baseline: an oversized unit is one (bigger) batch

    def step() -> None:
        for indices in batches:
            batch = api.make_batch(prepared, indices, engine.device, engine.pad_id)
            loss = (api.token_losses(module, batch) * batch.weights).sum()
            if ds is not None:
                ds.backward(loss)
            else:
                loss.backward()
        module.zero_grad(set_to_none=True)

    return step


def _tokens(units: list) -> int:
    return sum(len(e) - 1 for u in units for e in u.examples)


def run_shape(api, model: str, seq_len: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    config = _config(model, seq_len, args.device, "vectorized", args)
    engine = api.build_engine(config, _manifest(args.vocab))
    n_params = sum(p.numel() for p in engine.params.values())
    rows: list[dict[str, Any]] = []

    def row(label: str, units: list, fn: Callable[[], Any], baseline: float | None) -> float | None:
        if args.profile and label.startswith(tuple(args.profile)):
            profile(fn, device, f"{model} seq {seq_len} {label}")
        seconds, peak, error = _measure_or_oom(fn, device, args.repeats)
        tokens = _tokens(units)
        rate = None if seconds is None else tokens / seconds
        rows.append(
            {
                "model": model,
                "params_m": round(n_params / 1e6, 1),
                "seq_len": seq_len,
                "run": label,
                "units": len(units),
                "tokens_per_step": tokens,
                "seconds": None if seconds is None else round(seconds, 4),
                "tokens_per_s": None if rate is None else round(rate, 1),
                "peak_mem_gb": None if peak is None else round(peak, 3),
                "vs_non_private": None if not (rate and baseline) else round(rate / baseline, 3),
                "baseline_backward": baseline_backward(engine) if label == "non-private" else None,
                "error": error,
            }
        )
        return rate

    tokens_per_step = args.tokens_per_step
    per_example = max(1, tokens_per_step // seq_len)
    baseline_units = _units(api, per_example, 1, seq_len, args.vocab, 0)
    base = row("non-private", baseline_units, _non_private(api, engine, baseline_units), None)
    for group in args.groups:
        units = _units(api, max(1, per_example // group), group, seq_len, args.vocab, group)
        row(f"uls G={group}", units, lambda u=units: engine.clipped_sum(u, 1.0), base)
    units = _units(api, per_example, 1, seq_len, args.vocab, 7)
    row("els (per-example)", units, lambda: engine.clipped_sum(units, 1.0), base)
    return rows  # the engine goes out of scope here; the caller frees the GPU cache


def run_randomized(api, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Randomized (Hutchinson) vs exact clipping at a long sequence: time and peak memory."""
    device, seq_len, model = torch.device(args.device), args.rc_seq_len, args.rc_model
    rows = []
    for name in ("vectorized", "randomized"):
        engine = api.build_engine(
            _config(model, seq_len, args.device, name, args), _manifest(args.vocab)
        )
        units = _units(api, args.rc_units, 1, seq_len, args.vocab, 11)
        seconds, peak, error = _measure_or_oom(
            lambda e=engine, u=units: e.clipped_sum(u, 1.0), device, args.repeats
        )
        label = "exact (vectorized)" if name == "vectorized" else f"randomized k={args.probes}"
        rows.append(
            {
                "model": model,
                "seq_len": seq_len,
                "run": label,
                "units": len(units),
                "tokens_per_step": _tokens(units),
                "seconds": None if seconds is None else round(seconds, 4),
                "tokens_per_s": None if seconds is None else round(_tokens(units) / seconds, 1),
                "peak_mem_gb": None if peak is None else round(peak, 3),
                "error": error,
            }
        )
        del engine
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | seq | run | units | tokens/step | s/step | tokens/s | peak GB | vs non-private | goal |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        kind = "uls" if r["run"].startswith("uls") else "els" if r["run"].startswith("els") else ""
        goal = f"≥ {GOALS[kind]:.0%}" if kind else ""
        ratio = r.get("vs_non_private")
        rate = r["error"] if r.get("error") else f"{r['tokens_per_s']:.0f}"
        lines.append(
            f"| {r['model']} | {r['seq_len']} | {r['run']} | {r['units']} | "
            f"{r['tokens_per_step']} | {r['seconds'] or ''} | {rate} | "
            f"{'' if r['peak_mem_gb'] is None else r['peak_mem_gb']} | "
            f"{'' if ratio is None else f'{ratio:.0%}'} | {goal} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="GPT-2 small, seq 128, no RC row")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--models", nargs="+", default=["gpt2-small", "gpt2-medium"])
    parser.add_argument("--seq-lens", nargs="+", type=int, default=[128, 1024])
    parser.add_argument("--groups", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--tokens-per-step", type=int, default=65_536)
    parser.add_argument("--token-budget", type=int, default=16_384)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--zero-stage", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--probes", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=GPT2_VOCAB)
    parser.add_argument("--rc-seq-len", type=int, default=4096, help="0 = skip the RC row")
    parser.add_argument("--rc-model", default="gpt2-small")
    parser.add_argument("--rc-units", type=int, default=4)
    parser.add_argument(
        "--tensor-core-matmul",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="workers.tensor_core_matmul (default on): bf16 tensor-core GEMMs for norms and "
        "book-keeping, clipped by the proven rounding bound; --no-tensor-core-matmul: IEEE float32",
    )
    parser.add_argument(
        "--profile",
        nargs="+",
        default=None,
        metavar="RUN",
        help="profile one call of the runs whose label starts with RUN (e.g. 'uls G=8' els "
        "non-private): top ops by device and host time, to stderr",
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.seq_lens, args.rc_seq_len = ["gpt2-small"], [128], 0
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.device == "cuda" and not torch.cuda.is_available():
            raise HarnessUnavailable(
                "no CUDA device is visible: the end-to-end benchmark is a GPU benchmark "
                "(use --device cpu with a tiny model only to smoke-test the harness)"
            )
        api = _load_engine_api()
    except HarnessUnavailable as exc:
        print(f"end_to_end.py: {exc}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    for model in args.models:
        for seq_len in args.seq_lens:
            rows.extend(run_shape(api, model, seq_len, args))
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
    rc_rows = run_randomized(api, args) if args.rc_seq_len else []
    device_name = (
        torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    )
    report = {
        "benchmark": "end_to_end",
        "device": device_name,
        "torch": torch.__version__,
        "dtype": args.dtype,
        "zero_stage": args.zero_stage,
        "token_budget": args.token_budget,
        "tensor_core_matmul": args.tensor_core_matmul,
        "rows": rows,
        "randomized_clipping": rc_rows,
    }
    print(json.dumps(report, indent=2))
    print()
    print(markdown(rows))
    if rc_rows:
        print()
        print(markdown([{**r, "vs_non_private": None} for r in rc_rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
