"""The on-disk format of user-partitioned shards (schema version 1), shared by writer and reader.

A shard directory holds ``manifest.json`` plus, per shard, two Arrow IPC *file* format files
(uncompressed, so a memory-mapped read of one user's rows is zero-copy and O(that user)):

- ``shard-NNNNN.arrow``: one row per example, rows grouped by user. Columns ``user_id`` (string),
  ``input_ids`` (list<int32> token ids) and, when the writer kept it, ``text`` (string).
- ``shard-NNNNN.index.arrow``: one row per user: ``user_id``, ``row_start`` (first row in the
  shard file), ``n_examples``, ``n_tokens``. Users' row ranges are contiguous and cover the file.

A user belongs to shard ``user_hash(user_id) % num_shards`` where ``user_hash`` is the first 8
bytes of sha256(user_id as UTF-8), big-endian: stable across machines, Python versions and runs.
Inside a shard, users are ordered by (user_hash, user_id); a user's examples keep input order.

Compatibility rule: a field's meaning never changes within a schema version; a reader refuses a
manifest whose ``schema_version`` is newer than :data:`SCHEMA_VERSION`. The full spec is docs/data.md.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

FORMAT_NAME = "userdp-shards"
SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
TOKENIZER_DIR = "tokenizer"

USER_COLUMN = "user_id"
TOKENS_COLUMN = "input_ids"
TEXT_COLUMN = "text"
TOKEN_TYPE = pa.int32()

INDEX_SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.string(), nullable=False),
        pa.field("row_start", pa.int64(), nullable=False),
        pa.field("n_examples", pa.int64(), nullable=False),
        pa.field("n_tokens", pa.int64(), nullable=False),
    ]
)

SHARD_ASSIGNMENT = "int.from_bytes(sha256(user_id.encode('utf-8'))[:8], 'big') % num_shards"


class ShardError(ValueError):
    """Base class: something about a shard directory or its input is wrong (the CLI exits 2)."""


class ManifestError(ShardError):
    """manifest.json is missing, malformed, or from a newer schema version."""


class ShardIntegrityError(ShardError):
    """A shard or index file does not match the manifest (hash, row counts, index bounds)."""


class ShardsGoneError(ShardError):
    """A shard folder, or a file of it, vanished while a run used it (deleted or moved)."""


class InputDataError(ShardError):
    """The raw input of ``userdp shard`` is unusable (missing column, null user id, bad UTF-8...)."""


def shard_schema(with_text: bool) -> pa.Schema:
    """Arrow schema of a shard file."""
    fields = [
        pa.field(USER_COLUMN, pa.string(), nullable=False),
        pa.field(TOKENS_COLUMN, pa.list_(TOKEN_TYPE), nullable=False),
    ]
    if with_text:
        fields.append(pa.field(TEXT_COLUMN, pa.string(), nullable=False))
    return pa.schema(fields)


def shard_name(index: int) -> str:
    return f"shard-{index:05d}"


def user_hash(user_id: str) -> int:
    """Stable 64-bit hash of a user id: first 8 bytes of its sha256, big-endian."""
    return int.from_bytes(hashlib.sha256(user_id.encode("utf-8")).digest()[:8], "big")


def shard_of_user(user_id: str, num_shards: int) -> int:
    """The shard a user belongs to (see the module docstring)."""
    return user_hash(user_id) % num_shards


def file_sha256(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class ShardEntry:
    """One shard as the manifest records it."""

    name: str
    file: str
    sha256: str
    num_bytes: int
    index_file: str
    index_sha256: str
    num_users: int
    num_examples: int
    num_tokens: int


@dataclass(frozen=True)
class TokenizerInfo:
    """Which tokenizer produced ``input_ids``: ``kind`` byte|bpe|tokenizers|transformers."""

    kind: str
    id: str
    sha256: str
    vocab_size: int
    eos_id: int | None
    pad_id: int | None
    path: str | None  # directory relative to the shard dir; None for the file-less byte tokenizer


@dataclass(frozen=True)
class Manifest:
    """Parsed ``manifest.json``. ``user_shards`` maps user id -> index into ``shards``."""

    schema_version: int
    dataset_name: str
    created_by: str
    source: dict[str, Any]
    tokenizer: TokenizerInfo
    has_text: bool
    max_examples_per_user: int | None
    num_shards: int
    shards: tuple[ShardEntry, ...]
    total_users: int
    total_examples: int
    total_tokens: int
    examples_per_user: dict[str, float]
    user_shards: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT_NAME,
            "schema_version": self.schema_version,
            "dataset_name": self.dataset_name,
            "created_by": self.created_by,
            "source": self.source,
            "tokenizer": self.tokenizer.__dict__,
            "columns": {
                USER_COLUMN: "string",
                TOKENS_COLUMN: "list<int32>",
                **({TEXT_COLUMN: "string"} if self.has_text else {}),
            },
            "has_text": self.has_text,
            "max_examples_per_user": self.max_examples_per_user,
            "shard_assignment": SHARD_ASSIGNMENT,
            "num_shards": self.num_shards,
            "shards": [entry.__dict__ for entry in self.shards],
            "totals": {
                "users": self.total_users,
                "examples": self.total_examples,
                "tokens": self.total_tokens,
            },
            "examples_per_user": self.examples_per_user,
            "user_shards": self.user_shards,
        }


def write_manifest(manifest: Manifest, directory: Path) -> None:
    path = Path(directory) / MANIFEST_NAME
    path.write_text(json.dumps(manifest.to_json(), indent=1) + "\n", encoding="utf-8")


def read_manifest(directory: str | Path) -> Manifest:
    """Parse and check ``DIR/manifest.json``; :class:`ManifestError` names the file and the field."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(
            f"{path}: not found; is {directory} a directory written by userdp shard?"
        )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT_NAME:
        raise ManifestError(f"{path}: 'format' must be {FORMAT_NAME!r}")
    version = raw.get("schema_version")
    if not isinstance(version, int) or version < 1:
        raise ManifestError(f"{path}: 'schema_version' must be a positive integer, got {version!r}")
    if version > SCHEMA_VERSION:
        raise ManifestError(
            f"{path}: schema_version {version} is newer than this userdp supports "
            f"({SCHEMA_VERSION}); upgrade userdp to read it"
        )
    try:
        manifest = Manifest(
            schema_version=version,
            dataset_name=str(raw["dataset_name"]),
            created_by=str(raw["created_by"]),
            source=dict(raw["source"]),
            tokenizer=TokenizerInfo(**raw["tokenizer"]),
            has_text=bool(raw["has_text"]),
            max_examples_per_user=raw["max_examples_per_user"],
            num_shards=int(raw["num_shards"]),
            shards=tuple(ShardEntry(**entry) for entry in raw["shards"]),
            total_users=int(raw["totals"]["users"]),
            total_examples=int(raw["totals"]["examples"]),
            total_tokens=int(raw["totals"]["tokens"]),
            examples_per_user=dict(raw["examples_per_user"]),
            user_shards={str(k): int(v) for k, v in raw["user_shards"].items()},
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ManifestError(f"{path}: missing or malformed field ({exc!r})") from exc
    if len(manifest.shards) != manifest.num_shards:
        raise ManifestError(
            f"{path}: num_shards is {manifest.num_shards} but {len(manifest.shards)} shards are listed"
        )
    return manifest
