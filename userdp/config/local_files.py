"""The files a config names on THIS machine, checked before anything starts (``config check``,
``simulate``, ``train``, ``coordinator``, ``worker``: :func:`userdp.config.check_local_files`).

Each check is cheap (no sha256 of the data: ``userdp shard verify`` does that) and catches what
would otherwise fail a run after its workers started: a shard folder with a file missing or
truncated, a model whose vocabulary is smaller than the shards' tokenizer or whose positions are
fewer than ``data.seq_len``, a run folder that is a file. ``deploy render`` does not run them: its
config names paths that exist only in the pods.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from userdp.clients.shard_format import Manifest, ManifestError, read_manifest
from userdp.config.schema import Config
from userdp.shards.demo import DEMO_NUM_SHARDS

__all__ = ["local_file_problems", "model_positions", "run_folder_problem"]

POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
"""config.json keys transformers models use for the number of positions."""


def local_file_problems(config: Config) -> list[str]:
    """One line per problem with the shard folder, TLS folder, model folder and run folder that
    ``config`` names (the module docstring); empty when there is none."""
    problems: list[str] = []
    vocab_size = None
    shards = config.data.shards
    if shards is not None:
        problem, manifest = _shards_problem(shards)
        if problem:
            problems.append(problem)
        if manifest is not None:
            vocab_size = manifest.tokenizer.vocab_size
            problems += _data_problems(config, manifest)
    else:
        problems += _worker_count_problems(config, DEMO_NUM_SHARDS, "the demo corpus")
    problems += _machine_problems(config)
    tls_dir = config.coordinator.tls_dir
    if tls_dir is not None and not Path(tls_dir).is_dir():
        problems.append(
            f"coordinator.tls_dir = {tls_dir!r} is not a folder: give the folder with ca.pem and "
            "coordinator.pem/.key (`userdp certs dev-ca`), or remove the key"
        )
    if config.model.path is not None:
        problems += _model_problems(config.model.path, vocab_size, config.data.seq_len)
    run_folder = run_folder_problem(config.output.dir, "output.dir", writable=False)
    if run_folder:
        problems.append(run_folder)
    return problems


def run_folder_problem(
    folder: str | os.PathLike[str], where: str, *, writable: bool = True
) -> str | None:
    """Why ``folder`` cannot be a run folder (None when it can): it, or a folder above it, is a
    file, or (``writable``) the nearest existing folder is not writable by this user. ``where``
    names the setting it came from (``output.dir``, ``--output``). A config's own check leaves
    out writability: workers load the same config and never write the run folder."""
    folder = Path(folder)
    for path in (folder, *folder.absolute().parents):
        if not path.exists():
            continue
        if not path.is_dir():
            what = "is a file" if path == folder else f"is inside {path}, which is a file"
            return (
                f"{where} = {str(folder)!r} {what}, not a folder: give a new or existing run folder"
            )
        if writable and not os.access(path, os.W_OK | os.X_OK):
            return (
                f"{where} = {str(folder)!r}: {path} is not writable by this user: give a run "
                "folder you can write"
            )
        return None
    return None


def _data_problems(config: Config, manifest: Manifest) -> list[str]:
    """What the shards cannot give the run: a target token, or a shard for every worker."""
    problems = _worker_count_problems(
        config, manifest.num_shards, f"data.shards = {config.data.shards!r}"
    )
    if manifest.total_tokens <= manifest.total_examples:
        problems.append(
            f"data.shards = {config.data.shards!r}: no example has 2 or more tokens "
            f"({manifest.total_examples:,} examples, {manifest.total_tokens:,} tokens), so no "
            "step would train on a token while the run spent its budget (a causal LM's first "
            "token is never a target): shard longer examples"
        )
    return problems


def _worker_count_problems(config: Config, num_shards: int, data: str) -> list[str]:
    """Workers that the shards cannot keep busy: shard j goes to ``replicas`` workers."""
    workers = config.workers
    if workers.count <= num_shards * workers.replicas:
        return []
    return [
        f"workers.count = {workers.count} is more than {data}'s {num_shards} shards x "
        f"workers.replicas = {workers.replicas} can keep busy (a worker holds whole shards): "
        f"set workers.count <= {num_shards * workers.replicas}, raise workers.replicas, or "
        "shard the data into more shards (`userdp shard --num-shards`)"
    ]


def _machine_problems(config: Config) -> list[str]:
    """Ranks this machine cannot run: ``simulate`` starts ``workers.ranks`` processes per worker,
    and on CPU each needs a core of its own (a deployment sets its ranks with ``deploy render
    --gpus`` instead)."""
    ranks, cores = config.workers.ranks, os.cpu_count() or 1
    if config.workers.device != "cpu" or ranks <= cores:
        return []
    return [
        f"workers.ranks = {ranks} with workers.device = 'cpu' needs a core per rank; this "
        f"machine has {cores}: set workers.ranks <= {cores}"
    ]


def _shards_problem(shards: str) -> tuple[str | None, Manifest | None]:
    """(what is wrong with the shard folder or None, its manifest when it could be read)."""
    folder = Path(shards)
    if not folder.is_dir():
        return (
            f"data.shards = {shards!r} is not a folder: give the folder `userdp shard` wrote "
            "(it holds manifest.json), or remove the key to use the demo corpus"
        ), None
    if not (folder / "manifest.json").is_file():
        return (
            f"data.shards = {shards!r} has no manifest.json: give the folder `userdp shard` "
            "wrote, or remove the key to use the demo corpus"
        ), None
    try:
        manifest = read_manifest(folder)
    except ManifestError as exc:
        return f"data.shards = {shards!r}: {exc}", None
    for entry in manifest.shards:
        for name in (entry.file, entry.index_file):
            path = folder / name
            if not path.is_file():
                return (
                    f"data.shards = {shards!r}: {path} is missing (listed in the manifest): "
                    "restore it or shard the data again (`userdp shard verify "
                    f"{shards}` checks every file)"
                ), manifest
        size = (folder / entry.file).stat().st_size
        if size != entry.num_bytes:
            return (
                f"data.shards = {shards!r}: {folder / entry.file} has {size:,} bytes, the "
                f"manifest says {entry.num_bytes:,}: the file is truncated or was replaced; "
                "restore it or shard the data again"
            ), manifest
    return None, manifest


def model_positions(model_config: dict[str, Any]) -> int | None:
    """The number of positions a transformers config.json declares (None when it names none)."""
    for key in POSITION_KEYS:
        value = model_config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _model_problems(path: str, vocab_size: int | None, seq_len: int) -> list[str]:
    folder = Path(path).expanduser()
    config_file = folder / "config.json"
    if not config_file.is_file():
        where = "is not a folder" if not folder.is_dir() else "has no config.json"
        return [
            f"model.path = {path!r} {where}: it must be a local folder saved with "
            "save_pretrained (config.json + weights); userdp never downloads, so a hub name "
            "such as 'gpt2' cannot be used: download and save it on a machine with access, "
            "then give the folder"
        ]
    try:
        declared = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return [f"model.path = {path!r}: {config_file} is not a readable JSON file: {exc}"]
    if not isinstance(declared, dict):
        return [f"model.path = {path!r}: {config_file} must hold a JSON object"]
    problems = []
    model_vocab = declared.get("vocab_size")
    if vocab_size is not None and isinstance(model_vocab, int) and model_vocab < vocab_size:
        problems.append(
            f"model.path = {path!r} has vocab_size {model_vocab} but the shards' tokenizer has "
            f"{vocab_size} ids: shard the data with the model's tokenizer (`userdp shard "
            f"--tokenizer {path}`)"
        )
    positions = model_positions(declared)
    if positions is not None and seq_len > positions:
        problems.append(
            f"data.seq_len = {seq_len} is more than the {positions} positions of the model at "
            f"{path!r}: set data.seq_len <= {positions}"
        )
    return problems
