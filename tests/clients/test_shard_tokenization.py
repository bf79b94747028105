"""Offline tokenizers: byte round trip on Arrow slices, BPE/transformers saved and hash-checked."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest
from userdp.clients.shard_format import ShardIntegrityError
from userdp.clients.tokenization import ByteTokenizer, load_tokenizer

from userdp.shards.input import InputSource
from userdp.shards.tokenization import parse_tokenizer_spec
from userdp.shards.writer import ShardOptions, write_shards

TEXTS = ["hello world", "naïve café ✓", "日本語のテキスト", "a"]


def test_byte_tokenizer_round_trip_on_sliced_arrays() -> None:
    tokenizer = ByteTokenizer()
    array = pa.array(["skip me"] + TEXTS)
    ids = tokenizer.encode_arrow(array.slice(1))
    assert ids.type == pa.list_(pa.int32())
    assert [tokenizer.decode(row) for row in ids.to_pylist()] == TEXTS
    assert ids[0].as_py() == [b + 3 for b in b"hello world"]
    assert max(max(row) for row in ids.to_pylist()) < tokenizer.info.vocab_size


def _shard_with(tmp_path: Path, spec: str) -> Path:
    table = pa.table({"user": ["a", "b", "a", "c"] * 20, "text": TEXTS * 20})
    out = tmp_path / "out"
    write_shards(
        InputSource.from_table(table, "user", "text", "t"),
        out,
        ShardOptions(num_shards=2, tokenizer=spec, progress=False),
    )
    return out


def test_bpe_is_trained_saved_and_reloaded(tmp_path: Path) -> None:
    out = _shard_with(tmp_path, "bpe:300")
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    tokenizer = load_tokenizer(out)
    assert tokenizer.info.kind == "bpe" and tokenizer.info.vocab_size <= 300
    for text in TEXTS:
        ids = tokenizer.encode_arrow(pa.array([text]))[0].as_py()
        assert tokenizer.decode(ids) == text
    (out / "tokenizer" / "tokenizer.json").write_text("{}")
    with pytest.raises(ShardIntegrityError, match="does not match the manifest"):
        load_tokenizer(out)


def test_local_transformers_tokenizer_directory(tmp_path: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    trained = load_tokenizer(_shard_with(tmp_path / "first", "bpe:300"))
    wrapped = PreTrainedTokenizerFast(
        tokenizer_file=str(tmp_path / "first" / "out" / "tokenizer" / "tokenizer.json"),
        eos_token="<eos>",
        pad_token="<pad>",
    )
    wrapped.save_pretrained(tmp_path / "hf")
    out = _shard_with(tmp_path / "second", str(tmp_path / "hf"))
    tokenizer = load_tokenizer(out)
    assert tokenizer.info.kind == "transformers"
    assert tokenizer.info.eos_id == wrapped.eos_token_id
    encoded = tokenizer.encode_arrow(pa.array(TEXTS))
    assert encoded.to_pylist() == trained.encode_arrow(pa.array(TEXTS)).to_pylist()


@pytest.mark.parametrize("spec", ["bpe:10", "bpe:x", "word", "/nonexistent/dir"])
def test_bad_tokenizer_spec_names_the_flag(spec: str) -> None:
    with pytest.raises(ValueError, match="--tokenizer"):
        parse_tokenizer_spec(spec)
