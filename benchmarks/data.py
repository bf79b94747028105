"""Benchmark ``userdp shard`` on a synthetic user-partitioned Parquet file (default 1M rows).

Generates the input in a temporary directory (streamed, row groups of 100k), runs
``python -m userdp.cli shard`` as a child process, and reports rows/s and the child's peak RSS
(``getrusage(RUSAGE_CHILDREN).ru_maxrss``), then times ``userdp shard verify``. Prints JSON, then a
markdown table. Peak memory is bounded by a small multiple of the largest pass-2 bucket, which is
at least the largest user's tokens (``largest_user_mb``, int32 ids): users are never split.

    .venv/bin/python benchmarks/data.py [--rows 1000000] [--users 20000] [--num-shards 8]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from userdp.clients.shard_store import ShardStore


def make_input(path: Path, rows: int, users: int, seed: int = 0) -> int:
    """Users with Pareto(1.2)-distributed sizes, texts of 20-300 ASCII characters drawn from a pool; returns bytes."""
    rng = np.random.default_rng(seed)
    alphabet = np.array(list("abcdefghijklmnopqrstuvwxyz     "))
    pool = pa.array(
        ["".join(rng.choice(alphabet, size=int(n))) for n in rng.integers(20, 300, size=5000)]
    )
    schema = pa.schema([("user", pa.string()), ("text", pa.string())])
    weights = rng.pareto(1.2, size=users) + 1.0  # heavy-tailed user sizes (Pareto, alpha 1.2)
    weights /= weights.sum()
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, rows, 100_000):
            n = min(100_000, rows - start)
            user_ids = rng.choice(users, size=n, p=weights)
            table = pa.table(
                {
                    "user": pa.array([f"user{u}" for u in user_ids], pa.string()),
                    "text": pool.take(pa.array(rng.integers(0, len(pool), size=n))),
                },
                schema=schema,
            )
            writer.write_table(table)
    return path.stat().st_size


def _child(argv: list[str]) -> tuple[float, int, str, float]:
    """Run ``python -m userdp.cli ARGV``; return wall seconds, peak RSS (bytes), stdout and the
    child's CPU seconds (user + system; the fairer number on a shared machine)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    before, cpu_before = usage.ru_maxrss, usage.ru_utime + usage.ru_stime
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "userdp.cli", *argv], capture_output=True, text=True, check=False
    )
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"userdp {' '.join(argv)} failed:\n{result.stderr}")
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = usage.ru_utime + usage.ru_stime - cpu_before
    return seconds, max(usage.ru_maxrss, before) * 1024, result.stdout, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--users", type=int, default=20_000)
    parser.add_argument("--num-shards", type=int, default=8)
    parser.add_argument("--tokenizer", default="byte")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="userdp-bench-data-") as tmp:
        tmp_path = Path(tmp)
        source = tmp_path / "input.parquet"
        started = time.perf_counter()
        input_bytes = make_input(source, args.rows, args.users)
        generate_s = time.perf_counter() - started
        out = tmp_path / "shards"
        shard_s, shard_rss, summary, shard_cpu = _child(
            [
                "shard", str(source), "--user-column", "user", "--text-column", "text",
                "--out", str(out), "--num-shards", str(args.num_shards),
                "--tokenizer", args.tokenizer, "--quiet",
            ]
        )  # fmt: skip
        manifest = json.loads((out / "manifest.json").read_text())
        counts = ShardStore(out).user_counts().values()
        largest_user_tokens = max(c.n_tokens for c in counts)
        verify_s, _, _, _ = _child(["shard", "verify", str(out)])
        output_bytes = sum(p.stat().st_size for p in out.iterdir() if p.is_file())

    result = {
        "benchmark": "userdp shard",
        "rows": args.rows,
        "users": manifest["totals"]["users"],
        "tokens": manifest["totals"]["tokens"],
        "num_shards": args.num_shards,
        "tokenizer": args.tokenizer,
        "input_mb": round(input_bytes / 1e6, 1),
        "output_mb": round(output_bytes / 1e6, 1),
        "input_generation_s": round(generate_s, 2),
        "shard_s": round(shard_s, 2),
        "rows_per_s": round(args.rows / shard_s),
        "shard_cpu_s": round(shard_cpu, 2),
        "rows_per_cpu_s": round(args.rows / shard_cpu),
        "peak_rss_mb": round(shard_rss / 1e6, 1),
        "largest_user_mb": round(largest_user_tokens * 4 / 1e6, 1),
        "verify_s": round(verify_s, 2),
        "examples_per_user": manifest["examples_per_user"],
        "summary": summary.strip(),
    }
    print(json.dumps(result, indent=2))
    print()
    print(
        "| rows | users | tokens | shards | input MB | output MB | shard s (CPU s) | rows/s "
        "(per CPU s) | peak RSS MB | largest user MB | verify s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    print(
        f"| {result['rows']} | {result['users']} | {result['tokens']} | {args.num_shards} | "
        f"{result['input_mb']} | {result['output_mb']} | {result['shard_s']} "
        f"({result['shard_cpu_s']}) | {result['rows_per_s']} ({result['rows_per_cpu_s']}) | "
        f"{result['peak_rss_mb']} | {result['largest_user_mb']} | "
        f"{result['verify_s']} |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
