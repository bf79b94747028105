"""Offline tokenizers and the loader workers use: ``load_tokenizer(shard_dir)``.

Three kinds, all without network access:

- ``byte``: UTF-8 bytes shifted by 3 (ids 0/1/2 = pad/eos/unk, byte b -> b + 3, vocab 259). Needs
  no files; the same id layout as ByT5 without its extra ids. Encoding is vectorized over Arrow.
- ``bpe`` / ``tokenizers``: a ``tokenizers.Tokenizer`` stored as ``tokenizer/tokenizer.json`` next
  to the manifest (``userdp shard --tokenizer bpe:N`` trains one on the input).
- ``transformers``: a local ``transformers`` tokenizer directory copied to ``tokenizer/``.

Shards store the text's tokens only: no BOS/EOS is added at write time; training code appends
``eos_id`` where it wants a document boundary.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
from userdp.clients.shard_format import (
    TOKEN_TYPE,
    TOKENIZER_DIR,
    ShardIntegrityError,
    TokenizerInfo,
    read_manifest,
)

BYTE_TOKENIZER_ID = "byte-v1"
BYTE_OFFSET = 3


class Tokenizer(Protocol):
    """What the shard writer and the workers need from a tokenizer."""

    info: TokenizerInfo

    def encode_arrow(self, texts: pa.Array) -> pa.ListArray:
        """Token ids (list<int32>) for a non-null string array, no special tokens added."""
        ...

    def decode(self, ids: Sequence[int] | np.ndarray) -> str: ...


def _list_array(lengths: np.ndarray, values: np.ndarray) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=TOKEN_TYPE))


class ByteTokenizer:
    """UTF-8 bytes + 3; see the module docstring."""

    def __init__(self) -> None:
        spec = json.dumps({"id": BYTE_TOKENIZER_ID, "offset": BYTE_OFFSET, "vocab": 259})
        self.info = TokenizerInfo(
            kind="byte",
            id=BYTE_TOKENIZER_ID,
            sha256=hashlib.sha256(spec.encode()).hexdigest(),
            vocab_size=256 + BYTE_OFFSET,
            eos_id=1,
            pad_id=0,
            path=None,
        )

    def encode_arrow(self, texts: pa.Array) -> pa.ListArray:
        binary = texts.cast(pa.large_binary())
        offsets_buf, data_buf = binary.buffers()[1], binary.buffers()[2]
        offsets = np.frombuffer(offsets_buf, dtype=np.int64)[
            binary.offset : binary.offset + len(binary) + 1
        ]
        data = (
            np.frombuffer(data_buf, dtype=np.uint8)
            if data_buf is not None
            else np.zeros(0, np.uint8)
        )
        values = data[offsets[0] : offsets[-1]].astype(np.int32) + BYTE_OFFSET
        return _list_array(np.diff(offsets), values)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        raw = bytes(int(i) - BYTE_OFFSET for i in ids if int(i) >= BYTE_OFFSET)
        return raw.decode("utf-8", errors="replace")


class TokenizersTokenizer:
    """A ``tokenizers.Tokenizer`` loaded from ``tokenizer.json`` (the BPE we train is one)."""

    def __init__(self, tokenizer_file: Path, info: TokenizerInfo) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        self._tokenizer = HFTokenizer.from_file(str(tokenizer_file))
        self.info = info

    def encode_arrow(self, texts: pa.Array) -> pa.ListArray:
        encodings = self._tokenizer.encode_batch(texts.to_pylist(), add_special_tokens=False)
        return _ids_to_list_array([e.ids for e in encodings])

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tokenizer.decode([int(i) for i in ids])


class TransformersTokenizer:
    """A local ``transformers`` tokenizer directory (never downloads)."""

    def __init__(self, directory: Path, info: TokenizerInfo) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        self.info = info

    def encode_arrow(self, texts: pa.Array) -> pa.ListArray:
        ids = self._tokenizer(texts.to_pylist(), add_special_tokens=False)["input_ids"]
        return _ids_to_list_array(ids)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        return self._tokenizer.decode([int(i) for i in ids])


def _ids_to_list_array(ids: list[list[int]]) -> pa.ListArray:
    lengths = np.fromiter((len(row) for row in ids), dtype=np.int64, count=len(ids))
    flat = [token for row in ids for token in row]
    return _list_array(lengths, np.asarray(flat, dtype=np.int32))


def directory_sha256(directory: Path) -> str:
    """sha256 over the sorted (relative name, content) pairs of a tokenizer directory."""
    digest = hashlib.sha256()
    for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
        digest.update(path.relative_to(directory).as_posix().encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def tokenizer_from_info(info: TokenizerInfo, shard_dir: Path) -> Tokenizer:
    """Instantiate the tokenizer a manifest describes, checking its files' hash."""
    if info.kind == "byte":
        tokenizer = ByteTokenizer()
        if tokenizer.info.sha256 != info.sha256:
            raise ShardIntegrityError(f"{shard_dir}: byte tokenizer hash differs from the manifest")
        return tokenizer
    if info.path is None:
        raise ShardIntegrityError(f"{shard_dir}: tokenizer kind {info.kind!r} needs a path")
    directory = Path(shard_dir) / info.path
    if not directory.is_dir():
        raise ShardIntegrityError(f"{directory}: tokenizer directory is missing")
    actual = directory_sha256(directory)
    if actual != info.sha256:
        raise ShardIntegrityError(
            f"{directory}: sha256 {actual[:12]}... does not match the manifest ({info.sha256[:12]}...)"
        )
    if info.kind in ("bpe", "tokenizers"):
        return TokenizersTokenizer(directory / "tokenizer.json", info)
    if info.kind == "transformers":
        return TransformersTokenizer(directory, info)
    raise ShardIntegrityError(f"{shard_dir}: unknown tokenizer kind {info.kind!r}")


def load_tokenizer(shard_dir: str | Path) -> Tokenizer:
    """The tokenizer that produced a shard directory's ``input_ids`` (hash-checked)."""
    return tokenizer_from_info(read_manifest(shard_dir).tokenizer, Path(shard_dir))


__all__ = [
    "BYTE_TOKENIZER_ID",
    "ByteTokenizer",
    "TOKENIZER_DIR",
    "Tokenizer",
    "TokenizersTokenizer",
    "TransformersTokenizer",
    "directory_sha256",
    "load_tokenizer",
    "tokenizer_from_info",
]
