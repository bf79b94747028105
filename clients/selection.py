"""Which of a user's examples a worker feeds the model: the data selection strategies of Chua et
al., "Mind the Privacy Unit! User-Level Differential Privacy for Language Model Fine-Tuning"
(§4.1, §5.1):

- ``random``: ``group_size`` examples drawn uniformly without replacement.
- ``longest`` / ``shortest``: the ``group_size`` examples with the most / fewest tokens (length is
  measured in tokens before truncation; ties go to the earlier example). Deterministic per user.
- ``highest_ppl`` / ``lowest_ppl``: the ``group_size`` examples with the highest / lowest
  perplexity under the initial model (exp of the mean next-token cross-entropy of the example
  truncated to ``seq_len``, :mod:`userdp.clients.perplexity`), passed in as ``perplexities``;
  ties go to the earlier example and an example without a score (fewer than 2 tokens: nothing to
  predict) comes after every scored one. Deterministic per user.
- ``random_chunk``: concatenate the user's examples into one document (``separator`` between
  records when given) and take ``group_size`` windows of ``seq_len`` tokens at independent uniform
  offsets; windows may overlap and span record boundaries. A document shorter than ``seq_len``
  yields ``group_size`` copies of the whole document.

Every returned example is truncated to ``seq_len`` tokens. ``group_size=None`` keeps all examples
(``random`` then returns them in a random order).

Selection does not bound a user's contribution: that is the strategy's job (the unit and clip).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PERPLEXITY_SELECTIONS: tuple[str, ...] = ("highest_ppl", "lowest_ppl")
"""The strategies that rank a user's examples by their perplexity under the initial model."""
SELECTION_STRATEGIES: tuple[str, ...] = (
    "random",
    "longest",
    "shortest",
    "random_chunk",
    *PERPLEXITY_SELECTIONS,
)


class MissingPerplexityError(ValueError):
    """A perplexity-based selection was asked for without the examples' perplexities."""


def select_examples(
    examples: Sequence[np.ndarray],
    group_size: int | None,
    strategy: str,
    seq_len: int,
    rng: np.random.Generator,
    separator: int | None = None,
    perplexities: Sequence[float] | np.ndarray | None = None,
) -> list[np.ndarray]:
    """Pick up to ``group_size`` token sequences (each ≤ ``seq_len`` tokens) from one user's
    ``examples`` by ``strategy``; see the module docstring for the definitions.
    ``perplexities[i]`` is example i's perplexity (NaN: unscored), needed by ``highest_ppl`` and
    ``lowest_ppl`` only."""
    if strategy not in SELECTION_STRATEGIES:
        raise ValueError(
            f"selection must be one of {', '.join(SELECTION_STRATEGIES)}, got {strategy!r}"
        )
    if group_size is not None and group_size < 1:
        raise ValueError(f"group_size must be a positive integer or None, got {group_size}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len}")
    if strategy in PERPLEXITY_SELECTIONS:
        if perplexities is None:
            raise MissingPerplexityError(
                f"data.selection = {strategy!r} needs each example's perplexity under the initial "
                "model, and none were given: only a worker computes them (once, at start); use "
                "another data.selection here"
            )
        if len(perplexities) != len(examples):
            raise MissingPerplexityError(
                f"data.selection = {strategy!r}: {len(perplexities)} perplexities for "
                f"{len(examples)} examples"
            )
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
    elif strategy in PERPLEXITY_SELECTIONS:
        scores = np.asarray(perplexities, dtype=np.float64)
        # NaN sorts last in either direction; the stable sort keeps ties in example order
        key = -scores if strategy == "highest_ppl" else scores
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
