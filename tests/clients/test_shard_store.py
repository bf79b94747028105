"""ShardStore: per-user round trip, counts without rows, subsets, O(user) reads, verify()."""

from __future__ import annotations

import json
import tracemalloc
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from userdp.clients import shard_store
from userdp.clients.shard_format import (
    INDEX_SCHEMA,
    MANIFEST_NAME,
    SCHEMA_VERSION,
    ManifestError,
    ShardIntegrityError,
    file_sha256,
    read_manifest,
    shard_of_user,
    user_hash,
)
from userdp.clients.shard_store import ShardStore
from userdp.clients.tokenization import ByteTokenizer

from userdp.shards.input import InputSource
from userdp.shards.writer import ShardOptions, write_shards


def _table(num_users: int = 23, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    users, texts = [], []
    for row in range(400):
        u = int(rng.integers(num_users))
        users.append(f"u{u}")
        texts.append(f"row {row} of user {u}: " + "é✓x" * int(rng.integers(1, 9)))
    return pa.table({"user": users, "body": texts})


def _write(table: pa.Table, out: Path, **options) -> Path:
    source = InputSource.from_table(table, "user", "body", "test")
    write_shards(source, out, ShardOptions(progress=False, **options))
    return out


@pytest.fixture()
def shards(tmp_path: Path) -> tuple[Path, pa.Table]:
    table = _table()
    return _write(table, tmp_path / "shards", num_shards=3, keep_text=True), table


def _per_user(table: pa.Table) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = defaultdict(list)
    for user, text in zip(table["user"].to_pylist(), table["body"].to_pylist(), strict=True):
        grouped[user].append(text)
    return grouped


def test_round_trip_tokens_and_texts_per_user(shards) -> None:
    directory, table = shards
    expected = _per_user(table)
    tokenizer = ByteTokenizer()
    with ShardStore(directory) as store:
        assert set(store.users()) == set(expected)
        for user, texts in expected.items():
            examples = store.user_examples(user)
            assert store.user_texts(user) == texts  # input order kept
            assert [tokenizer.decode(e) for e in examples] == texts
            for example, text in zip(examples, texts, strict=True):
                assert example.dtype == np.int32
                assert np.array_equal(example, np.frombuffer(text.encode(), np.uint8) + 3)


def test_user_counts_read_only_the_index(shards, monkeypatch) -> None:
    directory, table = shards
    expected = _per_user(table)

    def no_rows(*args, **kwargs):
        raise AssertionError("user_counts must not open shard row files")

    monkeypatch.setattr(shard_store, "_OpenShard", no_rows)
    counts = ShardStore(directory).user_counts()
    assert {u: c.n_examples for u, c in counts.items()} == {u: len(t) for u, t in expected.items()}
    assert {u: c.n_tokens for u, c in counts.items()} == {
        u: sum(len(t.encode()) for t in texts) for u, texts in expected.items()
    }


def test_assignment_is_the_stable_hash_and_pinned() -> None:
    # Pinned literals: changing the hash would silently reshuffle every existing shard directory.
    assert user_hash("alice") == 3159282601090220207  # sha256("alice")[:8] = 2bd806c97f0e00af
    assert [shard_of_user(u, 7) for u in ("alice", "bob", "42", "")] == [1, 1, 2, 1]


def test_manifest_map_matches_hash_and_subset_owns_only_its_shards(shards) -> None:
    directory, _ = shards
    store = ShardStore(directory)
    manifest = store.manifest
    for user, position in manifest.user_shards.items():
        assert position == shard_of_user(user, manifest.num_shards)
    owned = store.subset(["shard-00001"])
    assert owned.shard_names == ["shard-00001"]
    mine = set(owned.user_counts())
    assert mine == {u for u, p in manifest.user_shards.items() if p == 1}
    foreign = next(u for u, p in manifest.user_shards.items() if p != 1)
    with pytest.raises(KeyError, match="does not own"):
        owned.user_examples(foreign)
    with pytest.raises(ValueError, match="unknown shard"):
        store.subset(["shard-00099"])


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


def _mapped_kib(file_name: str) -> int:
    """Resident KiB of this process's mappings of ``file_name`` (from /proc/self/smaps)."""
    total, current = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            current = line.endswith(file_name)
        elif current and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_reading_one_user_is_o_user(tmp_path: Path) -> None:
    """A 1-example user at the end of a ~60 MB shard: the read touches a few pages of the mapped
    file and raises neither Arrow's, Python's nor the process's peak memory by more than a few MB
    (a read_all of the file, mapped or not, would add ~60 MB)."""
    n_rows = 150_000
    users = ["big"] * (n_rows - 1) + ["small"]
    texts = pa.array(["x" * 100] * (n_rows - 1) + ["hello"])
    directory = _write(pa.table({"user": users, "body": texts}), tmp_path / "big", num_shards=1)
    shard_bytes = (directory / "shard-00000.arrow").stat().st_size
    assert shard_bytes > 50e6
    store = ShardStore(directory)
    store.user_counts()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (peak RSS) to the current RSS
        can_reset_peak = True
    except OSError:
        can_reset_peak = False
    rss_before = _status_kib("VmRSS")
    arrow_before = pa.total_allocated_bytes()
    tracemalloc.start()
    examples = store.user_examples("small")
    _, python_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert [e.tolist() for e in examples] == [[b + 3 for b in b"hello"]]
    assert pa.total_allocated_bytes() - arrow_before < 1 << 20
    assert python_peak < 1 << 20
    assert _mapped_kib("shard-00000.arrow") * 1024 < shard_bytes / 10
    if can_reset_peak:
        assert (_status_kib("VmHWM") - rss_before) * 1024 < 8 << 20


def _corrupt_byte(path: Path, position: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_passes_on_a_fresh_directory(shards) -> None:
    directory, table = shards
    report = ShardStore(directory).verify()
    assert (report.shards, report.examples) == (3, table.num_rows)


def test_verify_names_a_shard_whose_sha256_differs(shards) -> None:
    directory, _ = shards
    target = directory / "shard-00002.arrow"
    _corrupt_byte(target, target.stat().st_size // 2)
    with pytest.raises(ShardIntegrityError, match=r"shard-00002\.arrow: sha256"):
        ShardStore(directory).verify()


def test_truncated_arrow_file_is_named_on_verify_and_on_read(shards) -> None:
    directory, _ = shards
    target = directory / "shard-00000.arrow"
    target.write_bytes(target.read_bytes()[:-100])
    with pytest.raises(ShardIntegrityError, match=r"shard-00000\.arrow"):
        ShardStore(directory).verify()
    store = ShardStore(directory)
    user = next(u for u, p in store.manifest.user_shards.items() if p == 0)
    with pytest.raises(ShardIntegrityError, match=r"shard-00000\.arrow: not a readable Arrow"):
        store.user_examples(user)


def test_missing_shard_file_is_named(shards) -> None:
    directory, _ = shards
    (directory / "shard-00001.index.arrow").unlink()
    with pytest.raises(ShardIntegrityError, match=r"shard-00001\.index\.arrow: missing"):
        ShardStore(directory).verify()


def _rewrite_index(directory: Path, name: str, change) -> None:
    """Tamper with an index and fix its hash in the manifest, so only the deep checks can fail."""
    path = directory / f"{name}.index.arrow"
    with pa.memory_map(str(path)) as source:
        table = ipc.open_file(source).read_all()
    table = change(table.to_pydict())
    with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, INDEX_SCHEMA) as writer:
        writer.write_table(pa.table(table, schema=INDEX_SCHEMA))
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    for entry in manifest["shards"]:
        if entry["name"] == name:
            entry["index_sha256"] = file_sha256(path)
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda t: {**t, "n_tokens": [n + 1 for n in t["n_tokens"]]}, "n_tokens"),
        (lambda t: {**t, "row_start": [s + 1 for s in t["row_start"]]}, "contiguous"),
        (lambda t: {**t, "user_id": list(reversed(t["user_id"]))}, "user_id does not match"),
    ],
)
def test_verify_checks_index_contents(shards, change, message) -> None:
    directory, _ = shards
    _rewrite_index(directory, "shard-00001", change)
    with pytest.raises(ShardIntegrityError, match=message):
        ShardStore(directory).verify()


def test_manifest_from_a_newer_schema_is_refused(shards) -> None:
    directory, _ = shards
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    manifest["schema_version"] = SCHEMA_VERSION + 1
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="newer than this userdp supports"):
        ShardStore(directory)


def test_malformed_or_missing_manifest(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="not found"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_manifest(tmp_path)
    (tmp_path / MANIFEST_NAME).write_text(
        json.dumps({"format": "userdp-shards", "schema_version": 1})
    )
    with pytest.raises(ManifestError, match="missing or malformed"):
        read_manifest(tmp_path)
