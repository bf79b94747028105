"""Streaming readers for ``userdp shard`` inputs: Parquet, JSONL, CSV, Arrow / ``datasets`` dirs.

Every reader yields :class:`InputBatch` es of (user id, text) with the file and first row they
came from, so a bad row is reported as ``FILE: row N`` (0-based data row; JSONL says ``line N``,
1-based). Memory is bounded by the batch size, never by the input size.

A ``datasets`` directory (``Dataset.save_to_disk``) holds Arrow IPC *stream* files; they are read
with pyarrow directly (the ``datasets`` package is not needed). Point INPUT at one split's directory.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from userdp.clients.shard_format import InputDataError

FORMATS = ("auto", "parquet", "jsonl", "csv", "arrow")
_SUFFIXES = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".ndjson": "jsonl",
    ".csv": "csv",
    ".arrow": "arrow",
    ".feather": "arrow",
    ".ipc": "arrow",
}


@dataclass(frozen=True)
class InputBatch:
    file: str
    first_row: int
    user: pa.Array  # string, no nulls, no empty ids
    text: pa.Array  # string, valid UTF-8, no nulls, no empty texts


class InputSource:
    """Re-iterable stream of checked (user id, text) batches from files or an in-memory table."""

    def __init__(
        self,
        files: list[Path] | None,
        fmt: str,
        user_column: str,
        text_column: str,
        batch_size: int = 8192,
        table: pa.Table | None = None,
        name: str | None = None,
    ) -> None:
        self.files = files or []
        self.format = fmt
        self.user_column = user_column
        self.text_column = text_column
        self.batch_size = batch_size
        self._table = table
        self.name = name or (self.files[0].name if self.files else "table")
        if table is not None:
            self.nbytes = table.nbytes
        else:
            self.nbytes = sum(f.stat().st_size for f in self.files)
            for file in self.files:  # fail fast on a missing column, before any work
                try:
                    _check_columns(file, fmt, (user_column, text_column))
                except (pa.ArrowInvalid, OSError) as exc:
                    raise InputDataError(f"{file}: cannot read it as {fmt} ({exc})") from exc

    @classmethod
    def from_table(
        cls, table: pa.Table, user_column: str, text_column: str, name: str
    ) -> InputSource:
        for column in (user_column, text_column):
            if column not in table.column_names:
                raise InputDataError(
                    f"{name}: column {column!r} not found; columns are {table.column_names}"
                )
        return cls(None, "table", user_column, text_column, table=table, name=name)

    def total_rows(self) -> int | None:
        """Row count when known without a scan (Parquet footers, tables), else None."""
        if self._table is not None:
            return self._table.num_rows
        if self.format == "parquet":
            return sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)
        return None

    def batches(self) -> Iterator[InputBatch]:
        if self._table is not None:
            for start in range(0, self._table.num_rows, self.batch_size):
                part = self._table.slice(start, self.batch_size)
                yield _checked(self.name, start, part[self.user_column], part[self.text_column])
            return
        readers = {"parquet": _parquet, "jsonl": _jsonl, "csv": _csv, "arrow": _arrow}
        for file in self.files:
            yield from readers[self.format](
                file, self.user_column, self.text_column, self.batch_size
            )

    def texts(self) -> Iterator[list[str]]:
        """Batches of texts only (for training a tokenizer)."""
        for batch in self.batches():
            yield batch.text.to_pylist()


def open_input(
    path: str | Path, fmt: str, user_column: str, text_column: str, batch_size: int = 8192
) -> InputSource:
    """Resolve INPUT (a file, or a directory of files of one format) and check its columns."""
    path = Path(path)
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: allowed are {', '.join(FORMATS)}")
    if not path.exists():
        raise InputDataError(f"{path}: input not found")
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            raise InputDataError(
                f"{path}: a datasets DatasetDict; pass one split's directory (e.g. {path / 'train'})"
            )
        files, dir_fmt = _files_in_dir(path, fmt)
        return InputSource(files, dir_fmt, user_column, text_column, batch_size, name=path.name)
    if fmt == "auto":
        fmt = _SUFFIXES.get(path.suffix.lower(), "")
        if not fmt:
            raise ValueError(
                f"--format auto cannot tell the format of {path.name}; pass --format "
                "parquet|jsonl|csv|arrow"
            )
    return InputSource([path], fmt, user_column, text_column, batch_size)


def _files_in_dir(directory: Path, fmt: str) -> tuple[list[Path], str]:
    arrow_state = directory / "state.json"
    if fmt in ("auto", "arrow") and arrow_state.is_file():
        state = json.loads(arrow_state.read_text())
        files = [directory / item["filename"] for item in state.get("_data_files", [])]
        if files:
            return files, "arrow"
    candidates = [fmt] if fmt != "auto" else ["arrow", "parquet", "jsonl", "csv"]
    for kind in candidates:
        files = sorted(
            p
            for p in directory.iterdir()
            if p.is_file() and _SUFFIXES.get(p.suffix.lower()) == kind
        )
        if files:
            return files, kind
    raise InputDataError(f"{directory}: no input files of format {fmt} in this directory")


def _check_columns(file: Path, fmt: str, columns: tuple[str, ...]) -> None:
    if fmt == "parquet":
        names = pq.ParquetFile(file).schema_arrow.names
    elif fmt == "arrow":
        with _open_ipc(file) as reader:
            names = reader.schema.names
    elif fmt == "csv":
        with open(file, newline="", encoding="utf-8", errors="replace") as handle:
            names = next(csv.reader(handle), [])
    else:
        return  # JSONL has no header: each line is checked as it is read
    for column in columns:
        if column not in names:
            raise InputDataError(
                f"{file}: column {column!r} not found; columns are {names} "
                "(set --user-column / --text-column)"
            )


# ---- validation shared by every format ----------------------------------------------------------


def _first(mask: pa.Array) -> int:
    return int(pc.index(mask, True).as_py())


def _utf8(file: str, first_row: int, array: pa.Array, what: str) -> pa.Array:
    """``array`` as a UTF-8-validated string array; names the first bad row otherwise."""
    if pa.types.is_large_string(array.type) or pa.types.is_string(array.type):
        try:
            array.validate(full=True)
            return array.cast(pa.string())
        except pa.ArrowInvalid:
            pass
    elif not (pa.types.is_binary(array.type) or pa.types.is_large_binary(array.type)):
        raise InputDataError(f"{file}: the {what} column has type {array.type}; expected text")
    try:
        return array.cast(pa.string())
    except pa.ArrowInvalid:
        for i, value in enumerate(array.cast(pa.large_binary()).to_pylist()):
            try:
                if value is not None:
                    value.decode("utf-8")
            except UnicodeDecodeError:
                raise InputDataError(
                    f"{file}: row {first_row + i}: {what} is not valid UTF-8"
                ) from None
        raise


def _checked(file: str, first_row: int, user: pa.Array, text: pa.Array) -> InputBatch:
    if isinstance(user, pa.ChunkedArray):
        user = user.combine_chunks()
    if isinstance(text, pa.ChunkedArray):
        text = text.combine_chunks()
    if pa.types.is_dictionary(user.type):  # e.g. a categorical column
        user = user.dictionary_decode()
    if pa.types.is_dictionary(text.type):
        text = text.dictionary_decode()
    if user.null_count:
        raise InputDataError(f"{file}: row {first_row + _first(user.is_null())}: user id is null")
    if text.null_count:
        raise InputDataError(f"{file}: row {first_row + _first(text.is_null())}: text is null")
    if pa.types.is_integer(user.type):
        user = user.cast(pa.string())
    elif pa.types.is_floating(user.type) or pa.types.is_boolean(user.type):
        raise InputDataError(
            f"{file}: the user id column has type {user.type}; use string or integer ids"
        )
    user = _utf8(file, first_row, user, "user id")
    text = _utf8(file, first_row, text, "text")
    for array, what in ((user, "user id"), (text, "text")):
        empty = pc.equal(pc.binary_length(array), 0)
        if pc.any(empty).as_py():
            raise InputDataError(f"{file}: row {first_row + _first(empty)}: {what} is empty")
    return InputBatch(file, first_row, user, text)


# ---- readers ------------------------------------------------------------------------------------


def _parquet(file: Path, user: str, text: str, batch_size: int) -> Iterator[InputBatch]:
    row = 0
    try:
        for batch in pq.ParquetFile(file).iter_batches(batch_size=batch_size, columns=[user, text]):
            yield _checked(str(file), row, batch.column(user), batch.column(text))
            row += batch.num_rows
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputDataError(f"{file}: unreadable Parquet after row {row} ({exc})") from exc


class _open_ipc:
    """Context manager: an Arrow IPC file- or stream-format reader over a memory map."""

    def __init__(self, file: Path) -> None:
        self._source = pa.memory_map(str(file), "r")
        try:
            self.reader = ipc.open_file(self._source)
            self._batches = (
                self.reader.get_batch(i) for i in range(self.reader.num_record_batches)
            )
        except pa.ArrowInvalid:
            self._source.seek(0)
            try:
                self.reader = ipc.open_stream(self._source)
            except pa.ArrowInvalid as exc:
                self._source.close()
                raise InputDataError(f"{file}: not an Arrow IPC file or stream ({exc})") from exc
            self._batches = iter(self.reader)
        self.schema = self.reader.schema

    def __enter__(self) -> _open_ipc:
        return self

    def __exit__(self, *exc: object) -> None:
        self._source.close()

    def __iter__(self) -> Iterator[pa.RecordBatch]:
        return self._batches


def _arrow(file: Path, user: str, text: str, batch_size: int) -> Iterator[InputBatch]:
    row = 0
    with _open_ipc(file) as reader:
        try:
            for batch in reader:
                for start in range(0, batch.num_rows, batch_size):
                    part = batch.slice(start, batch_size)
                    yield _checked(str(file), row, part.column(user), part.column(text))
                    row += part.num_rows
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputDataError(f"{file}: unreadable after row {row} ({exc})") from exc


def _csv(file: Path, user: str, text: str, batch_size: int) -> Iterator[InputBatch]:
    options = pacsv.ConvertOptions(
        column_types={user: pa.string(), text: pa.string()}, include_columns=[user, text]
    )
    row = 0
    try:
        reader = pacsv.open_csv(
            file,
            read_options=pacsv.ReadOptions(block_size=4 << 20),
            parse_options=pacsv.ParseOptions(newlines_in_values=True),
            convert_options=options,
        )
        for batch in reader:
            for start in range(0, batch.num_rows, batch_size):
                part = batch.slice(start, batch_size)
                yield _checked(str(file), row, part.column(user), part.column(text))
                row += part.num_rows
    except pa.ArrowInvalid as exc:
        if "UTF8" in str(exc) or "utf8" in str(exc).lower():
            raise InputDataError(
                f"{file}: line {_first_bad_utf8_line(file)} is not valid UTF-8"
            ) from exc
        raise InputDataError(f"{file}: CSV parse error after row {row} ({exc})") from exc


def _first_bad_utf8_line(file: Path) -> int | str:
    with open(file, "rb") as handle:
        for number, line in enumerate(handle, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError:
                return number
    return "?"


def _jsonl(file: Path, user: str, text: str, batch_size: int) -> Iterator[InputBatch]:
    users: list[str] = []
    texts: list[str] = []
    row = 0
    with open(file, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            where = f"{file}: line {number}"
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                raise InputDataError(f"{where} is not valid UTF-8") from None
            except json.JSONDecodeError as exc:
                raise InputDataError(f"{where} is not valid JSON ({exc.msg})") from None
            if not isinstance(record, dict):
                raise InputDataError(f"{where}: expected a JSON object per line")
            for column in (user, text):
                if column not in record:
                    raise InputDataError(
                        f"{where}: column {column!r} not found; keys are {sorted(record)} "
                        "(set --user-column / --text-column)"
                    )
            user_id, body = record[user], record[text]
            if user_id is None:
                raise InputDataError(f"{where}: user id is null")
            if isinstance(user_id, bool) or not isinstance(user_id, (str, int)):
                raise InputDataError(f"{where}: user id must be a string or an integer")
            if body is None:
                raise InputDataError(f"{where}: text is null")
            if not isinstance(body, str):
                raise InputDataError(f"{where}: text must be a string")
            if not body:
                raise InputDataError(f"{where}: text is empty")
            try:  # JSON escapes can produce lone surrogates, which are not valid UTF-8
                body.encode("utf-8")
                str(user_id).encode("utf-8")
            except UnicodeEncodeError:
                raise InputDataError(f"{where} is not valid UTF-8 (lone surrogate)") from None
            if user_id == "":
                raise InputDataError(f"{where}: user id is empty")
            users.append(str(user_id))
            texts.append(body)
            if len(users) == batch_size:
                yield _checked(
                    str(file), row, pa.array(users, pa.string()), pa.array(texts, pa.string())
                )
                row += len(users)
                users, texts = [], []
    if users:
        yield _checked(str(file), row, pa.array(users, pa.string()), pa.array(texts, pa.string()))
