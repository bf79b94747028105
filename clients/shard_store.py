"""Read user-partitioned shards: per-user counts from the index, per-user rows memory-mapped.

The coordinator uses :meth:`ShardStore.user_counts` (index files only, no rows). A worker opens
only the shards it owns (``ShardStore(dir, shards=[...])`` or :meth:`ShardStore.subset`) and reads
one user's examples with :meth:`ShardStore.user_examples`, which memory-maps the shard file and
slices the user's row range: the cost is O(that user), never a full-file load. Each read first
checks that the shard's files are still there (:func:`check_present`): a folder deleted or moved
during a run is one clear error, not a read from whatever is still memory-mapped.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
from userdp.clients.shard_format import (
    INDEX_SCHEMA,
    TEXT_COLUMN,
    TOKENS_COLUMN,
    USER_COLUMN,
    Manifest,
    ShardEntry,
    ShardError,
    ShardIntegrityError,
    ShardsGoneError,
    file_sha256,
    read_manifest,
    shard_of_user,
    shard_schema,
)
from userdp.clients.tokenization import tokenizer_from_info


@dataclass(frozen=True)
class UserCount:
    """What the coordinator knows about a user: where it lives and how much data it has."""

    user_id: str
    shard: str
    n_examples: int
    n_tokens: int


@dataclass(frozen=True)
class VerifyReport:
    shards: int
    users: int
    examples: int
    tokens: int


@dataclass(frozen=True)
class _UserRange:
    row_start: int
    n_examples: int


class _OpenShard:
    """A memory-mapped shard file with the row offset of each record batch."""

    def __init__(self, path: Path) -> None:
        try:
            self._source = pa.memory_map(str(path), "r")
            self._reader = ipc.open_file(self._source)
        except (pa.ArrowInvalid, OSError) as exc:
            raise ShardIntegrityError(f"{path}: not a readable Arrow IPC file ({exc})") from exc
        self.path = path
        self.schema = self._reader.schema
        self._batch_starts: list[int] = []
        start = 0
        for i in range(self._reader.num_record_batches):
            self._batch_starts.append(start)
            start += self._reader.get_batch(i).num_rows
        self.num_rows = start

    def rows(self, row_start: int, n_rows: int, column: str) -> list[pa.Array]:
        """The column's values for rows [row_start, row_start + n_rows), as zero-copy slices."""
        pieces: list[pa.Array] = []
        row, end = row_start, row_start + n_rows
        i = bisect.bisect_right(self._batch_starts, row) - 1
        while row < end:
            batch = self._reader.get_batch(i)
            local = row - self._batch_starts[i]
            take = min(end - row, batch.num_rows - local)
            pieces.append(batch.column(column).slice(local, take))
            row += take
            i += 1
        return pieces

    def close(self) -> None:
        self._source.close()


def check_present(directory: Path, entries: Iterable[ShardEntry]) -> None:
    """Raise :class:`ShardsGoneError` naming ``directory`` when its ``manifest.json`` or a file of
    ``entries`` no longer exists: the folder was deleted or moved while a run used it. (Files
    already memory-mapped stay readable until closed; the run stops instead of going on with
    what it happens to hold open and failing at its next start.)"""
    directory = Path(directory)
    files = ["manifest.json", *(name for e in entries for name in (e.file, e.index_file))]
    for name in files:
        if not (directory / name).is_file():
            raise ShardsGoneError(
                f"the shards folder {directory} was deleted or moved during the run "
                f"({name} is gone): put it back, then run the same command to resume"
            )


def _read_index(path: Path) -> pa.Table:
    try:
        with pa.memory_map(str(path), "r") as source:
            table = ipc.open_file(source).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise ShardIntegrityError(f"{path}: not a readable Arrow IPC file ({exc})") from exc
    if not table.schema.equals(INDEX_SCHEMA):
        raise ShardIntegrityError(
            f"{path}: index schema is {table.schema}, expected {INDEX_SCHEMA}"
        )
    return table


class ShardStore:
    """A shard directory, or the subset of its shards one worker owns."""

    def __init__(self, directory: str | Path, shards: Iterable[str] | None = None) -> None:
        self.directory = Path(directory)
        self.manifest: Manifest = read_manifest(self.directory)
        by_name = {entry.name: entry for entry in self.manifest.shards}
        names = list(by_name) if shards is None else list(shards)
        unknown = [name for name in names if name not in by_name]
        if unknown:
            raise ShardError(
                f"{self.directory}: unknown shard(s) {unknown}; the manifest lists {list(by_name)}"
            )
        self._entries: dict[str, ShardEntry] = {name: by_name[name] for name in names}
        self._ranges: dict[str, dict[str, _UserRange]] | None = None
        self._open: dict[str, _OpenShard] = {}

    def subset(self, shard_names: Iterable[str]) -> ShardStore:
        """A store over only ``shard_names`` (what one worker owns)."""
        return ShardStore(self.directory, shards=shard_names)

    @property
    def shard_names(self) -> list[str]:
        return list(self._entries)

    def shard_of(self, user_id: str) -> str:
        """The shard holding ``user_id`` (from the manifest's user -> shard map)."""
        try:
            return self.manifest.shards[self.manifest.user_shards[user_id]].name
        except KeyError:
            raise KeyError(f"user {user_id!r} is not in {self.directory}") from None

    # ---- counts: index files only -------------------------------------------------------------

    def _index(self, name: str) -> pa.Table:
        return _read_index(self.directory / self._entries[name].index_file)

    def user_counts(self) -> dict[str, UserCount]:
        """user id -> :class:`UserCount` for every user of the owned shards; reads no rows."""
        counts: dict[str, UserCount] = {}
        for name in self._entries:
            index = self._index(name).to_pydict()
            for user, n_ex, n_tok in zip(
                index["user_id"], index["n_examples"], index["n_tokens"], strict=True
            ):
                counts[user] = UserCount(user, name, n_ex, n_tok)
        return counts

    def users(self) -> list[str]:
        """User ids of the owned shards, in shard then storage order."""
        return list(self.user_counts())

    # ---- rows: memory-mapped, O(one user) -----------------------------------------------------

    def _span(self, user_id: str) -> tuple[str, _UserRange]:
        if self._ranges is None:
            self._ranges = {}
            for name in self._entries:
                index = self._index(name).to_pydict()
                self._ranges[name] = {
                    u: _UserRange(s, n)
                    for u, s, n in zip(
                        index["user_id"], index["row_start"], index["n_examples"], strict=True
                    )
                }
        name = self.shard_of(user_id)
        if name not in self._entries:
            raise KeyError(
                f"user {user_id!r} is in {name}, which this store does not own "
                f"(owns {self.shard_names})"
            )
        return name, self._ranges[name][user_id]

    def _user_range(self, user_id: str) -> tuple[_OpenShard, _UserRange]:
        name, span = self._span(user_id)
        check_present(self.directory, [self._entries[name]])
        if name not in self._open:
            self._open[name] = _OpenShard(self.directory / self._entries[name].file)
        return self._open[name], span

    def user_rows(self, user_id: str) -> tuple[str, int, int]:
        """(shard name, first row, number of rows) of ``user_id``'s examples in its shard file;
        reads the index only. Per-row data cached beside a shard (e.g. the examples'
        perplexities, :mod:`userdp.clients.perplexity`) is addressed by these rows."""
        name, span = self._span(user_id)
        return name, span.row_start, span.n_examples

    def shard_users(self, name: str) -> list[str]:
        """User ids of the owned shard ``name`` in row order (from its index)."""
        if name not in self._entries:
            raise KeyError(f"shard {name!r} is not owned by this store (owns {self.shard_names})")
        index = self._index(name)
        order = np.argsort(index.column("row_start").to_numpy(), kind="stable")
        users = index.column("user_id").to_pylist()
        return [users[i] for i in order]

    def user_examples(self, user_id: str) -> list[np.ndarray]:
        """The user's examples as int32 token-id arrays (copies), in input order."""
        shard, span = self._user_range(user_id)
        examples: list[np.ndarray] = []
        for piece in shard.rows(span.row_start, span.n_examples, TOKENS_COLUMN):
            offsets = piece.offsets.to_numpy()
            values = piece.values.to_numpy(zero_copy_only=False)
            examples.extend(values[offsets[i] : offsets[i + 1]].copy() for i in range(len(piece)))
        return examples

    def user_texts(self, user_id: str) -> list[str]:
        """The user's raw texts; only when the writer kept them (``--keep-text``)."""
        if not self.manifest.has_text:
            raise ShardError(f"{self.directory}: shards were written without text (--keep-text)")
        shard, span = self._user_range(user_id)
        return [
            t
            for piece in shard.rows(span.row_start, span.n_examples, TEXT_COLUMN)
            for t in piece.to_pylist()
        ]

    def close(self) -> None:
        for shard in self._open.values():
            shard.close()
        self._open.clear()

    def __enter__(self) -> ShardStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- integrity ----------------------------------------------------------------------------

    def verify(self) -> VerifyReport:
        """Check every owned shard against the manifest; raise :class:`ShardIntegrityError` naming
        the first bad file. Checks sha256, schema, row/user/token counts, index bounds and
        contiguity, that each row's user id matches its index entry, and the user -> shard map."""
        manifest = self.manifest
        if manifest.tokenizer.path is not None:
            tokenizer_from_info(manifest.tokenizer, self.directory)
        shard_position = {entry.name: i for i, entry in enumerate(manifest.shards)}
        users = examples = tokens = 0
        for name, entry in self._entries.items():
            for file, expected in (
                (entry.file, entry.sha256),
                (entry.index_file, entry.index_sha256),
            ):
                path = self.directory / file
                if not path.is_file():
                    raise ShardIntegrityError(f"{path}: missing (listed in the manifest)")
                actual = file_sha256(path)
                if actual != expected:
                    raise ShardIntegrityError(
                        f"{path}: sha256 {actual[:16]}... does not match the manifest "
                        f"({expected[:16]}...); the file is corrupt or was modified"
                    )
            _verify_shard(self.directory, entry, manifest, shard_position[name])
            users += entry.num_users
            examples += entry.num_examples
            tokens += entry.num_tokens
        if set(self._entries) == set(shard_position):
            if len(manifest.user_shards) != users:
                raise ShardIntegrityError(
                    f"{self.directory / 'manifest.json'}: user_shards has "
                    f"{len(manifest.user_shards)} users, the indexes {users}"
                )
            if (users, examples, tokens) != (
                manifest.total_users,
                manifest.total_examples,
                manifest.total_tokens,
            ):
                raise ShardIntegrityError(
                    f"{self.directory / 'manifest.json'}: totals do not match the shards "
                    f"(users, examples, tokens) = {(users, examples, tokens)}"
                )
        return VerifyReport(len(self._entries), users, examples, tokens)


def _verify_shard(directory: Path, entry: ShardEntry, manifest: Manifest, position: int) -> None:
    path, index_path = directory / entry.file, directory / entry.index_file
    shard = _OpenShard(path)
    try:
        if not shard.schema.equals(shard_schema(manifest.has_text)):
            raise ShardIntegrityError(f"{path}: schema {shard.schema} does not match the manifest")
        index = _read_index(index_path)
        n_users = index.num_rows
        starts = index.column("row_start").to_numpy()
        counts = index.column("n_examples").to_numpy()
        if (shard.num_rows, n_users) != (entry.num_examples, entry.num_users):
            raise ShardIntegrityError(
                f"{path}: {shard.num_rows} rows / {n_users} users, the manifest says "
                f"{entry.num_examples} / {entry.num_users}"
            )
        expected_starts = np.concatenate([[0], np.cumsum(counts)[:-1]]) if n_users else starts
        if np.any(counts < 1) or not np.array_equal(starts, expected_starts):
            raise ShardIntegrityError(f"{index_path}: row ranges are not contiguous from row 0")
        if int(counts.sum()) != shard.num_rows:
            raise ShardIntegrityError(
                f"{index_path}: row ranges cover {int(counts.sum())} rows, {path} has {shard.num_rows}"
            )
        index_users = index.column("user_id")
        row_users = pa.chunked_array(shard.rows(0, shard.num_rows, USER_COLUMN), type=pa.string())
        owner = pc.take(index_users, pa.array(np.repeat(np.arange(n_users), counts)))
        mismatch = pc.invert(pc.equal(row_users, owner)) if shard.num_rows else None
        if mismatch is not None and pc.any(mismatch).as_py():
            row = int(pc.index(mismatch, True).as_py())
            raise ShardIntegrityError(f"{path}: row {row}'s user_id does not match {index_path}")
        token_pieces = shard.rows(0, shard.num_rows, TOKENS_COLUMN)
        lengths = np.concatenate(
            [pc.list_value_length(p).to_numpy(zero_copy_only=False) for p in token_pieces]
            or [np.zeros(0, np.int64)]
        )
        per_user = np.add.reduceat(lengths, expected_starts) if n_users else lengths
        if not np.array_equal(per_user, index.column("n_tokens").to_numpy()):
            raise ShardIntegrityError(
                f"{index_path}: n_tokens do not match the token lists in {path}"
            )
        if int(lengths.sum()) != entry.num_tokens:
            raise ShardIntegrityError(f"{path}: token count does not match the manifest")
        for user in index_users.to_pylist():
            if (
                manifest.user_shards.get(user) != position
                or shard_of_user(user, manifest.num_shards) != position
            ):
                raise ShardIntegrityError(
                    f"{index_path}: user {user!r} is not assigned to {entry.name} by the manifest "
                    "or by the stable user hash"
                )
    finally:
        shard.close()
