"""Each sampler's distribution, determinism, checkpoint and speed (fixed seeds)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats
from userdp.strategies.samplers import (
    BallsInBinsSampler,
    ExampleSubset,
    PoissonSampler,
    SamplerError,
    ShuffleSampler,
    TruncatedSampler,
    poisson_positions,
)


def test_poisson_inclusion_frequencies_are_bernoulli_q():
    n, q, steps = 200, 0.1, 4000
    sampler = PoissonSampler(q, seed=7)
    hits = np.zeros(n)
    sizes = []
    for t in range(steps):
        positions = sampler.sample(t, n)
        assert np.all(np.diff(positions) > 0) and positions.min(initial=0) >= 0
        assert positions.max(initial=0) < n
        hits[positions] += 1
        sizes.append(positions.size)
    # per-unit inclusion counts ~ Binomial(steps, q): chi-square test of the total spread
    expected = steps * q
    chi2 = float(((hits - expected) ** 2 / (expected * (1 - q))).sum())
    assert stats.chi2.sf(chi2, n) > 1e-3
    # cohort size ~ Binomial(n, q): mean and variance
    sizes = np.asarray(sizes)
    assert abs(sizes.mean() - n * q) < 4 * np.sqrt(n * q * (1 - q) / steps)
    assert sizes.var() == pytest.approx(n * q * (1 - q), rel=0.1)


def test_poisson_pairs_are_independent():
    # P(both of units 0 and 1 included) = q²
    q, steps = 0.3, 20000
    rng = np.random.default_rng(3)
    both = sum(1 for _ in range(steps) if {0, 1} <= set(poisson_positions(rng, 5, q).tolist()))
    assert abs(both / steps - q * q) < 4 * np.sqrt(q * q * (1 - q * q) / steps)


def test_poisson_is_deterministic_per_seed_and_step_and_checkpointable():
    a, b = PoissonSampler(0.05, seed=1), PoissonSampler(0.05, seed=1)
    np.testing.assert_array_equal(a.sample(3, 1000), b.sample(3, 1000))
    assert not np.array_equal(a.sample(3, 1000), a.sample(4, 1000))
    c = PoissonSampler(0.05)
    assert not c.state_dict()["seed_was_given"]
    c.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(c.sample(9, 1000), a.sample(9, 1000))


def test_unseeded_samplers_differ():
    assert PoissonSampler(0.5).seed != PoissonSampler(0.5).seed


def test_poisson_samples_a_million_users():
    """Cohort sizes over a million users are Binomial(10^6, 0.01): mean 10^4, sd 99.5; six sd
    bounds every one of the ten draws (its speed is a benchmark, not a test)."""
    sampler = PoissonSampler(0.01, seed=0)
    for t in range(10):
        cohort = sampler.sample(t, 1_000_000)
        assert abs(len(cohort) - 10_000) < 6 * 99.5
        assert len(np.unique(cohort)) == len(cohort)


def test_example_subset_caps_at_g_and_is_uniform():
    counts = np.array([0, 1, 3, 4, 5, 7, 40])
    g = 4
    per_example = {u: np.zeros(c) for u, c in enumerate(counts)}
    trials = 3000
    for seed in range(trials):
        subset = ExampleSubset(counts, g, seed)
        assert len(subset) == int(np.minimum(counts, g).sum())
        for u, c in enumerate(counts):
            chosen = subset.examples[subset.offsets[u] : subset.offsets[u + 1]]
            assert len(chosen) == min(c, g)
            assert len(set(chosen.tolist())) == len(chosen)
            assert np.all(chosen < max(c, 1)) and np.all(np.diff(chosen) > 0)
            per_example[u][chosen] += 1
    for u, c in enumerate(counts):
        if c == 0:
            continue
        p = min(c, g) / c
        freq = per_example[u] / trials
        assert np.all(np.abs(freq - p) < 4.5 * np.sqrt(p * (1 - p) / trials) + 1e-12), (u, freq)


def test_example_subset_locate_maps_positions_to_users():
    counts = np.array([2, 0, 9, 1])
    subset = ExampleSubset(counts, 3, seed=0)
    users, examples = subset.locate(np.arange(len(subset)))
    assert users.tolist() == [0, 0, 2, 2, 2, 3]
    assert examples[:2].tolist() == [0, 1] and examples[-1] == 0


def test_example_subset_large_population() -> None:
    counts = np.random.default_rng(0).integers(1, 200, size=50_000)
    subset = ExampleSubset(counts, 16, seed=1)
    assert len(subset) == int(np.minimum(counts, 16).sum())


@pytest.mark.parametrize("semantics", ["balls-in-bins-fixed", "balls-in-bins-epoch"])
def test_balls_in_bins_each_unit_once_per_epoch(semantics):
    n, b = 101, 5
    sampler = BallsInBinsSampler(b, semantics, seed=4)
    for epoch in range(3):
        seen = np.concatenate([sampler.sample(epoch * b + s, n) for s in range(b)])
        assert sorted(seen.tolist()) == list(range(n))
    first = sampler.bin_of(0, n)
    second = sampler.bin_of(1, n)
    assert np.array_equal(first, second) == (semantics == "balls-in-bins-fixed")
    # a unit's step in epoch e is e·b + its bin
    unit = 17
    step_of = [s for s in range(b) if unit in sampler.sample(s, n)]
    assert step_of == [first[unit]]


def test_balls_in_bins_bins_are_uniform_and_independent():
    n, b, trials = 30, 3, 3000
    counts = np.zeros((n, b))
    same = 0
    for seed in range(trials):
        bins = BallsInBinsSampler(b, "balls-in-bins-fixed", seed=seed).bin_of(0, n)
        counts[np.arange(n), bins] += 1
        same += bins[0] == bins[1]
    chi2 = float(((counts - trials / b) ** 2 / (trials / b)).sum())
    assert stats.chi2.sf(chi2, n * (b - 1)) > 1e-3
    assert abs(same / trials - 1 / b) < 4 * np.sqrt((1 / b) * (1 - 1 / b) / trials)


def test_shuffle_fixed_size_each_unit_once_per_epoch():
    sampler = ShuffleSampler(10 / 35, seed=2)  # cohorts of round(q·n) = 10
    cohorts = [sampler.sample(s, 35) for s in range(3)]
    assert all(c.size == 10 for c in cohorts)
    assert len(set(np.concatenate(cohorts).tolist())) == 30
    assert sampler.expected_size(35) == 10
    assert not sampler.accounted and sampler.sampling == "shuffle"
    with pytest.raises(SamplerError):
        ShuffleSampler(2.0)


def test_truncated_caps_cohorts_and_keeps_uniform_subset():
    base = PoissonSampler(0.5, seed=5)
    sampler = TruncatedSampler(base, 20, seed=6)
    kept = np.zeros(100)
    for s in range(2000):
        c = sampler.sample(s, 100)
        assert c.size <= 20
        kept[c] += 1
    # symmetric: every unit kept equally often
    assert kept.std() / kept.mean() < 0.1
    state = sampler.state_dict()
    other = TruncatedSampler(PoissonSampler(0.5), 20)
    other.load_state_dict(state)
    np.testing.assert_array_equal(other.sample(11, 100), sampler.sample(11, 100))


def test_sampler_rejects_bad_parameters():
    with pytest.raises(SamplerError):
        PoissonSampler(0.0)
    with pytest.raises(SamplerError):
        BallsInBinsSampler(3, "sometimes")
    with pytest.raises(SamplerError):
        PoissonSampler(0.1).load_state_dict(BallsInBinsSampler(2).state_dict())


@pytest.mark.parametrize("q", [True, 0.0, 1.5, "0.1"])
def test_a_sampling_rate_is_a_real_number_in_the_unit_interval(q):
    """``True`` is not the rate 1: the samplers check rates as the accountants do."""
    with pytest.raises(SamplerError, match=r"sampling_prob=.* expected a float in \(0, 1\]"):
        PoissonSampler(q, seed=0)


def test_ranked_example_subset_is_each_users_first_g_ranks():
    counts = np.array([2, 0, 9, 1, 4])
    subset = ExampleSubset(counts, 3, seed=0, ranked=True)
    users, ranks = subset.locate(np.arange(len(subset)))
    assert users.tolist() == [0, 0, 2, 2, 2, 3, 4, 4, 4]
    assert ranks.tolist() == [0, 1, 0, 1, 2, 0, 0, 1, 2]
    # the same D_sub on every build (nothing is drawn): a resume rebuilds it exactly
    again = ExampleSubset(counts, 3, seed=7, ranked=True)
    assert again.examples.tolist() == subset.examples.tolist()
