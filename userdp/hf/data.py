"""A ``Trainer``'s dataset as userdp shards: the users, their texts, the Trainer's tokenizer.

userdp samples units from user-partitioned shards (docs/data.md), whatever drives the steps, so a
``datasets.Dataset`` (or ``IterableDataset``) with a user column is written once into a shard
folder of the run's ``output_dir`` with the Trainer's tokenizer. Chat data (a ``messages``
column, as TRL's ``SFTTrainer`` takes it) becomes text through the tokenizer's chat template.
The folder is keyed by a hash of the data and tokenizer, so a resumed run reuses it and a
changed dataset is never mixed with an old one.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa

from userdp.accounting.durable import publish_directory
from userdp.clients.shard_format import MANIFEST_NAME
from userdp.shards.input import InputSource
from userdp.shards.writer import ShardOptions, write_shards

__all__ = ["DatasetError", "dataset_shards"]

CHAT_COLUMN = "messages"
NUM_SHARDS = 4


class DatasetError(ValueError):
    """The Trainer's dataset cannot be trained on with user-level privacy (one line)."""


def _rows(dataset: Any, columns: list[str]) -> list[dict[str, Any]]:
    """The columns' values of every row of a ``Dataset`` or (finite) ``IterableDataset``."""
    names = getattr(dataset, "column_names", None)
    if names is not None and not set(columns) <= set(names):
        missing = sorted(set(columns) - set(names))
        raise DatasetError(f"missing column(s) {missing}; the dataset has {sorted(names)}")
    if hasattr(dataset, "select_columns"):
        dataset = dataset.select_columns(columns)
    return [{c: row[c] for c in columns} for row in dataset]


def check_columns(dataset: Any, user_column: str, text_column: str) -> bool:
    """Refuse a dataset without the user column or text (``text_column`` or chat ``messages``);
    returns whether the text is chat. An ``IterableDataset`` without known columns is checked
    when it is read."""
    if dataset is None:
        raise DatasetError("UserDPTrainer needs a train_dataset (or privacy.shards)")
    names = list(getattr(dataset, "column_names", None) or [])
    if names and user_column not in names:
        raise DatasetError(
            f"the train_dataset has no user column {user_column!r} (columns: {sorted(names)}): "
            "user-level privacy needs each example's user; set privacy.user_column to it"
        )
    chat = bool(names) and text_column not in names and CHAT_COLUMN in names
    if names and not chat and text_column not in names:
        raise DatasetError(
            f"the train_dataset has no text column {text_column!r} nor chat {CHAT_COLUMN!r} "
            f"(columns: {sorted(names)}): set privacy.text_column to the column holding the "
            "text (userdp tokenizes it with the Trainer's processing_class)"
        )
    return chat


def dataset_texts(dataset: Any, user_column: str, text_column: str, tokenizer: Any) -> pa.Table:
    """(user id, text) of every example: ``text_column``, or the chat template applied to a
    ``messages`` column when the dataset has no ``text_column``."""
    chat = check_columns(dataset, user_column, text_column)
    rows = _rows(dataset, [user_column, CHAT_COLUMN if chat else text_column])
    users, texts = [], []
    for row in rows:
        if chat:
            if tokenizer is None or not getattr(tokenizer, "chat_template", None):
                raise DatasetError(
                    "chat data (a 'messages' column) needs a processing_class with a "
                    "chat_template to turn conversations into text"
                )
            text = tokenizer.apply_chat_template(row[CHAT_COLUMN], tokenize=False)
        else:
            text = row[text_column]
        users.append(str(row[user_column]))
        texts.append(text)
    return pa.table({"user_id": users, "text": texts})


def dataset_shards(
    dataset: Any, user_column: str, text_column: str, tokenizer: Any, output_dir: Path
) -> Path:
    """The shard folder of ``dataset`` under ``output_dir/userdp_shards/``: written once (to a
    temporary name, then renamed) and reused while the data and tokenizer are the same."""
    if tokenizer is None:
        raise DatasetError(
            "UserDPTrainer tokenizes the dataset with the Trainer's processing_class; pass "
            "processing_class=tokenizer (or privacy.shards, a folder written by `userdp shard`)"
        )
    table = dataset_texts(dataset, user_column, text_column, tokenizer)
    root = Path(output_dir) / "userdp_shards"
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        tokenizer_dir = Path(tmp) / "tokenizer"
        tokenizer.save_pretrained(str(tokenizer_dir))
        digest = _digest(table, tokenizer_dir)
        target = root / digest[:16]
        if (target / MANIFEST_NAME).is_file():
            return target
        source = InputSource.from_table(table, "user_id", "text", "train_dataset")
        staging = Path(tmp) / "shards"
        options = ShardOptions(num_shards=NUM_SHARDS, tokenizer=str(tokenizer_dir), progress=False)
        write_shards(source, staging, options)
        shutil.rmtree(target, ignore_errors=True)  # a folder left without its manifest
        publish_directory(staging, target)
    return target


def _digest(table: pa.Table, tokenizer_dir: Path) -> str:
    """sha256 of the examples and the tokenizer's files."""
    digest = hashlib.sha256()
    for user, text in zip(table["user_id"].to_pylist(), table["text"].to_pylist(), strict=True):
        digest.update(json.dumps([user, text]).encode("utf-8"))
    for path in sorted(tokenizer_dir.iterdir()):
        digest.update(path.name.encode("utf-8") + b"\0" + path.read_bytes())
    return digest.hexdigest()
