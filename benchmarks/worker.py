"""Benchmark the worker's clipping engines against a non-private step on the same tokens.

For one token set (``--users`` units of ``--group-size`` random examples of ``--seq-len`` tokens,
byte vocabulary) it times and measures peak memory of:

- ``nonprivate``: plain forward + backward of Σ_u loss_u (same loss, same token-budget
  micro-batches), gradients accumulated in ``.grad`` — the cost DP is compared with;
- ``loop`` / ``vectorized`` / ``randomized`` (k = ``--probes``): ``ClippingEngine.clipped_sum``,
  for ULS (a unit = a user's G examples) and ELS (a unit = one example; same tokens);
- long sequences (``--long-seq``, default 1024): ``vectorized`` vs ``randomized`` peak memory.

Every measurement runs in its own child process (so the peak is its own); peak memory is the
child's RSS sampled every 2 ms above its RSS just before the measured call (CPU), or
``torch.cuda.max_memory_allocated`` above the allocation before it (GPU). One warm-up call on a
single small unit precedes the measured calls; the time is the fastest of ``--repeat`` runs
(peak memory is from the first). Prints JSON, then a markdown table.

    .venv/bin/python benchmarks/worker.py                   # GPT-2-small, 64 users, G=8, seq 128
    .venv/bin/python benchmarks/worker.py --quick           # gpt2-tiny, 16 users, G=4, seq 64
    .venv/bin/python benchmarks/worker.py --preset gpt2-small --users 4 --group-size 4
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
from types import SimpleNamespace

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


def child(spec: dict) -> dict:
    """One measurement (runs in its own process)."""
    import torch
    from userdp.clients.engine import ClippingEngine
    from userdp.clients.model import ModelShape, build_model

    torch.set_num_threads(spec["threads"])
    config = SimpleNamespace(preset=spec["preset"], path=None, dtype=spec["dtype"], lora_rank=0)
    module = build_model(config, ModelShape(VOCAB, spec["seq_len"], 0, 1), 0)
    device = torch.device(spec["device"])
    module.to(device)
    units = make_units(spec["users"], spec["group_size"], spec["seq_len"], spec["unit"])
    warm = make_units(1, 1, min(spec["seq_len"], 16), "user", seed=1)
    mode = spec["mode"]
    engine = None
    if mode != "nonprivate":
        engine = ClippingEngine(
            module, engine=mode, probes=spec["probes"], token_budget=spec["token_budget"]
        )

    def run(batch) -> None:
        if engine is None:
            nonprivate_step(module, batch, spec["token_budget"])
        else:
            engine.clipped_sum(batch, 1.0)

    run(warm)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        started = time.perf_counter()
        run(units)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        peak = torch.cuda.max_memory_allocated() - base
    else:
        with PeakRss() as rss:
            started = time.perf_counter()
            run(units)
            seconds = time.perf_counter() - started
        peak = rss.peak - rss.base
    for _ in range(spec["repeat"] - 1):  # shared machines are noisy: keep the fastest run
        started = time.perf_counter()
        run(units)
        if cuda:
            torch.cuda.synchronize()
        seconds = min(seconds, time.perf_counter() - started)
    tokens = sum(len(e) - 1 for u in units for e in u.examples)
    return {"seconds": seconds, "peak_mb": peak / 1e6, "tokens": tokens}


def measure(spec: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]))
    out = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"measurement {spec} failed:\n{out.stderr[-4000:]}")
    return {**spec, **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="gpt2-tiny, 16 users, G=4, seq 64")
    parser.add_argument("--preset", default=None, choices=["gpt2-tiny", "gpt2-small"])
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
    parser.add_argument("--repeat", type=int, default=3, help="timed runs; the fastest is kept")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
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
    }
    engines = [e for e in args.engines.split(",") if e]
    rows = []
    units = ["user"] if args.skip_els else ["user", "example"]
    for unit in units:
        reference = measure({**base, "unit": unit, "mode": "nonprivate"})
        rows.append({"case": f"{unit} step", **reference})
        for mode in engines:
            got = measure({**base, "unit": unit, "mode": mode})
            got["time_ratio"] = got["seconds"] / reference["seconds"]
            got["memory_ratio"] = got["peak_mb"] / max(reference["peak_mb"], 1e-9)
            rows.append({"case": f"{unit} step", **got})
    if not args.skip_long:
        long = {**base, "seq_len": args.long_seq, "users": args.long_users, "group_size": 2}
        long["token_budget"] = max(args.token_budget, 2 * args.long_seq)
        reference = measure({**long, "mode": "nonprivate"})
        rows.append({"case": "long seq", **reference})
        for mode in ("vectorized", "randomized"):
            got = measure({**long, "mode": mode})
            got["time_ratio"] = got["seconds"] / reference["seconds"]
            got["memory_ratio"] = got["peak_mb"] / max(reference["peak_mb"], 1e-9)
            rows.append({"case": "long seq", **got})
    result = {
        "benchmark": "worker clipping engines",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, device {args.device}",
        "rows": rows,
    }
    print(json.dumps(result, indent=2))
    print()
    print(
        "| case | preset | unit | users×G×seq | mode | tokens | s | × non-private "
        "| peak MB | memory × |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        shape = f"{r['users']}×{r['group_size']}×{r['seq_len']}"
        mode = r["mode"] + (f" (k={r['probes']})" if r["mode"] == "randomized" else "")
        print(
            f"| {r['case']} | {r['preset']} | {r['unit']} | {shape} | {mode} | {r['tokens']} | "
            f"{r['seconds']:.2f} | {r.get('time_ratio', 1.0):.2f} | {r['peak_mb']:.0f} | "
            f"{r.get('memory_ratio', 1.0):.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
