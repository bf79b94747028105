"""Every example's perplexity under the initial model, for the perplexity-based selection
strategies (``data.selection = "highest_ppl" | "lowest_ppl"``) of Chua et al., "Mind the Privacy
Unit! User-Level Differential Privacy for Language Model Fine-Tuning" (§4.1, §5.1).

An example's perplexity is exp of its mean next-token cross-entropy, computed on the example
truncated to ``seq_len`` tokens, as training feeds it, with the clipping engines' batching,
padding and loss (:mod:`userdp.clients.batching`). An example of fewer than 2 tokens has nothing
to predict: its score is NaN (and training drops it too).

A worker scores every example of the shards it owns ONCE, at start, with the model it builds
from its config before any broadcast reaches it: ``model.path``'s weights (the public pre-trained
model) or a preset's seeded initialization. The scores therefore never depend on a model trained
on the private data. They are cached per shard, one safetensors file whose name holds a sha256 of
the model (class, config, every parameter and buffer), the shard's sha256 from the manifest and
``seq_len``; the same values are checked again in the file's metadata, so another model, other
shard contents or another ``seq_len`` never reuse a stale cache. The cache is a function of the
private rows: keep it as private as the shards.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file
from userdp.accounting.durable import atomic_write
from userdp.clients.batching import Unit, make_batch, pack_units, prepare_units, token_losses
from userdp.clients.shard_store import ShardStore

log = logging.getLogger(__name__)

CACHE_FORMAT = "userdp-perplexity-v1"
"""Names the scoring rule; a change of the rule gets a new name, so old files are never read."""
CACHE_FOLDER = "cache"
"""The default cache: this folder inside the shard folder (``workers.cache_dir`` overrides it)."""
SCORE_CHUNK_EXAMPLES = 4096
"""Examples read and scored together (memory is O(chunk), whatever the shard's size)."""
_UNHASHED_CONFIG_KEYS = frozenset({"_name_or_path", "transformers_version"})


def model_sha256(module: torch.nn.Module) -> str:
    """sha256 of what decides a model's outputs: its class, its config (without the folder it
    was loaded from) and every parameter's and buffer's name, dtype, shape and bytes."""
    digest = hashlib.sha256(f"{CACHE_FORMAT}\0{type(module).__name__}\0".encode())
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_dict"):
        described = {k: v for k, v in config.to_dict().items() if k not in _UNHASHED_CONFIG_KEYS}
        digest.update(json.dumps(described, sort_keys=True, default=str).encode())
    tensors = [*module.named_parameters(), *module.named_buffers()]
    for name, value in tensors:
        tensor = value.detach().to("cpu").contiguous()
        digest.update(f"\0{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def _max_positions(module: torch.nn.Module) -> int | None:
    config = getattr(module, "config", None)
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def score_examples(
    module: torch.nn.Module,
    examples: Sequence[np.ndarray],
    seq_len: int,
    *,
    token_budget: int = 8192,
    pad_id: int = 0,
) -> np.ndarray:
    """Perplexity of each example (float64, NaN below 2 tokens) under ``module``, each example
    truncated to ``seq_len`` tokens; micro-batches of at most ``token_budget`` padded tokens."""
    scores = np.full(len(examples), np.nan)
    truncated = [np.asarray(e)[:seq_len] for e in examples]
    # similar lengths share a micro-batch: less padding
    order = sorted(
        (i for i, e in enumerate(truncated) if len(e) >= 2), key=lambda i: len(truncated[i])
    )
    if not order:
        return scores
    prepared = prepare_units([Unit(str(i), [truncated[i]]) for i in order], _max_positions(module))
    batches, oversized = pack_units(prepared, token_budget)
    device = next(module.parameters()).device
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            for units in batches + [[i] for i in oversized]:
                batch = make_batch(prepared, units, device, pad_id)
                losses = token_losses(module, batch).double()
                mean_nll = losses.sum(dim=1) / batch.mask.sum(dim=1)
                scores[[order[u] for u in units]] = torch.exp(mean_nll).cpu().numpy()
    finally:
        module.train(was_training)
    return scores


class ExamplePerplexities:
    """The perplexity of every example of a store's shards, addressed by shard row."""

    def __init__(self, store: ShardStore, by_shard: Mapping[str, np.ndarray]) -> None:
        self.store = store
        self.by_shard = dict(by_shard)

    def of_user(self, user_id: str) -> np.ndarray:
        """The user's examples' perplexities, in the order of ``store.user_examples(user_id)``."""
        name, start, count = self.store.user_rows(user_id)
        return self.by_shard[name][start : start + count]

    def broadcast_from_rank_zero(self, device: torch.device) -> None:
        """Replace every rank's scores by rank 0's (a collective: every rank of the default
        process group calls it, with the same shards). The ranks of a worker split a task's
        units by their selected examples' token counts, so they must select identically, which
        scores computed on each rank's own device do not promise to the last bit."""
        for name in sorted(self.by_shard):
            tensor = torch.from_numpy(np.ascontiguousarray(self.by_shard[name])).to(device)
            torch.distributed.broadcast(tensor, src=0)
            self.by_shard[name] = tensor.cpu().numpy()


def cache_key(model_hash: str, shard_sha256: str, seq_len: int) -> dict[str, str]:
    """What a cached file must match to be read (also its metadata)."""
    return {
        "format": CACHE_FORMAT,
        "model_sha256": model_hash,
        "shard_sha256": shard_sha256,
        "seq_len": str(int(seq_len)),
    }


def cache_path(cache_dir: Path, shard: str, key: Mapping[str, str]) -> Path:
    digest = hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()
    return Path(cache_dir) / f"perplexity-{shard}-{digest[:32]}.safetensors"


def _read_cache(path: Path, key: Mapping[str, str], rows: int) -> np.ndarray | None:
    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="np") as cached:
            metadata = cached.metadata() or {}
            scores = cached.get_tensor("perplexity")
    except (SafetensorError, OSError, KeyError, ValueError) as exc:
        log.warning("perplexity cache %s is unreadable (%s); scoring again", path, exc)
        return None
    if any(metadata.get(k) != v for k, v in key.items()) or scores.shape != (rows,):
        log.warning("perplexity cache %s does not match the model and shard; scoring again", path)
        return None
    return scores.astype(np.float64, copy=False)


def _write_cache(path: Path, key: Mapping[str, str], scores: np.ndarray) -> None:
    """Write durably and atomically (:func:`userdp.accounting.durable.atomic_write`), so
    concurrent workers or ranks scoring the same shard never leave a torn file; a folder that
    cannot be written only costs a rescore."""
    tensors = {"perplexity": np.ascontiguousarray(scores)}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda temporary: save_file(tensors, temporary, metadata=dict(key)))
    except OSError as exc:
        log.warning(
            "cannot write the perplexity cache %s (%s): scores are kept in memory only; set "
            "workers.cache_dir to a writable folder to reuse them next time",
            path,
            exc,
        )


def _score_shard(
    module: torch.nn.Module,
    store: ShardStore,
    shard: str,
    rows: int,
    seq_len: int,
    token_budget: int,
    pad_id: int,
) -> np.ndarray:
    scores = np.full(rows, np.nan)
    pending: list[np.ndarray] = []
    positions: list[int] = []

    def flush() -> None:
        scores[positions] = score_examples(
            module, pending, seq_len, token_budget=token_budget, pad_id=pad_id
        )
        pending.clear()
        positions.clear()

    for user in store.shard_users(shard):
        _, start, count = store.user_rows(user)
        pending.extend(store.user_examples(user))
        positions.extend(range(start, start + count))
        if len(pending) >= SCORE_CHUNK_EXAMPLES:
            flush()
    if pending:
        flush()
    return scores


def example_perplexities(
    module: torch.nn.Module,
    store: ShardStore,
    seq_len: int,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    token_budget: int = 8192,
    pad_id: int = 0,
    on_phase: Callable[[str], None] | None = None,
) -> ExamplePerplexities:
    """The perplexities of every example of ``store``'s shards under ``module`` (the initial
    model: call this before any update is applied), read from the cache in ``cache_dir``
    (default: ``cache/`` in the shard folder) when it matches, else scored and written there.
    ``on_phase`` hears which shard is being scored (worker start-up reports)."""
    folder = Path(cache_dir) if cache_dir is not None else store.directory / CACHE_FOLDER
    model_hash = model_sha256(module)
    entries = {entry.name: entry for entry in store.manifest.shards}
    by_shard: dict[str, np.ndarray] = {}
    names = store.shard_names
    for position, name in enumerate(names, start=1):
        entry = entries[name]
        key = cache_key(model_hash, entry.sha256, seq_len)
        path = cache_path(folder, name, key)
        scores = _read_cache(path, key, entry.num_examples)
        if scores is None:
            if on_phase is not None:
                on_phase(f"scoring perplexity: shard {position}/{len(names)}")
            log.info("scoring the perplexity of %d examples of %s", entry.num_examples, name)
            scores = _score_shard(
                module, store, name, entry.num_examples, seq_len, token_budget, pad_id
            )
            _write_cache(path, key, scores)
        else:
            log.info("perplexities of %s read from %s", name, path)
        by_shard[name] = scores
    return ExamplePerplexities(store, by_shard)
