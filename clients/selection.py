"""Which of a user's examples a worker feeds the model: the data selection strategies of Chua et
al., "Mind the Privacy Unit! User-Level Differential Privacy for Language Model Fine-Tuning"
(§4.1, §5.1):

- ``random``: ``group_size`` examples drawn uniformly without replacement.
- ``longest`` / ``shortest``: the ``group_size`` examples with the most / fewest tokens (length is
  measured in tokens before truncation; ties go to the earlier example). Deterministic per user.
- ``random_chunk``: concatenate the user's examples into one document (``separator`` between
  records when given) and take ``group_size`` windows of ``seq_len`` tokens at independent uniform
  offsets; windows may overlap and span record boundaries. A document shorter than ``seq_len``
  yields ``group_size`` copies of the whole document.

Every returned example is truncated to ``seq_len`` tokens. ``group_size=None`` keeps all examples
(``random`` then returns them in a random order). Perplexity-based selection (highest/lowest PPL
under the initial model) is NOT implemented: it needs a model pass over every example.

Selection does not bound a user's contribution: that is the strategy's job (the unit and clip).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SELECTION_STRATEGIES: tuple[str, ...] = ("random", "longest", "shortest", "random_chunk")
_NOT_IMPLEMENTED = ("highest_ppl", "lowest_ppl")


def select_examples(
    examples: Sequence[np.ndarray],
    group_size: int | None,
    strategy: str,
    seq_len: int,
    rng: np.random.Generator,
    separator: int | None = None,
) -> list[np.ndarray]:
    """Pick up to ``group_size`` token sequences (each ≤ ``seq_len`` tokens) from one user's
    ``examples`` by ``strategy``; see the module docstring for the definitions."""
    if strategy in _NOT_IMPLEMENTED:
        raise ValueError(
            f"selection {strategy!r} is not implemented (perplexity-based selection needs the "
            f"initial model); allowed: {', '.join(SELECTION_STRATEGIES)}"
        )
    if strategy not in SELECTION_STRATEGIES:
        raise ValueError(
            f"selection must be one of {', '.join(SELECTION_STRATEGIES)}, got {strategy!r}"
        )
    if group_size is not None and group_size < 1:
        raise ValueError(f"group_size must be a positive integer or None, got {group_size}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len}")
    if not examples:
        return []
    n = len(examples)
    k = n if group_size is None else min(group_size, n)

    if strategy == "random":
        chosen = rng.choice(n, size=k, replace=False)
    elif strategy in ("longest", "shortest"):
        lengths = np.fromiter((len(e) for e in examples), dtype=np.int64, count=n)
        # stable sort on the key: ties keep the earlier example first
        key = -lengths if strategy == "longest" else lengths
        chosen = np.argsort(key, kind="stable")[:k]
    else:
        return _random_chunks(examples, group_size or n, seq_len, rng, separator)
    return [np.asarray(examples[i])[:seq_len] for i in chosen]


def _random_chunks(
    examples: Sequence[np.ndarray],
    num_chunks: int,
    seq_len: int,
    rng: np.random.Generator,
    separator: int | None,
) -> list[np.ndarray]:
    pieces: list[np.ndarray] = []
    for i, example in enumerate(examples):
        if i and separator is not None:
            pieces.append(np.asarray([separator], dtype=np.asarray(example).dtype))
        pieces.append(np.asarray(example))
    document = np.concatenate(pieces)
    window = min(seq_len, len(document))
    starts = rng.integers(0, len(document) - window + 1, size=num_chunks)
    return [document[s : s + window].copy() for s in starts]
