"""``userdp shard``: round trip for every input format, bad input, atomicity, verify, argparse."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from userdp.clients.shard_store import ShardStore

from userdp.cli import main
from userdp.shards.input import InputSource
from userdp.shards.writer import ShardOptions, write_shards


def _rows(n: int = 300, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    tricky = ['comma, "quote"', "new\nline", "tab\tand ünïcödé ✓", "emoji 🙂", " leading space"]
    return [
        {
            "uid": f"user{int(rng.zipf(1.5)) % 40}",
            "text": f"{i}: {tricky[i % len(tricky)]} " + "w" * int(rng.integers(0, 30)),
            "extra": i,
        }
        for i in range(n)
    ]


def _write_input(rows: list[dict], directory: Path, fmt: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(rows)
    if fmt == "parquet":
        path = directory / "data.parquet"
        pq.write_table(table, path, row_group_size=64)
    elif fmt == "parquet-dir":
        path = directory / "pq"
        path.mkdir()
        pq.write_table(table.slice(0, 100), path / "part-0.parquet")
        pq.write_table(table.slice(100), path / "part-1.parquet")
    elif fmt == "jsonl":
        path = directory / "data.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), "utf-8")
    elif fmt == "csv":
        path = directory / "data.csv"
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif fmt == "arrow":
        path = directory / "data.arrow"
        with pa.OSFile(str(path), "wb") as sink, ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=50)
    elif fmt == "datasets":  # the layout of datasets' save_to_disk: IPC stream files + state.json
        path = directory / "saved"
        path.mkdir()
        names = ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
        for name, part in zip(names, (table.slice(0, 120), table.slice(120)), strict=True):
            with pa.OSFile(str(path / name), "wb") as sink, ipc.new_stream(sink, table.schema) as w:
                w.write_table(part, max_chunksize=40)
        state = {"_data_files": [{"filename": n} for n in names], "_fingerprint": "x"}
        (path / "state.json").write_text(json.dumps(state))
        (path / "dataset_info.json").write_text("{}")
    else:
        raise AssertionError(fmt)
    return path


def _shard(input_path: Path, out: Path, *extra: str) -> int:
    argv = ["shard", str(input_path), "--user-column", "uid", "--text-column", "text"]
    return main([*argv, "--out", str(out), "--quiet", *extra])


def _grouped(rows: list[dict]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = defaultdict(list)
    for row in rows:
        grouped[str(row["uid"])].append(row["text"])
    return grouped


@pytest.mark.parametrize("fmt", ["parquet", "parquet-dir", "jsonl", "csv", "arrow", "datasets"])
def test_round_trip_every_input_format(tmp_path: Path, fmt: str, capsys) -> None:
    rows = _rows()
    path = _write_input(rows, tmp_path / "in", fmt)
    out = tmp_path / "shards"
    assert _shard(path, out, "--num-shards", "3", "--keep-text") == 0
    expected = _grouped(rows)
    store = ShardStore(out)
    assert sorted(store.users()) == sorted(expected)
    for user, texts in expected.items():
        assert store.user_texts(user) == texts
        assert [
            bytes((e - 3).astype(np.uint8)).decode() for e in store.user_examples(user)
        ] == texts
    store.verify()
    summary = capsys.readouterr().out
    counts = sorted(len(t) for t in expected.values())
    assert f"users: {len(expected)}   examples: {len(rows)}" in summary
    assert f"min {counts[0]}" in summary and f"max {counts[-1]}" in summary


def test_integer_user_ids_become_strings(tmp_path: Path) -> None:
    rows = [{"uid": i % 5, "text": f"t{i}"} for i in range(20)]
    out = tmp_path / "out"
    assert _shard(_write_input(rows, tmp_path, "parquet"), out) == 0
    assert sorted(ShardStore(out).users()) == ["0", "1", "2", "3", "4"]


def test_output_does_not_depend_on_partition_granularity(tmp_path: Path) -> None:
    """Tiny buckets force the multi-bucket external partition; the shards must be byte-identical."""
    rows = _rows(2000, seed=5)
    table = pa.Table.from_pylist(rows)
    digests = []
    for name, bucket_bytes in (("one", 1 << 30), ("many", 2_000)):
        source = InputSource.from_table(table, "uid", "text", "t")
        options = ShardOptions(num_shards=2, progress=False, bucket_bytes=bucket_bytes)
        write_shards(source, tmp_path / name, options)
        digests.append([s.sha256 for s in ShardStore(tmp_path / name).manifest.shards])
    assert digests[0] == digests[1]


def test_max_examples_per_user_keeps_the_first_k(tmp_path: Path, capsys) -> None:
    rows = _rows()
    out = tmp_path / "out"
    assert (
        _shard(
            _write_input(rows, tmp_path, "jsonl"),
            out,
            "--max-examples-per-user",
            "2",
            "--keep-text",
        )
        == 0
    )
    store = ShardStore(out)
    for user, texts in _grouped(rows).items():
        assert store.user_texts(user) == texts[:2]
    assert store.manifest.max_examples_per_user == 2
    assert "dropped by --max-examples-per-user" in capsys.readouterr().out


def _assert_failed_cleanly(tmp_path: Path, out: Path, code: int, capsys, *fragments: str) -> None:
    assert code == 2
    err = capsys.readouterr().err
    for fragment in fragments:
        assert fragment in err, err
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv", "arrow"])
def test_missing_column_names_the_file_and_column(tmp_path: Path, fmt: str, capsys) -> None:
    path = _write_input([{"uid": "a", "body": "x"}], tmp_path / "in", fmt)
    out = tmp_path / "out"
    code = _shard(path, out)
    _assert_failed_cleanly(tmp_path, out, code, capsys, path.name, "'text'")


def test_null_user_id_names_the_row(tmp_path: Path, capsys) -> None:
    rows = [{"uid": "a", "text": "x"}] * 10 + [{"uid": None, "text": "y"}]
    path = _write_input(rows, tmp_path / "in", "parquet")
    code = _shard(path, tmp_path / "out")
    _assert_failed_cleanly(tmp_path, tmp_path / "out", code, capsys, "data.parquet: row 10", "null")


def test_empty_text_names_the_row(tmp_path: Path, capsys) -> None:
    rows = [{"uid": "a", "text": "x"}] * 3 + [{"uid": "b", "text": ""}]
    path = _write_input(rows, tmp_path / "in", "csv")
    code = _shard(path, tmp_path / "out")
    _assert_failed_cleanly(tmp_path, tmp_path / "out", code, capsys, "data.csv: row 3", "empty")


def test_empty_text_in_jsonl_names_the_line(tmp_path: Path, capsys) -> None:
    rows = [{"uid": "a", "text": "x"}, {"uid": "b", "text": ""}]
    path = _write_input(rows, tmp_path / "in", "jsonl")
    code = _shard(path, tmp_path / "out")
    _assert_failed_cleanly(tmp_path, tmp_path / "out", code, capsys, "data.jsonl: line 2", "empty")


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_non_utf8_names_the_line_or_row(tmp_path: Path, fmt: str, capsys) -> None:
    tmp_path.joinpath("in").mkdir()
    if fmt == "jsonl":
        path = tmp_path / "in" / "bad.jsonl"
        path.write_bytes(b'{"uid": "a", "text": "ok"}\n{"uid": "b", "text": "bad \xff"}\n')
        where = "bad.jsonl: line 2"
    elif fmt == "csv":
        path = tmp_path / "in" / "bad.csv"
        path.write_bytes(b"uid,text\na,ok\nb,also ok\nc,bad \xff byte\n")
        where = "bad.csv: line 4"
    else:
        path = tmp_path / "in" / "bad.parquet"
        table = pa.table(
            {"uid": ["a", "b", "c"], "text": pa.array([b"ok", b"ok", b"\xff"], pa.binary())}
        )
        pq.write_table(table, path)
        where = "bad.parquet: row 2"
    code = _shard(path, tmp_path / "out")
    _assert_failed_cleanly(tmp_path, tmp_path / "out", code, capsys, where, "UTF-8")


def test_out_must_be_new(tmp_path: Path, capsys) -> None:
    path = _write_input(_rows(10), tmp_path / "in", "parquet")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert _shard(path, out) == 2
    assert "--out" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"


def test_verify_ok_and_corrupt(tmp_path: Path, capsys) -> None:
    out = tmp_path / "demo"
    assert main(["shard", "--demo", str(out), "--demo-users", "30", "--quiet"]) == 0
    assert main(["shard", "verify", str(out)]) == 0
    assert "ok (4 shards, 30 users" in capsys.readouterr().out
    target = out / "shard-00001.arrow"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 1
    target.write_bytes(bytes(data))
    assert main(["shard", "verify", str(out)]) == 2
    assert "shard-00001.arrow: sha256" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["shard", "verify"], "DIR is missing"),
        (["shard", "verify", "d", "--out", "x"], "takes no other options; remove --out"),
        (["shard", "in.parquet", "--user-column", "u"], "--text-column, --out"),
        (["shard", "a", "b", "--user-column", "u"], "unexpected second argument"),
        (["shard", "--demo", "x", "--out", "y"], "--demo OUT"),
        (
            [
                "shard",
                "in.parquet",
                "--user-column",
                "u",
                "--text-column",
                "t",
                "--out",
                "o",
                "--tokenizer",
                "bpe:7",
            ],
            "--tokenizer",
        ),
    ],
)
def test_argument_errors_exit_2(
    tmp_path: Path, argv: list[str], message: str, capsys, monkeypatch
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "in.parquet").write_bytes(b"")
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_console_script_demo_then_verify(tmp_path: Path) -> None:
    userdp = str(Path(sys.executable).parent / "userdp")
    out = tmp_path / "demo"
    result = subprocess.run([userdp, "shard", "--demo", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "users: 400" in result.stdout and "median" in result.stdout
    assert "tokenize" in result.stderr  # the progress bar goes to stderr
    result = subprocess.run([userdp, "shard", "verify", str(out)], capture_output=True, text=True)
    assert result.returncode == 0 and "ok" in result.stdout


def test_deterministic_output(tmp_path: Path) -> None:
    for name in ("a", "b"):
        assert main(["shard", "--demo", str(tmp_path / name), "--demo-users", "50", "--quiet"]) == 0
    manifests = [json.loads((tmp_path / n / "manifest.json").read_text()) for n in ("a", "b")]
    assert manifests[0]["shards"] == manifests[1]["shards"]


def test_unreadable_input_file_is_named(tmp_path: Path, capsys) -> None:
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    code = _shard(path, tmp_path / "out")
    _assert_failed_cleanly(tmp_path, tmp_path / "out", code, capsys, "broken.parquet: cannot read")


def test_bpe_tokenizer_from_the_command_line(tmp_path: Path) -> None:
    from userdp.clients.tokenization import load_tokenizer

    rows = _rows(200)
    out = tmp_path / "out"
    path = _write_input(rows, tmp_path / "in", "jsonl")
    assert _shard(path, out, "--tokenizer", "bpe:320", "--num-shards", "2") == 0
    assert main(["shard", "verify", str(out)]) == 0
    tokenizer = load_tokenizer(out)
    assert tokenizer.info.id == "bpe:320"
    store = ShardStore(out)
    for user, texts in _grouped(rows).items():
        assert [tokenizer.decode(e) for e in store.user_examples(user)] == texts


def test_dictionary_encoded_columns_and_lone_surrogates(tmp_path: Path, capsys) -> None:
    users = pa.array(["a", "b", "a"]).dictionary_encode()
    texts = pa.array(["x", "y", "z"]).dictionary_encode()
    path = tmp_path / "cat.parquet"
    pq.write_table(pa.table({"uid": users, "text": texts}), path)
    out = tmp_path / "out"
    assert _shard(path, out, "--keep-text") == 0
    assert ShardStore(out).user_texts("a") == ["x", "z"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"uid": "a", "text": "ok"}\n{"uid": "a", "text": "\\ud800"}\n')
    code = _shard(bad, tmp_path / "out2")
    _assert_failed_cleanly(tmp_path, tmp_path / "out2", code, capsys, "bad.jsonl: line 2", "UTF-8")
