"""Uniform subsets without replacement for many owners at once, vectorized: the draw behind
D_sub of "Fine-Tuning Large Language Models with User-Level Differential Privacy", Alg. 1 (at most
G examples per user, chosen uniformly once; :class:`~userdp.strategies.samplers.ExampleSubset`).
"""

from __future__ import annotations

import numpy as np

__all__ = ["choose_subsets", "distinct_draws", "top_ranks"]


def top_ranks(counts: np.ndarray, g: int) -> np.ndarray:
    """Flat per-user ranks 0..min(n, g) − 1: D_sub under a ranked data selection (longest,
    shortest, by perplexity; :func:`userdp.clients.selection.ranking`), each user's first g
    records in its own order, which the worker resolves on the user's records. As with
    :func:`choose_subsets`, a user has at most g entries, chosen from its own records alone."""
    return _first_slots(counts, g)[1]


def _first_slots(counts: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """(each user's first flat position, flat ranks 0..min(n, g) − 1 per user): the CSR layout
    both D_sub choices fill."""
    taken = np.minimum(counts, g)
    starts = np.concatenate([[0], np.cumsum(taken)])[:-1]
    return starts, np.arange(int(taken.sum()), dtype=np.int64) - np.repeat(starts, taken)


def choose_subsets(rng: np.random.Generator, counts: np.ndarray, g: int) -> np.ndarray:
    """Flat per-user sorted example indices: all of a user's examples if it has ≤ g, else a
    uniformly random g-subset (vectorized over users; exact)."""
    starts, out = _first_slots(counts, g)
    heavy = np.flatnonzero(counts > g)
    if heavy.size == 0:
        return out
    n = counts[heavy]
    # Draw k ≤ n/2 distinct values per user: either the g kept ones or the n − g dropped ones.
    keep_mode = n >= 2 * g
    k = np.where(keep_mode, g, n - g)
    owner, values = distinct_draws(rng, n, k)  # sorted by (owner, value)
    # users that keep their draws: slot j of the user gets its j-th smallest value
    keep = keep_mode[owner]
    o, v = owner[keep], values[keep]
    rank = np.arange(o.size) - np.searchsorted(o, o, side="left")
    out[starts[heavy[o]] + rank] = v
    # users that drop their draws: keep the complement of the dropped values, in order
    dropping = np.flatnonzero(~keep_mode)
    if dropping.size:
        sizes = n[dropping]
        base = np.concatenate([[0], np.cumsum(sizes)])[:-1]
        mask = np.ones(int(sizes.sum()), dtype=bool)
        position_of = np.full(len(n), -1)
        position_of[dropping] = np.arange(dropping.size)
        mask[base[position_of[owner[~keep]]] + values[~keep]] = False
        user_of = np.repeat(np.arange(dropping.size), sizes)
        local = np.arange(mask.size) - base[user_of]
        kept_user, kept_value = user_of[mask], local[mask]
        rank = np.arange(kept_user.size) - np.searchsorted(kept_user, kept_user, side="left")
        out[starts[heavy[dropping[kept_user]]] + rank] = kept_value
    return out


def distinct_draws(
    rng: np.random.Generator, n: np.ndarray, k: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """For each i, k[i] distinct uniform values in [0, n[i]) (k ≤ n/2), returned flat as
    (owner i, value) sorted by owner then value. Each is the first k distinct values of iid
    uniform draws, a uniform sample without replacement; an owner whose batch of draws had too
    few distinct values is redrawn from scratch (the accepted draw stays uniform by symmetry)."""
    owners, chosen = [], []
    pending = np.arange(len(n))
    while pending.size:
        m = (3 * k[pending]) // 2 + 4
        owner = np.repeat(np.arange(pending.size), m)
        values = (rng.random(int(m.sum())) * np.repeat(n[pending], m)).astype(np.int64)
        key = owner * (int(n.max()) + 1) + values
        idx = np.argsort(key, kind="stable")  # first occurrence of each (owner, value)
        o, v = owner[idx], values[idx]
        first = np.ones(idx.size, dtype=bool)
        first[1:] = (o[1:] != o[:-1]) | (v[1:] != v[:-1])
        kept = np.sort(idx[first])  # back to draw order (owner-major)
        ko, kv = owner[kept], values[kept]
        rank = np.arange(ko.size) - np.searchsorted(ko, ko, side="left")
        distinct = np.bincount(ko, minlength=pending.size)
        ok = distinct >= k[pending]
        take = ok[ko] & (rank < k[pending][ko])
        owners.append(pending[ko[take]])
        chosen.append(kv[take])
        pending = pending[~ok]
    owner_all, value_all = np.concatenate(owners), np.concatenate(chosen)
    order = np.lexsort((value_all, owner_all))
    return owner_all[order], value_all[order]
