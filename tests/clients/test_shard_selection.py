"""Selection strategies (Chua et al., "Mind the Privacy Unit! User-Level Differential Privacy for
Language Model Fine-Tuning", §4.1, §5.1): what each returns for one user's examples."""

from __future__ import annotations

import numpy as np
import pytest
from userdp.clients.selection import (
    SELECTION_STRATEGIES,
    MissingPerplexityError,
    select_examples,
)

from userdp.config import DataConfig


def _examples(lengths: list[int]) -> list[np.ndarray]:
    # example i is filled with the value i, so a selected array tells which example it came from
    return [np.full(n, i, dtype=np.int32) for i, n in enumerate(lengths)]


LENGTHS = [5, 50, 3, 50, 20, 1, 7]


def test_strategies_match_the_config_choices() -> None:
    assert set(SELECTION_STRATEGIES) == set(
        DataConfig.model_fields["selection"].annotation.__args__
    )


def test_longest_and_shortest_pick_by_token_length_ties_to_earlier() -> None:
    rng = np.random.default_rng(0)
    longest = select_examples(_examples(LENGTHS), 3, "longest", 1000, rng)
    assert [int(e[0]) for e in longest] == [1, 3, 4]
    shortest = select_examples(_examples(LENGTHS), 2, "shortest", 1000, rng)
    assert [int(e[0]) for e in shortest] == [5, 2]


def test_truncation_to_seq_len() -> None:
    chosen = select_examples(_examples(LENGTHS), 2, "longest", 8, np.random.default_rng(0))
    assert [len(e) for e in chosen] == [8, 8]


def test_random_is_without_replacement_and_uniform() -> None:
    rng = np.random.default_rng(1)
    counts = np.zeros(len(LENGTHS))
    for _ in range(3000):
        chosen = [int(e[0]) for e in select_examples(_examples(LENGTHS), 3, "random", 100, rng)]
        assert len(set(chosen)) == 3
        counts[chosen] += 1
    # each example is picked with probability 3/7; 3000 draws -> std of a count ≈ 27
    assert np.all(np.abs(counts - 3000 * 3 / 7) < 6 * 27)


def test_group_size_larger_than_user_or_none_returns_all() -> None:
    rng = np.random.default_rng(2)
    for strategy in ("random", "longest", "shortest"):
        assert len(select_examples(_examples(LENGTHS), 100, strategy, 100, rng)) == len(LENGTHS)
        assert len(select_examples(_examples(LENGTHS), None, strategy, 100, rng)) == len(LENGTHS)
    assert select_examples([], 4, "random", 10, rng) == []


def test_random_chunk_windows_come_from_the_concatenated_document() -> None:
    examples = [np.arange(0, 10), np.arange(10, 25), np.arange(25, 30)]
    rng = np.random.default_rng(3)
    starts = set()
    chunks = select_examples(examples, 500, "random_chunk", 8, rng)
    assert len(chunks) == 500
    for chunk in chunks:
        assert len(chunk) == 8
        assert np.array_equal(chunk, np.arange(chunk[0], chunk[0] + 8))  # contiguous in the doc
        starts.add(int(chunk[0]))
    assert starts == set(range(0, 30 - 8 + 1))  # every offset reachable, windows span records


def test_random_chunk_inserts_separator_and_handles_short_documents() -> None:
    examples = [np.array([5, 6]), np.array([7])]
    chunks = select_examples(examples, 3, "random_chunk", 16, np.random.default_rng(0), separator=1)
    assert [c.tolist() for c in chunks] == [[5, 6, 1, 7]] * 3


PERPLEXITIES = [3.0, 9.5, float("nan"), 9.5, 1.25, 1.25, 40.0]


def test_highest_and_lowest_ppl_rank_by_perplexity_ties_to_earlier_unscored_last() -> None:
    rng = np.random.default_rng(0)
    highest = select_examples(
        _examples(LENGTHS), 3, "highest_ppl", 1000, rng, perplexities=PERPLEXITIES
    )
    assert [int(e[0]) for e in highest] == [6, 1, 3]
    lowest = select_examples(
        _examples(LENGTHS), 3, "lowest_ppl", 1000, rng, perplexities=np.array(PERPLEXITIES)
    )
    assert [int(e[0]) for e in lowest] == [4, 5, 0]
    everything = select_examples(
        _examples(LENGTHS), None, "highest_ppl", 4, rng, perplexities=PERPLEXITIES
    )
    assert [int(e[0]) for e in everything] == [6, 1, 3, 0, 4, 5, 2]  # NaN (unscored) last
    assert all(len(e) <= 4 for e in everything)


def test_perplexity_selection_is_deterministic_per_user() -> None:
    picks = {
        tuple(
            int(e[0])
            for e in select_examples(
                _examples(LENGTHS),
                2,
                "lowest_ppl",
                100,
                np.random.default_rng(seed),
                perplexities=PERPLEXITIES,
            )
        )
        for seed in range(5)
    }
    assert picks == {(4, 5)}


def test_perplexity_selection_without_perplexities_names_the_key() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(MissingPerplexityError, match=r"data\.selection = 'highest_ppl'") as exc:
        select_examples(_examples(LENGTHS), 2, "highest_ppl", 8, rng)
    assert "\n" not in str(exc.value)
    with pytest.raises(MissingPerplexityError, match="3 perplexities for 7 examples"):
        select_examples(_examples(LENGTHS), 2, "lowest_ppl", 8, rng, perplexities=[1.0, 2.0, 3.0])


def test_unknown_strategies_and_bad_group_sizes_are_rejected() -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="selection must be one of"):
        select_examples(_examples(LENGTHS), 2, "best", 8, rng)
    with pytest.raises(ValueError, match="group_size"):
        select_examples(_examples(LENGTHS), 0, "random", 8, rng)


def test_example_units_name_records_by_index_or_by_rank() -> None:
    from userdp.clients.selection import example_at, ranking

    examples = _examples(LENGTHS)
    assert ranking(examples, "longest").tolist() == [1, 3, 4, 6, 0, 2, 5]
    # random: the coordinator drew the index; ranked: the index is a rank in the user's order
    assert int(example_at(examples, 2, "random", 1000)[0]) == 2
    assert int(example_at(examples, 2, "longest", 1000, group_size=3)[0]) == 4
    assert int(example_at(examples, 0, "shortest", 1000, group_size=3)[0]) == 5
    assert len(example_at(examples, 0, "longest", 8)) == 8
    with pytest.raises(IndexError, match="first 3 records"):
        example_at(examples, 3, "longest", 1000, group_size=3)
    with pytest.raises(ValueError, match="cuts windows across"):
        example_at(examples, 0, "random_chunk", 1000)
