"""Embedded default data, generated deterministically by code (no files shipped).

:func:`demo_corpus` is a synthetic user-partitioned text corpus. Every user has a personal
vocabulary (a few "favourite" words from a shared lexicon), a topic mixture, a sentence-length
style and a signature phrase, so a user's examples resemble each other more than other users'
(the regime where user-level sampling with per-user averaging pays off). The number of examples
per user is heavy-tailed (discrete Pareto, tail index 1.1, median ~8, capped at 400): most users
have a few examples and a few users have hundreds, like Stack Overflow / CC-News (Charles et al.,
"Fine-Tuning Large Language Models with User-Level Differential Privacy", Table 1).
``userdp shard --demo OUT`` writes it as shards.

It is reproducible for a given seed and numpy version (numpy's PCG64 ``Generator``).
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

DEMO_SEED = 20240601
DEMO_NUM_SHARDS = 4
"""Shards the embedded corpus is written to (what ``workers.count`` x ``workers.replicas`` can
keep busy without ``data.shards``)."""
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_NUM_TOPICS = 8
_LEXICON_SIZE = 2000
_TOPIC_WORDS = 120


def _lexicon(rng: np.random.Generator, size: int) -> list[str]:
    words: set[str] = set()
    ordered: list[str] = []
    while len(ordered) < size:
        syllables = rng.integers(1, 4)
        word = "".join(
            _CONSONANTS[rng.integers(len(_CONSONANTS))] + _VOWELS[rng.integers(len(_VOWELS))]
            for _ in range(syllables)
        )
        if word not in words:
            words.add(word)
            ordered.append(word)
    return ordered


def examples_per_user(num_users: int, rng: np.random.Generator, cap: int = 400) -> np.ndarray:
    """Heavy-tailed example counts: floor(8·X) − 7 with X ~ Pareto(α = 1.1, x_min = 1), capped.

    Minimum 1, median about 8, mean about 40 before the cap at ``cap``.
    """
    pareto = rng.pareto(1.1, size=num_users) + 1.0
    return np.minimum(np.floor(8 * pareto).astype(np.int64) - 7, cap)


def demo_corpus(num_users: int = 400, seed: int = DEMO_SEED) -> pa.Table:
    """Table with columns ``user_id`` (``user-00000`` ...) and ``text``; see the module docstring."""
    if num_users < 1:
        raise ValueError(f"demo corpus needs at least 1 user, got {num_users}")
    rng = np.random.default_rng(seed)
    lexicon = np.array(_lexicon(rng, _LEXICON_SIZE))
    function_words = np.array(["the", "a", "of", "and", "to", "in", "is", "that", "with", "for"])
    topics = np.stack(
        [rng.choice(_LEXICON_SIZE, size=_TOPIC_WORDS, replace=False) for _ in range(_NUM_TOPICS)]
    )
    counts = examples_per_user(num_users, rng)
    users: list[str] = []
    texts: list[str] = []
    for u in range(num_users):
        topic_mix = rng.dirichlet(np.full(_NUM_TOPICS, 0.3))
        favourites = lexicon[rng.choice(_LEXICON_SIZE, size=12, replace=False)]
        signature = " ".join(lexicon[rng.choice(_LEXICON_SIZE, size=3, replace=False)])
        mean_len = rng.uniform(6, 20)
        end = ".!?"[rng.integers(3)]
        capitalize = rng.random() < 0.5
        n = int(counts[u])
        sentences_per_example = rng.integers(1, 4, size=n)
        lengths = np.maximum(3, rng.poisson(mean_len, size=int(sentences_per_example.sum())))
        total = int(lengths.sum())
        # each word: a favourite (25%), a function word (20%) or a word of a topic of the user's mix
        kind = rng.random(total)
        topic_words = topics[
            rng.choice(_NUM_TOPICS, size=total, p=topic_mix), rng.integers(_TOPIC_WORDS, size=total)
        ]
        words = np.where(
            kind < 0.25,
            favourites[rng.integers(12, size=total)],
            np.where(
                kind < 0.45, function_words[rng.integers(10, size=total)], lexicon[topic_words]
            ),
        ).tolist()
        signed = rng.random(n) < 0.3
        cuts = np.cumsum(lengths)[:-1]
        sentences = [" ".join(part) + end for part in np.split(np.array(words, dtype=object), cuts)]
        if capitalize:
            sentences = [s.capitalize() for s in sentences]
        first = 0
        for j in range(n):
            k = int(sentences_per_example[j])
            parts = sentences[first : first + k] + ([signature] if signed[j] else [])
            first += k
            users.append(f"user-{u:05d}")
            texts.append(" ".join(parts))
    return pa.table({"user_id": pa.array(users, pa.string()), "text": pa.array(texts, pa.string())})
