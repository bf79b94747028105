"""Benchmark the worker's clipping engines against a non-private step on the same tokens.

For one token set (``--users`` units of ``--group-size`` random examples of ``--seq-len`` tokens,
byte vocabulary) it times and measures peak memory of:

- ``nonprivate``: plain forward + backward of Σ_u loss_u (same loss, same token-budget
  micro-batches), gradients accumulated in ``.grad`` — the cost DP is compared with;
- ``loop`` / ``vectorized`` / ``randomized`` (k = ``--probes``): ``ClippingEngine.clipped_sum``,
  for ULS (a unit = a user's G examples) and ELS (a unit = one example; same tokens);
- long sequences (``--long-seq``, default 1024): ``vectorized`` vs ``randomized`` peak memory.

Timing: one child process per token set runs every mode on the same model and tokens,
INTERLEAVED round by round (a shared machine drifts), after one warm-up call each; the time is
the fastest of ``--repeat`` rounds. Memory: one child process per mode (so the peak is its own),
one call after a warm-up; peak = RSS sampled every 2 ms above the RSS just before the call (CPU),
or ``torch.cuda.max_memory_allocated`` above the allocation before it (GPU). Prints JSON, then a
markdown table. ``--profile`` adds, per token set and mode, one call under ``torch.profiler``
after the timed rounds (not timed): the top ops by self time, with the engines' phases
(``userdp.forward``, ``userdp.output_backward``, ``userdp.norms``, ``userdp.bookkeeping``), to
stderr.

    .venv/bin/python benchmarks/worker.py                   # GPT-2-small, 64 users, G=8, seq 128
    .venv/bin/python benchmarks/worker.py --quick           # gpt2-tiny, 16 users, G=4, seq 64
    .venv/bin/python benchmarks/worker.py --preset gpt2-small --users 4 --group-size 4
    .venv/bin/python benchmarks/worker.py --preset llama-small --lora-rank 0,8   # Llama-shaped
    .venv/bin/python benchmarks/worker.py --quick --skip-long --profile 2> profile.txt

``--preset llama-small`` is Llama-shaped near GPT-2 small's size (12 layers, 768 wide, RMSNorm,
SwiGLU, grouped-query attention, untied head); ``--lora-rank 0,8`` measures full fine-tuning and
LoRA (rank 8, PEFT's default targets) as separate cases.
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
from pathlib import Path

import numpy as np

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

    torch.set_num_threads(spec["threads"])
    from userdp.config import ModelConfig

    config = ModelConfig(preset=spec["preset"], dtype=spec["dtype"], lora_rank=spec["lora_rank"])
    module = build_model(config, ModelShape(VOCAB, spec["seq_len"], 0, 1), 0)
    device = torch.device(spec["device"])
    module.to(device)
    units = make_units(spec["users"], spec["group_size"], spec["seq_len"], spec["unit"])
    warm = make_units(1, 1, min(spec["seq_len"], 16), "user", seed=1)

    def runner(mode: str):
        if mode == "nonprivate":
            return lambda batch: nonprivate_step(module, batch, spec["token_budget"])
        engine = ClippingEngine(
            module, engine=mode, probes=spec["probes"], token_budget=spec["token_budget"]
        )
        return lambda batch: engine.clipped_sum(batch, 1.0)

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
    """Seconds per mode, modes INTERLEAVED round by round, fastest of ``repeat`` rounds."""
    _, _, units, warm, runner, sync = _setup(spec)
    runs = {mode: runner(mode) for mode in spec["modes"]}
    for run in runs.values():
        run(warm)
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
    return {"seconds": best, "tokens": tokens}


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


def measure_case(case: str, spec: dict, modes: list[str]) -> list[dict]:
    """Rows for one token set: non-private first, then ``modes``, with ratios to non-private."""
    all_modes = ["nonprivate", *modes]
    timing = measure("timing", {**spec, "modes": all_modes})
    rows = []
    for mode in all_modes:
        memory = measure("memory", {**spec, "mode": mode, "profile": 0})
        row = {"case": case, **spec, "mode": mode, "tokens": timing["tokens"]}
        row.update(seconds=timing["seconds"][mode], peak_mb=memory["peak_mb"])
        rows.append(row)
    for row in rows:
        row["time_ratio"] = row["seconds"] / rows[0]["seconds"]
        row["memory_ratio"] = row["peak_mb"] / max(rows[0]["peak_mb"], 1e-9)
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
        for unit in ["user"] if args.skip_els else ["user", "example"]:
            rows += measure_case(f"{unit} step", {**ranked, "unit": unit}, engines)
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
        print(
            f"| {r['case']} | {r['preset']} | {lora} | {r['unit']} | {shape} | {mode} | "
            f"{r['tokens']} | "
            f"{r['seconds']:.2f} | {r['time_ratio']:.2f} | {r['peak_mb']:.0f} | "
            f"{r['memory_ratio']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
