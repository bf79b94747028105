"""Benchmark the worker's clipping engines against a non-private step on the same tokens, with
Opacus as the per-example anchor.

For one token set (``--users`` units of ``--group-size`` random examples of ``--seq-len`` tokens,
byte vocabulary) it times and measures peak memory of:

- ``nonprivate``: plain forward + backward of Σ_u loss_u (same loss, same token-budget
  micro-batches), gradients accumulated in ``.grad`` — the cost DP is compared with;
- ``loop`` / ``vectorized`` / ``randomized`` (k = ``--probes``): ``ClippingEngine.clipped_sum``,
  for ULS (a unit = a user's G examples) and ELS (a unit = one example; same tokens);
- ELS only, the Opacus anchor (``benchmarks/opacus_anchor.py``): ``opacus-hooks`` (per-example
  gradients, then DPOptimizer's clipping) and ``opacus-ghost`` (ghost clipping), each the sum
  Σ_i clip(∇ loss_i, C) on the same model, tokens and micro-batches, before noise. Before timing,
  the anchor's clipped sum is checked against ``loop`` and ``vectorized``; the result and how
  Opacus handled each layer are in the rows. Without Opacus installed (the ``bench`` extra)
  these rows say skipped;
- long sequences (``--long-seq``, default 1024): ``vectorized`` vs ``randomized`` peak memory.

Timing: one child process per token set runs every mode on the same model and tokens,
INTERLEAVED round by round (a shared machine drifts), after one warm-up call each; the time is
the fastest of ``--repeat`` rounds. Every child applies the allocator settings ``userdp worker``
runs with (``proto/allocator.py``: freed memory is kept for reuse, not returned to the OS and
faulted in again by the next call). Memory: one child process per mode (so the peak is its own),
one call after a warm-up; peak = RSS sampled every 2 ms above the RSS just before the call (CPU),
or ``torch.cuda.max_memory_allocated`` above the allocation before it (GPU). Prints JSON, then a
markdown table, then the anchor's agreement and layer notes. ``--profile`` adds, per token set
and mode, one call under ``torch.profiler`` after the timed rounds (not timed): the top ops by
self time, with the engines' phases (``userdp.forward``, ``userdp.output_backward``,
``userdp.norms``, ``userdp.bookkeeping``), to stderr.

    .venv/bin/python benchmarks/worker.py                   # GPT-2-small, 64 users, G=8, seq 128
    .venv/bin/python benchmarks/worker.py --quick           # gpt2-tiny, 16 users, G=4, seq 64
    .venv/bin/python benchmarks/worker.py --preset gpt2-small --users 4 --group-size 4
    .venv/bin/python benchmarks/worker.py --preset llama-small --lora-rank 0,8   # Llama-shaped
    .venv/bin/python benchmarks/worker.py --quick --skip-long --profile 2> profile.txt

``--preset llama-small`` is Llama-shaped near GPT-2 small's size (12 layers, 768 wide, RMSNorm,
SwiGLU, grouped-query attention, untied head); ``--lora-rank 0,8`` measures full fine-tuning and
LoRA (rank 8, PEFT's default targets) as separate cases. ``opacus-hooks`` holds every example's
gradient of a micro-batch at once (GPT-2 small: 0.34 GB per example in fp32);
``--opacus-batch N`` gives Opacus at most N examples per backward (BatchMemoryManager's
physical batches) where that does not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from opacus_anchor import (  # benchmarks/opacus_anchor.py: this script's folder is on sys.path
    OPACUS_MODES,
    OpacusAnchor,
    anchor_note,
    check_agreement,
    opacus_failure,
    opacus_missing,
)

VOCAB = 259  # the byte tokenizer


def make_units(users: int, group_size: int, seq_len: int, unit: str, seed: int = 0):
    from userdp.clients.engine import Unit

    rng = np.random.default_rng(seed)
    examples = [[rng.integers(3, VOCAB, seq_len) for _ in range(group_size)] for _ in range(users)]
    if unit == "user":
        return [Unit(f"user{u}", ex) for u, ex in enumerate(examples)]
    return [Unit(f"user{u}/{i}", [e]) for u, ex in enumerate(examples) for i, e in enumerate(ex)]


class PeakRss:
    """Background sampler of this process's RSS (bytes)."""

    def __init__(self, interval_s: float = 0.002) -> None:
        import psutil

        self.process = psutil.Process()
        self.interval_s = interval_s
        self.peak = self.base = self.process.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


def nonprivate_step(module, units, token_budget: int) -> None:
    """Σ_u loss_u forward + backward, micro-batched exactly like the engines."""
    from userdp.clients.batching import make_batch, pack_units, prepare_units, token_losses

    prepared = prepare_units(units, None)
    batches, oversized = pack_units(prepared, token_budget)
    device = next(module.parameters()).device
    for batch_units in batches + [[i] for i in oversized]:
        batch = make_batch(prepared, batch_units, device, 0)
        (token_losses(module, batch) * batch.weights).sum().backward()
    module.zero_grad(set_to_none=True)


def _setup(spec: dict):
    import torch
    from userdp.clients.engine import ClippingEngine
    from userdp.clients.model import ModelShape, build_model
    from userdp.proto.allocator import keep_freed_memory

    keep_freed_memory()  # the allocator settings `userdp worker` runs with

    torch.set_num_threads(spec["threads"])
    from userdp.config import ModelConfig

    config = ModelConfig(preset=spec["preset"], dtype=spec["dtype"], lora_rank=spec["lora_rank"])
    module = build_model(config, ModelShape(VOCAB, spec["seq_len"], 0, 1), 0)
    device = torch.device(spec["device"])
    module.to(device)
    units = make_units(spec["users"], spec["group_size"], spec["seq_len"], spec["unit"])
    warm = make_units(1, 1, min(spec["seq_len"], 16), "user", seed=1)

    def runner(mode: str):
        """A call of ``mode`` on units (at clip norm C, default 1, for the DP modes)."""
        if mode == "nonprivate":
            return lambda batch: nonprivate_step(module, batch, spec["token_budget"])
        if mode in OPACUS_MODES:
            return OpacusAnchor(module, mode, spec["token_budget"], spec.get("opacus_batch", 0))
        engine = ClippingEngine(
            module, engine=mode, probes=spec["probes"], token_budget=spec["token_budget"]
        )
        return lambda batch, clip_norm=1.0: engine.clipped_sum(batch, clip_norm)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    return torch, device, units, warm, runner, sync


def child_memory(spec: dict) -> dict:
    """Peak memory of one mode (its own process, one call after a warm-up)."""
    torch, device, units, warm, runner, sync = _setup(spec)
    run = runner(spec["mode"])
    run(warm)
    if device.type == "cuda":
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        run(units)
        sync()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with PeakRss() as rss:
            run(units)
        peak = rss.peak - rss.base
    return {"peak_mb": peak / 1e6}


def child_timing(spec: dict) -> dict:
    """Seconds per mode, modes INTERLEAVED round by round, fastest of ``repeat`` rounds; for the
    Opacus modes also their agreement with the exact engines (checked before timing), how they
    handled each layer, or the error that stopped them (that mode is then not timed)."""
    _, _, units, warm, runner, sync = _setup(spec)
    runs, errors = {}, {}
    for mode in spec["modes"]:
        try:
            runs[mode] = runner(mode)
            runs[mode](warm)
        except Exception as exc:  # noqa: BLE001 - an anchor that cannot run is reported in its row
            if mode not in OPACUS_MODES:
                raise
            runs.pop(mode, None)
            errors[mode] = opacus_failure(exc)
    agreement = {}
    if any(mode in OPACUS_MODES for mode in runs):
        agreement = check_agreement(runner, runs, units, spec["dtype"])
    for mode, failure in [(m, a["error"]) for m, a in agreement.items() if "error" in a]:
        runs.pop(mode)
        errors[mode] = failure
    anchors = [mode for mode in OPACUS_MODES if mode in runs]
    best = {mode: float("inf") for mode in runs}
    for _ in range(spec["repeat"]):
        for mode, run in runs.items():
            sync()
            started = time.perf_counter()
            run(units)
            sync()
            best[mode] = min(best[mode], time.perf_counter() - started)
    tokens = sum(len(e) - 1 for u in units for e in u.examples)
    if spec.get("profile"):
        for mode, run in runs.items():
            profile_call(
                lambda run=run: run(units), sync, f"{spec['unit']} {mode}", spec["profile"]
            )
    layers = {mode: runs[mode].layers for mode in anchors}
    return {
        "seconds": best,
        "tokens": tokens,
        "errors": errors,
        "agreement": agreement,
        "layers": layers,
    }


def profile_call(call, sync, title: str, rows: int) -> None:
    """One call under torch.profiler (CPU activity, plus CUDA when visible): the ``rows`` ops
    with the most self time, then the engines' phases (``userdp.*`` ranges), to stderr."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities) as prof:
        call()
        sync()
    table = prof.key_averages()
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(f"\n## profile: {title}", file=sys.stderr)
    print(table.table(sort_by=key, row_limit=rows, max_name_column_width=60), file=sys.stderr)
    phases = [e for e in table if e.key.startswith("userdp.")]
    for event in sorted(phases, key=lambda e: e.key):
        print(
            f"{event.key}: {event.cpu_time_total / 1e3:.1f} ms total, {event.count} calls",
            file=sys.stderr,
        )


def measure(kind: str, spec: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", kind, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"measurement {kind} {spec} failed:\n{out.stderr[-4000:]}")
    if spec.get("profile"):
        print(out.stderr, file=sys.stderr, end="")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_case(
    case: str, spec: dict, modes: list[str], anchors: Sequence[str] = ()
) -> list[dict]:
    """Rows for one token set: non-private first, then ``modes``, then the Opacus ``anchors``
    (timed in the same rounds), with ratios to non-private. An anchor that could not run has
    ``seconds`` None and a ``note`` saying why; one that ran has ``agreement`` and ``layers``."""
    missing = opacus_missing() if anchors else None
    all_modes = ["nonprivate", *modes, *anchors]
    timed = all_modes if missing is None else ["nonprivate", *modes]
    timing = measure("timing", {**spec, "modes": timed})
    rows = []
    for mode in all_modes:
        row = {"case": case, **spec, "mode": mode, "tokens": timing["tokens"]}
        note = missing if mode in anchors else None
        note = timing.get("errors", {}).get(mode, note)
        if note is not None:
            row.update(seconds=None, peak_mb=None, note=note)
            rows.append(row)
            continue
        memory = measure("memory", {**spec, "mode": mode, "profile": 0})
        row.update(seconds=timing["seconds"][mode], peak_mb=memory["peak_mb"])
        if mode in anchors:
            row.update(agreement=timing["agreement"][mode], layers=timing["layers"][mode])
        rows.append(row)
    for row in rows:
        timed_row = row["seconds"] is not None
        row["time_ratio"] = row["seconds"] / rows[0]["seconds"] if timed_row else None
        row["memory_ratio"] = row["peak_mb"] / max(rows[0]["peak_mb"], 1e-9) if timed_row else None
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="gpt2-tiny, 16 users, G=4, seq 64")
    parser.add_argument(
        "--preset",
        default=None,
        choices=["gpt2-tiny", "gpt2-small", "llama-tiny", "llama-small"],
    )
    parser.add_argument(
        "--lora-rank", default="0", help="comma-separated LoRA ranks, one case each (0 = full)"
    )
    parser.add_argument("--users", type=int, default=None)
    parser.add_argument("--group-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--long-seq", type=int, default=1024)
    parser.add_argument("--long-users", type=int, default=2)
    parser.add_argument("--probes", type=int, default=32)
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--engines", default="loop,vectorized,randomized")
    parser.add_argument("--skip-els", action="store_true")
    parser.add_argument("--skip-long", action="store_true")
    parser.add_argument(
        "--skip-opacus", action="store_true", help="no Opacus anchor rows (per-example case)"
    )
    parser.add_argument(
        "--opacus-batch",
        type=int,
        default=0,
        metavar="N",
        help="at most N examples per Opacus backward (0: the engines' micro-batches)",
    )
    parser.add_argument("--repeat", type=int, default=3, help="timed rounds; the fastest is kept")
    parser.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=25,
        default=0,
        metavar="ROWS",
        help="after the timed rounds, profile one call per mode: top ROWS ops (default 25), stderr",
    )
    args = parser.parse_args()
    if args.child:
        kind, spec = args.child
        run = child_timing if kind == "timing" else child_memory
        print(json.dumps(run(json.loads(spec))))
        return 0

    quick = args.quick
    base = {
        "preset": args.preset or ("gpt2-tiny" if quick else "gpt2-small"),
        "users": args.users or (16 if quick else 64),
        "group_size": args.group_size or (4 if quick else 8),
        "seq_len": args.seq_len or (64 if quick else 128),
        "probes": args.probes,
        "token_budget": args.token_budget,
        "device": args.device,
        "dtype": args.dtype,
        "threads": os.cpu_count() or 1,
        "unit": "user",
        "repeat": args.repeat,
        "profile": args.profile,
    }
    engines = [e for e in args.engines.split(",") if e]
    rows = []
    for rank in [int(r) for r in args.lora_rank.split(",") if r]:
        ranked = {**base, "lora_rank": rank}
        rows += measure_case("user step", ranked, engines)
        if not args.skip_els:
            anchors = () if args.skip_opacus else OPACUS_MODES
            example = {**ranked, "unit": "example"}
            if anchors:
                example["opacus_batch"] = args.opacus_batch
            rows += measure_case("example step", example, engines, anchors)
        if not args.skip_long:
            long = {**ranked, "seq_len": args.long_seq, "users": args.long_users, "group_size": 2}
            long["token_budget"] = max(args.token_budget, 2 * args.long_seq)
            rows += measure_case("long seq", long, ["vectorized", "randomized"])
    result = {
        "benchmark": "worker clipping engines",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, device {args.device}",
        "rows": rows,
    }
    print(json.dumps(result, indent=2))
    print()
    print(
        "| case | preset | LoRA | unit | users×G×seq | mode | tokens | s | × non-private "
        "| peak MB | memory × |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        shape = f"{r['users']}×{r['group_size']}×{r['seq_len']}"
        mode = r["mode"] + (f" (k={r['probes']})" if r["mode"] == "randomized" else "")
        lora = f"r={r['lora_rank']}" if r["lora_rank"] else "full"
        figures = (
            ("seconds", ".2f"),
            ("time_ratio", ".2f"),
            ("peak_mb", ".0f"),
            ("memory_ratio", ".2f"),
        )
        cells = " | ".join("—" if r[k] is None else format(r[k], f) for k, f in figures)
        print(
            f"| {r['case']} | {r['preset']} | {lora} | {r['unit']} | {shape} | {mode} | "
            f"{r['tokens']} | {cells} |"
        )
    notes = [anchor_note(r) for r in rows if r["mode"] in OPACUS_MODES]
    if notes:
        print("\nOpacus anchors (same model, tokens and micro-batches; timed in the same rounds):")
        print("\n".join(notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
