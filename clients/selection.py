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

Example units (ELS and group privacy: one of at most ``group_size`` records per user in the
subset D_sub, chosen once) take the same records: ``random`` draws D_sub uniformly (the
coordinator names each record by its index, :func:`example_at`), and the ranked strategies
(``longest``, ``shortest``, ``highest_ppl``, ``lowest_ppl``) make D_sub each user's first
``group_size`` records under :func:`ranking`, named by their rank, so the coordinator needs no
lengths or perplexities. ``random_chunk`` is for user units only: its windows are not records.

Selection does not bound a user's contribution: that is the strategy's job (the unit and clip).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from userdp.strategies.population import (
    EXAMPLE_UNIT_SELECTIONS,
    PERPLEXITY_SELECTIONS,
    RANKED_SELECTIONS,
    SELECTION_STRATEGIES,
)

__all__ = [
    "EXAMPLE_UNIT_SELECTIONS",
    "PERPLEXITY_SELECTIONS",
    "RANKED_SELECTIONS",
    "SELECTION_STRATEGIES",
    "MissingPerplexityError",
    "example_at",
    "ranking",
    "select_examples",
]


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
    _check_strategy(strategy)
    if group_size is not None and group_size < 1:
        raise ValueError(f"group_size must be a positive integer or None, got {group_size}")
    if seq_len < 1:
        raise ValueError(f"seq_len must be a positive integer, got {seq_len}")
    # ranked first: missing perplexities are an error even for a user without examples
    order = ranking(examples, strategy, perplexities) if strategy in RANKED_SELECTIONS else None
    if not examples:
        return []
    n = len(examples)
    k = n if group_size is None else min(group_size, n)
    if strategy == "random":
        chosen = rng.choice(n, size=k, replace=False)
    elif order is not None:
        chosen = order[:k]
    else:
        return _random_chunks(examples, group_size or n, seq_len, rng, separator)
    return [np.asarray(examples[i])[:seq_len] for i in chosen]


def ranking(
    examples: Sequence[np.ndarray],
    strategy: str,
    perplexities: Sequence[float] | np.ndarray | None = None,
) -> np.ndarray:
    """A user's example indices in the order of a ranked ``strategy`` (:data:`RANKED_SELECTIONS`):
    by token count for ``longest`` / ``shortest``, by perplexity for ``highest_ppl`` /
    ``lowest_ppl`` (unscored examples, NaN, last). Stable: ties keep the earlier example first."""
    _check_strategy(strategy)
    if strategy not in RANKED_SELECTIONS:
        raise ValueError(f"selection {strategy!r} does not rank examples")
    n = len(examples)
    if strategy in PERPLEXITY_SELECTIONS:
        if perplexities is None:
            raise MissingPerplexityError(
                f"data.selection = {strategy!r} needs each example's perplexity under the initial "
                "model, and none were given: only a worker computes them (once, at start); use "
                "another data.selection here"
            )
        if len(perplexities) != n:
            raise MissingPerplexityError(
                f"data.selection = {strategy!r}: {len(perplexities)} perplexities for {n} examples"
            )
        scores = np.asarray(perplexities, dtype=np.float64)
        key = -scores if strategy == "highest_ppl" else scores  # NaN sorts last either way
    else:
        lengths = np.fromiter((len(e) for e in examples), dtype=np.int64, count=n)
        key = -lengths if strategy == "longest" else lengths
    return np.argsort(key, kind="stable")


def example_at(
    examples: Sequence[np.ndarray],
    index: int,
    strategy: str,
    seq_len: int,
    perplexities: Sequence[float] | np.ndarray | None = None,
    group_size: int | None = None,
) -> np.ndarray:
    """The record an example unit ``"<user>/<index>"`` names, truncated to ``seq_len``: record
    ``index`` under ``random`` (D_sub drawn uniformly by index), the record of rank ``index``
    under a ranked strategy (D_sub = each user's top ``group_size``; a rank at or past
    ``group_size`` is refused, as it would put more than ``group_size`` of the user's records in
    D_sub)."""
    _check_strategy(strategy)
    if strategy not in EXAMPLE_UNIT_SELECTIONS:
        raise ValueError(
            f"data.selection = {strategy!r} cuts windows across a user's records, and example "
            f"units name records; use one of {', '.join(EXAMPLE_UNIT_SELECTIONS)}"
        )
    if not 0 <= index < len(examples):
        raise IndexError(f"example {index} of a user with {len(examples)} examples")
    if strategy in RANKED_SELECTIONS:
        if group_size is not None and index >= group_size:
            raise IndexError(
                f"example unit of rank {index} under data.selection = {strategy!r}: D_sub holds "
                f"each user's first {group_size} records only"
            )
        index = int(ranking(examples, strategy, perplexities)[index])
    return np.asarray(examples[index])[:seq_len]


def _check_strategy(strategy: str) -> None:
    if strategy not in SELECTION_STRATEGIES:
        raise ValueError(
            f"selection must be one of {', '.join(SELECTION_STRATEGIES)}, got {strategy!r}"
        )


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
