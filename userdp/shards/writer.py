"""``userdp shard``: tokenize a user-partitioned dataset into Arrow shards + manifest (format v1).

Two streaming passes keep memory bounded by a partition, never by the input (an external
partition, not an in-memory group-by):

1. **partition**: read the input in batches, check and tokenize them, and spill every row into a
   temporary Arrow file per *bucket*. A row's bucket is its user's shard (``hash % S``) refined by
   the hash's top bits, so a bucket is a contiguous range of the in-shard order and holds about
   ``bucket_bytes`` of data whatever the input size.
2. **group**: per shard, load its buckets one at a time, sort each by (user hash, user id, input
   order), and append them to the shard file while building the per-user index.

Everything is written into a hidden temporary directory next to ``--out``, fsync'd and renamed
into place at the end; on any error the temporary directories are removed, so ``--out`` is either complete
or absent. Format: :mod:`userdp.clients.shard_format` and docs/data.md.
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
from tqdm import tqdm

from userdp import __version__
from userdp.accounting.durable import fsync_path
from userdp.clients.shard_format import (
    INDEX_SCHEMA,
    SCHEMA_VERSION,
    InputDataError,
    Manifest,
    ShardEntry,
    file_sha256,
    shard_name,
    shard_schema,
    user_hash,
    write_manifest,
)
from userdp.clients.tokenization import Tokenizer
from userdp.shards.input import InputBatch, InputSource
from userdp.shards.tokenization import build_tokenizer

_SPILL_FLUSH_BYTES = 32 << 20
_MAX_SPILL_FILES = 4096
_WRITE_CHUNK_ROWS = 8192


@dataclass(frozen=True)
class ShardOptions:
    num_shards: int = 8
    tokenizer: str = "byte"
    max_examples_per_user: int | None = None
    keep_text: bool = False
    dataset_name: str | None = None
    progress: bool = True
    bucket_bytes: int = 32 << 20
    """Target size of one pass-2 partition: peak memory is a small multiple of this."""


@dataclass(frozen=True)
class ShardSummary:
    directory: Path
    num_shards: int
    users: int
    examples: int
    tokens: int
    rows_read: int
    rows_dropped: int
    min_examples: int
    median_examples: float
    max_examples: int
    seconds: float

    def format(self) -> str:
        lines = [
            f"wrote {self.directory} ({self.num_shards} shards) in {self.seconds:.1f} s",
            f"users: {self.users}   examples: {self.examples}   tokens: {self.tokens}",
            f"examples per user: min {self.min_examples}  median {self.median_examples:g}  "
            f"max {self.max_examples}",
        ]
        if self.rows_dropped:
            lines.append(f"dropped by --max-examples-per-user: {self.rows_dropped} rows")
        return "\n".join(lines)


def write_shards(source: InputSource, out_dir: str | Path, options: ShardOptions) -> ShardSummary:
    """Shard ``source`` into ``out_dir`` (which must not exist or be empty); atomic."""
    if options.num_shards < 1:
        raise ValueError(f"--num-shards must be a positive integer, got {options.num_shards}")
    if options.max_examples_per_user is not None and options.max_examples_per_user < 1:
        raise ValueError(
            f"--max-examples-per-user must be a positive integer, got {options.max_examples_per_user}"
        )
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(
            f"--out {out}: already exists and is not an empty directory; choose another"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    partial = out.parent / f".{out.name}.partial-{tag}"
    spill = out.parent / f".{out.name}.spill-{tag}"
    started = time.perf_counter()
    try:
        partial.mkdir()
        spill.mkdir()
        tokenizer = build_tokenizer(options.tokenizer, source.texts, partial)
        rows_read, bits = _partition(source, tokenizer, spill, options)
        entries, per_user, user_shards, dropped = _group(spill, partial, options, bits)
        examples = sum(e.num_examples for e in entries)
        manifest = Manifest(
            schema_version=SCHEMA_VERSION,
            dataset_name=options.dataset_name or Path(source.name).stem,
            created_by=f"userdp {__version__}",
            source={
                "input": source.name,
                "format": source.format,
                "user_column": source.user_column,
                "text_column": source.text_column,
                "rows": rows_read,
            },
            tokenizer=tokenizer.info,
            has_text=options.keep_text,
            max_examples_per_user=options.max_examples_per_user,
            num_shards=options.num_shards,
            shards=tuple(entries),
            total_users=len(user_shards),
            total_examples=examples,
            total_tokens=sum(e.num_tokens for e in entries),
            examples_per_user=_stats(per_user),
            user_shards=user_shards,
        )
        write_manifest(manifest, partial)
        for written in partial.rglob("*"):  # durable before the folder becomes visible
            fsync_path(written)
        fsync_path(partial)
        if out.exists():
            out.rmdir()
        os.rename(partial, out)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(spill, ignore_errors=True)
    stats = manifest.examples_per_user
    return ShardSummary(
        directory=out,
        num_shards=options.num_shards,
        users=manifest.total_users,
        examples=examples,
        tokens=manifest.total_tokens,
        rows_read=rows_read,
        rows_dropped=dropped,
        min_examples=int(stats["min"]),
        median_examples=stats["median"],
        max_examples=int(stats["max"]),
        seconds=time.perf_counter() - started,
    )


def _stats(per_user: np.ndarray) -> dict[str, float]:
    if per_user.size == 0:
        raise InputDataError("the input has no rows")
    return {
        "min": int(per_user.min()),
        "median": float(np.median(per_user)),
        "mean": float(per_user.mean()),
        "max": int(per_user.max()),
    }


def _bucket_bits(estimated_bytes: float, options: ShardOptions) -> int:
    """log2(buckets per shard) so that one bucket holds about ``options.bucket_bytes``."""
    per_shard = estimated_bytes / options.num_shards
    bits = max(0, math.ceil(math.log2(max(per_shard, 1.0) / options.bucket_bytes)))
    while bits > 0 and options.num_shards << bits > _MAX_SPILL_FILES:
        bits -= 1
    return min(bits, 16)


def _estimate_spill_bytes(source: InputSource, first: pa.Table, first_text_bytes: int) -> float:
    """Spilled size of the whole input, extrapolated from the first tokenized batch: by rows when
    the row count is known up front (Parquet: its compressed file size says little), else by the
    input's byte size."""
    total_rows = source.total_rows()
    if total_rows is not None:
        return total_rows * first.nbytes / max(first.num_rows, 1)
    return source.nbytes * first.nbytes / max(first_text_bytes, 1)


def _spill_schema(with_text: bool) -> pa.Schema:
    fields = [pa.field("user_hash", pa.uint64()), pa.field("seq", pa.int64())]
    return pa.schema(fields + list(shard_schema(with_text)))


def _hashes(users: pa.Array) -> np.ndarray:
    unique = pc.unique(users)
    table = np.fromiter(
        (user_hash(u) for u in unique.to_pylist()), dtype=np.uint64, count=len(unique)
    )
    return table[pc.index_in(users, unique).to_numpy()]


class _Spill:
    """Per-bucket buffered writers of temporary Arrow IPC files."""

    def __init__(self, directory: Path, schema: pa.Schema) -> None:
        self.directory, self.schema = directory, schema
        self._writers: dict[int, tuple[pa.NativeFile, ipc.RecordBatchFileWriter]] = {}
        self._buffers: dict[int, list[pa.Table]] = {}
        self._buffered = 0

    def path(self, bucket: int) -> Path:
        return self.directory / f"bucket-{bucket:06d}.arrow"

    def add(self, bucket: int, table: pa.Table) -> None:
        self._buffers.setdefault(bucket, []).append(table)
        self._buffered += table.nbytes
        if self._buffered > _SPILL_FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        for bucket, tables in self._buffers.items():
            if bucket not in self._writers:
                sink = pa.OSFile(str(self.path(bucket)), "wb")
                self._writers[bucket] = (sink, ipc.new_file(sink, self.schema))
            self._writers[bucket][1].write_table(pa.concat_tables(tables))
        self._buffers.clear()
        self._buffered = 0

    def close(self) -> None:
        self.flush()
        for sink, writer in self._writers.values():
            writer.close()
            sink.close()


def _partition(
    source: InputSource, tokenizer: Tokenizer, spill_dir: Path, options: ShardOptions
) -> tuple[int, int]:
    """Pass 1; returns (rows read, bucket bits). The bits are fixed after the first batch."""
    schema = _spill_schema(options.keep_text)
    spill = _Spill(spill_dir, schema)
    rows = 0
    bits = -1
    progress = tqdm(
        total=source.total_rows(),
        unit="rows",
        desc="tokenize",
        file=sys.stderr,
        disable=not options.progress,
    )
    try:
        for batch in source.batches():
            table = _tokenized(batch, tokenizer, rows, options.keep_text, schema)
            if bits < 0:
                text_bytes = pc.sum(pc.binary_length(batch.text)).as_py() or 0
                bits = _bucket_bits(_estimate_spill_bytes(source, table, text_bytes), options)
            hashes = table.column("user_hash").to_numpy()
            bucket = (hashes % np.uint64(options.num_shards)).astype(np.int64) << bits
            if bits:
                bucket += (hashes >> np.uint64(64 - bits)).astype(np.int64)
            order = np.argsort(bucket, kind="stable")
            sorted_buckets = bucket[order]
            table = table.take(pa.array(order))
            cuts = np.flatnonzero(np.diff(sorted_buckets)) + 1
            for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, len(order)], strict=True):
                spill.add(int(sorted_buckets[lo]), table.slice(lo, hi - lo))
            rows += table.num_rows
            progress.update(table.num_rows)
    finally:
        spill.close()
        progress.close()
    if rows == 0:
        raise InputDataError(f"{source.name}: the input has no rows")
    return rows, bits


def _tokenized(
    batch: InputBatch, tokenizer: Tokenizer, seq0: int, keep_text: bool, schema: pa.Schema
) -> pa.Table:
    tokens = tokenizer.encode_arrow(batch.text)
    lengths = pc.list_value_length(tokens).to_numpy(zero_copy_only=False)
    if np.any(lengths == 0):
        row = batch.first_row + int(np.flatnonzero(lengths == 0)[0])
        raise InputDataError(f"{batch.file}: row {row}: text encodes to no tokens")
    columns = [
        pa.array(_hashes(batch.user), pa.uint64()),
        pa.array(np.arange(seq0, seq0 + len(batch.user), dtype=np.int64)),
        batch.user,
        tokens,
    ]
    if keep_text:
        columns.append(batch.text)
    return pa.Table.from_arrays(columns, schema=schema)


def _group(
    spill_dir: Path, out_dir: Path, options: ShardOptions, bits: int
) -> tuple[list[ShardEntry], np.ndarray, dict[str, int], int]:
    schema = shard_schema(options.keep_text)
    entries: list[ShardEntry] = []
    all_counts: list[np.ndarray] = []
    user_shards: dict[str, int] = {}
    dropped = 0
    for s in tqdm(
        range(options.num_shards),
        desc="write shards",
        file=sys.stderr,
        disable=not options.progress,
    ):
        name = shard_name(s)
        path, index_path = out_dir / f"{name}.arrow", out_dir / f"{name}.index.arrow"
        index_parts: list[pa.Table] = []
        rows = 0
        with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, schema) as file_writer:
            writer = _ChunkedWriter(file_writer, schema)
            for bucket in range(s << bits, (s + 1) << bits):
                bucket_path = spill_dir / f"bucket-{bucket:06d}.arrow"
                if not bucket_path.exists():
                    continue
                index, n_dropped = _group_bucket(bucket_path, options.max_examples_per_user, writer)
                dropped += n_dropped
                index_parts.append(
                    index.set_column(1, "row_start", pc.add(index["row_start"], rows))
                )
                rows += int(pc.sum(index["n_examples"]).as_py())
                bucket_path.unlink()
                pa.default_memory_pool().release_unused()  # mimalloc keeps freed pages otherwise
            writer.finish()
        index = (
            pa.concat_tables(index_parts).cast(INDEX_SCHEMA)
            if index_parts
            else INDEX_SCHEMA.empty_table()
        )
        with pa.OSFile(str(index_path), "wb") as sink, ipc.new_file(sink, INDEX_SCHEMA) as writer:
            writer.write_table(index)
        counts = index.column("n_examples").to_numpy()
        all_counts.append(counts)
        for user in index.column("user_id").to_pylist():
            user_shards[user] = s
        entries.append(
            ShardEntry(
                name=name,
                file=path.name,
                sha256=file_sha256(path),
                num_bytes=path.stat().st_size,
                index_file=index_path.name,
                index_sha256=file_sha256(index_path),
                num_users=index.num_rows,
                num_examples=rows,
                num_tokens=int(pc.sum(index.column("n_tokens")).as_py() or 0),
            )
        )
    return entries, np.concatenate(all_counts), user_shards, dropped


class _ChunkedWriter:
    """Writes record batches of exactly ``_WRITE_CHUNK_ROWS`` rows (the last one shorter), so the
    shard file's bytes do not depend on how rows were partitioned into buckets."""

    def __init__(self, writer: ipc.RecordBatchFileWriter, schema: pa.Schema) -> None:
        self._writer = writer
        self.schema = schema
        self._pending: list[pa.Table] = []
        self._rows = 0

    def write(self, table: pa.Table) -> None:
        self._pending.append(table)
        self._rows += table.num_rows
        if self._rows >= _WRITE_CHUNK_ROWS:
            rest = pa.concat_tables(self._pending)
            while rest.num_rows >= _WRITE_CHUNK_ROWS:
                self._emit(rest.slice(0, _WRITE_CHUNK_ROWS))
                rest = rest.slice(_WRITE_CHUNK_ROWS)
            self._pending, self._rows = [rest], rest.num_rows

    def finish(self) -> None:
        if self._rows:
            self._emit(pa.concat_tables(self._pending))
        self._pending, self._rows = [], 0

    def _emit(self, table: pa.Table) -> None:
        self._writer.write_batch(table.combine_chunks().to_batches()[0])


def _group_bucket(
    path: Path, max_per_user: int | None, writer: _ChunkedWriter
) -> tuple[pa.Table, int]:
    """Write one bucket's rows grouped by user; return its index (row_start relative to the
    bucket) and the number of rows dropped by ``max_per_user``.

    The bucket is loaded once as one contiguous table (its mapped pages are released right after)
    and gathered into sorted output one chunk at a time: peak memory is about twice the bucket.
    """
    with pa.memory_map(str(path), "r") as source:
        # One contiguous copy: Arrow's take on a chunked column concatenates it on every call.
        table = ipc.open_file(source).read_all().combine_chunks()
    order = pc.sort_indices(
        table.select(["user_hash", "user_id", "seq"]),
        sort_keys=[("user_hash", "ascending"), ("user_id", "ascending"), ("seq", "ascending")],
    ).to_numpy()
    users = table.column("user_id").take(pa.array(order))
    n = len(order)
    changed = pc.not_equal(users.slice(1), users.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    starts = np.r_[0, np.flatnonzero(changed) + 1]
    counts = np.diff(np.r_[starts, n])
    first_rows = users.take(pa.array(starts))
    dropped = 0
    if max_per_user is not None and np.any(counts > max_per_user):
        keep = np.arange(n) - np.repeat(starts, counts) < max_per_user
        dropped = int(n - keep.sum())
        order = order[keep]
        counts = np.minimum(counts, max_per_user)
        starts = np.r_[0, np.cumsum(counts)[:-1]]
    lengths = pc.list_value_length(table.column("input_ids")).to_numpy()[order]
    rows = table.select(writer.schema.names)
    for lo in range(0, len(order), _WRITE_CHUNK_ROWS):
        chunk = rows.take(pa.array(order[lo : lo + _WRITE_CHUNK_ROWS]))
        writer.write(chunk.cast(writer.schema))
    index = pa.table(
        {
            "user_id": first_rows,
            "row_start": pa.array(starts, pa.int64()),
            "n_examples": pa.array(counts, pa.int64()),
            "n_tokens": pa.array(np.add.reduceat(lengths, starts).astype(np.int64)),
        }
    )
    return index, dropped
