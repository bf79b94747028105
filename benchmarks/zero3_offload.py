"""One device, ZeRO-3 with parameters offloaded to host memory: a Llama-shaped model whose
parameters and clipped sums do not fit the device, trained by the worker's ``vectorized`` engine.

The model is sized from the device (unless ``--layers`` is given): Llama blocks of ``--width``
(SwiGLU MLP and grouped-query attention as the presets), as many as make its bf16 parameters plus
float32 clipped sums at least ``--oversize`` × the device's memory. It is built the way a worker
builds it (``partitioned_build``: ``deepspeed.zero.Init`` with ``offload_param.device = "cpu"``,
so the partitions are created in host memory), wrapped by ``wrap_with_deepspeed`` at stage 3, and
one task of users (``--users`` × ``--group`` examples of ``--seq-len`` random tokens) is clipped
by ``ClippingEngine.clipped_sum``; the clipped sums stay in host memory (single rank, offloaded
parameters: ``clients/zero3.py``, ``offload_device``).

Reported: parameters and what they and the sums would need on the device, peak device memory
(``torch.cuda.max_memory_allocated``), peak host RSS, and tokens/s of the clipped sum (median of
``--repeats`` after a warm-up). Goal: the task runs with peak device memory below the device's
memory while parameters + sums exceed it. Anchor in the same run: a forward pass of the same
tokens through the same offloaded model (no gradients), the floor set by streaming the
parameters from host memory.

    python benchmarks/zero3_offload.py                      # CUDA: sized from the device
    python benchmarks/zero3_offload.py --device cpu --layers 2 --width 64 --heads 4 \\
        --users 2 --group 2 --seq-len 32 --repeats 1        # CPU smoke test of the harness

Exits with status 2 and says why when the device or the host cannot hold the sized model.
Prints JSON, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GB = 1e9
VOCAB = 259  # the byte tokenizer's ids (tests/clients/engine_fixtures.py)


def llama_config(layers: int, width: int, heads: int, seq_len: int):
    """The Llama presets' shape (``clients/model.py``) with this many layers and this width."""
    from userdp.clients.model import ModelShape, preset_config

    return preset_config("llama", layers, width, heads, ModelShape(VOCAB, seq_len))


def parameters(layers: int, width: int, heads: int) -> int:
    """Parameters of :func:`llama_config` (embedding, untied head, blocks, final norm)."""
    mlp = llama_config(1, width, heads, 8).intermediate_size
    kv = width * max(1, heads // 2) // heads
    block = 2 * width * width + 2 * width * kv + 3 * width * mlp + 2 * width
    return layers * block + 2 * VOCAB * width + width


def size_model(args, device_bytes: int | None) -> int:
    if args.layers:
        return args.layers
    if device_bytes is None:
        raise SystemExit("--layers is needed without a CUDA device")
    per_layer = parameters(1, args.width, args.heads) - parameters(0, args.width, args.heads)
    target = args.oversize * device_bytes / (2 + 4)  # bf16 parameters + float32 sums
    return math.ceil(target / per_layer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--layers", type=int, default=0, help="default: sized from the device")
    parser.add_argument("--width", type=int, default=5120)
    parser.add_argument("--heads", type=int, default=40)
    parser.add_argument("--oversize", type=float, default=1.1)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--group", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--token-budget", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import numpy as np
    import psutil
    import torch

    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("zero3_offload: no CUDA device; use --device cpu for the smoke test", file=sys.stderr)
        return 2
    device_bytes = torch.cuda.get_device_properties(0).total_memory if cuda else None
    layers = size_model(args, device_bytes)
    count = parameters(layers, args.width, args.heads)
    host_bytes = psutil.virtual_memory().total
    if 6 * count > 0.85 * host_bytes:
        print(
            f"zero3_offload: {count / 1e9:.1f}B parameters need {6 * count / GB:.0f} GB of host "
            f"memory (bf16 partitions + float32 sums); this host has {host_bytes / GB:.0f} GB: "
            "use a device with less memory or a smaller --oversize",
            file=sys.stderr,
        )
        return 2

    from userdp.clients.distributed import (
        partitioned_build,
        prepare_deepspeed,
        world,
        wrap_with_deepspeed,
    )
    from userdp.clients.engine import ClippingEngine, Unit

    os.environ.setdefault("WORLD_SIZE", "1")
    ds_json = {
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": cuda},
            "stage3_param_persistence_threshold": 0,
        }
    }
    prepare_deepspeed(args.device)
    start = time.perf_counter()
    with partitioned_build(3, cuda, ds_json):
        dtype = torch.bfloat16 if cuda else torch.float32
        config = llama_config(layers, args.width, args.heads, args.seq_len)
        import transformers

        module = transformers.LlamaForCausalLM._from_config(config, dtype=dtype)
    module.eval()
    engine = wrap_with_deepspeed(module, 3, cuda, args.device, None, ds_json)
    build_s = time.perf_counter() - start
    count = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    clipper = ClippingEngine(engine.module, engine="vectorized", token_budget=args.token_budget)
    assert world()[1] == 1
    rng = np.random.default_rng(0)
    units = [
        Unit(f"u{i}", [rng.integers(3, VOCAB, size=args.seq_len) for _ in range(args.group)])
        for i in range(args.users)
    ]
    tokens = args.users * args.group * (args.seq_len - 1)
    if cuda:
        torch.cuda.reset_peak_memory_stats()

    def timed(call) -> float:
        call()  # warm-up
        times = []
        for _ in range(args.repeats):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            call()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    from userdp.clients.clipping import Accumulator

    placed = []
    result_of = Accumulator.result

    def kept(self):  # where the task's accumulator kept the sums
        placed.append(str(self.flat.device))
        return result_of(self)

    Accumulator.result = kept
    result: list = []
    private_s = timed(lambda: result.append(clipper.clipped_sum(units, 1.0)))
    rows = args.token_budget // args.seq_len
    ids = torch.as_tensor(
        np.stack([e for u in units for e in u.examples]), dtype=torch.long, device=clipper.device
    )

    def forward() -> None:
        with torch.no_grad():
            for i in range(0, ids.shape[0], max(1, rows)):
                engine.module(input_ids=ids[i : i + rows])

    forward_s = timed(forward)
    peak_device = torch.cuda.max_memory_allocated() if cuda else None
    row = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "layers": layers,
        "width": args.width,
        "parameters": count,
        "params_bf16_gb": 2 * count / GB,
        "sums_fp32_gb": 4 * count / GB,
        "device_gb": device_bytes / GB if device_bytes else None,
        "peak_device_gb": peak_device / GB if peak_device is not None else None,
        "peak_host_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB,
        "sums_accumulated_on": placed[-1],
        "build_s": build_s,
        "tokens": tokens,
        "private_tokens_per_s": tokens / private_s,
        "forward_tokens_per_s": tokens / forward_s,
        "units": result[-1].stats.count,
    }
    fits = device_bytes is None or (peak_device < device_bytes)
    needs = device_bytes is None or 6 * count > device_bytes
    row["met"] = bool(fits and needs) if device_bytes else None
    print(json.dumps({"benchmark": "zero3_offload", "rows": [row]}))
    print()
    print(
        "| device | parameters | bf16 params + fp32 sums GB | device GB | peak device GB | goal "
        "| private tokens/s | anchor: forward tokens/s | peak host RSS GB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    device_gb = f"{row['device_gb']:.0f}" if row["device_gb"] else "-"
    peak = f"{row['peak_device_gb']:.1f}" if row["peak_device_gb"] is not None else "-"
    goal = {True: "met", False: "not met", None: "n/a (CPU)"}[row["met"]]
    print(
        f"| {row['device']} | {count / 1e9:.2f}B | {6 * count / GB:.1f} | {device_gb} | {peak} | "
        f"runs with params + sums > device, peak < device: {goal} | "
        f"{row['private_tokens_per_s']:.0f} | {row['forward_tokens_per_s']:.0f} | "
        f"{row['peak_host_rss_gb']:.1f} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
