"""Embedded defaults: the synthetic user-partitioned demo corpus."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import pyarrow.compute as pc
import pytest

from userdp.shards.demo import demo_corpus, examples_per_user


@pytest.fixture(scope="module")
def corpus():
    return demo_corpus()


def test_corpus_is_deterministic_and_seeded(corpus) -> None:
    assert demo_corpus().equals(corpus)
    assert not demo_corpus(seed=1).equals(corpus)
    assert demo_corpus(num_users=10).column("user_id").to_pylist()[0] == "user-00000"


def test_examples_per_user_are_heavy_tailed(corpus) -> None:
    counts = pc.value_counts(corpus["user_id"]).field("counts").to_numpy()
    assert len(counts) == 400
    assert counts.min() == 1
    assert 4 <= np.median(counts) <= 12
    assert counts.max() >= 20 * np.median(counts)
    # heavy tail: the top 10% of users hold most of the examples
    top = np.sort(counts)[-40:].sum()
    assert top / counts.sum() > 0.5
    draws = examples_per_user(100_000, np.random.default_rng(0))
    assert draws.min() == 1 and draws.max() == 400


def test_users_have_a_personal_vocabulary(corpus) -> None:
    """Two examples of one user share more words than examples of two different users."""
    words: dict[str, list[set[str]]] = defaultdict(list)
    for user, text in zip(corpus["user_id"].to_pylist(), corpus["text"].to_pylist(), strict=True):
        words[user].append({w.strip(".!?").lower() for w in text.split()})
    rng = np.random.default_rng(0)
    many = [u for u, sets in words.items() if len(sets) >= 2]

    def jaccard(a: set[str], b: set[str]) -> float:
        return len(a & b) / len(a | b)

    within = [jaccard(*rng.choice(words[u], 2, replace=False)) for u in many[:200]]
    between = []
    for _ in range(200):
        u, v = rng.choice(many, 2, replace=False)
        between.append(jaccard(words[u][0], words[v][0]))
    assert np.mean(within) > 2 * np.mean(between)
    vocabulary = Counter(w for sets in words.values() for s in sets for w in s)
    assert len(vocabulary) > 1000
