"""The randomized engine's Hutch++ estimator (Meyer, Musco, Musco, Woodruff, "Hutch++: Optimal
Stochastic Trace Estimation", as used by "Efficient DP-SGD for LLMs with Randomized Clipping"):
unbiased, exact when a gradient has rank ≤ k, lower variance than Hutchinson on a decaying
spectrum, and carried from the strategy through the wire task to the engine."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from userdp.clients import norms
from userdp.clients.batching import EngineError
from userdp.clients.engine import ClippingEngine, EngineRequest
from userdp.clients.norms import (
    Factor,
    Padded,
    batched_exact_squared_norms,
    batched_hutchpp_squared_norms,
)
from userdp.clients.sketch import GaussianProbes
from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.codec import task_from_proto, task_proto
from userdp.strategies import RandomizedClipping

from tests.clients.engine_fixtures import assert_sums_close, random_units, tiny_model
from tests.clients.spectra import (
    CPU,
    estimates,
    hutchinson,
    hutchpp,
    spectral_uses,
)

# One-sided false alarm 5e-8 per comparison (a normal deviate of 5.33), as in the other
# statistical checks of the suite.
Z = 5.33


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def _tied_units(lengths, d0=20, d1=16, seed=0):
    """Units of ``lengths`` rows for a tied weight: a dense use and a onehot use (as GPT-2's wte /
    lm_head), padded unevenly."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    uses = [
        (Factor(torch.randn(n, d0, generator=gen), None, d0), torch.randn(n, d1, generator=gen)),
        (
            Factor(None, torch.randint(0, d0, (n,), generator=gen), d0),
            torch.randn(n, d1, generator=gen),
        ),
    ]
    starts = np.cumsum([0, *lengths])
    spans = [slice(int(a), int(b)) for a, b in zip(starts[:-1], starts[1:], strict=True)]
    return uses, Padded.of(spans, n, CPU), torch.Size([d0, d1])


def test_hutchpp_is_unbiased_against_the_exact_engine_norm():
    """Mean of 2000 fixed-seed draws within Z standard errors of the vectorized engine's exact
    norm, per unit (2·4, 2·12 and 2·20 rows of a tied weight: ranks > k = 4)."""
    uses, padded, shape = _tied_units([4, 12, 20])
    exact = batched_exact_squared_norms(uses, padded, shape).numpy()
    source = GaussianProbes(4, seed=11)
    draws = np.stack(
        [
            batched_hutchpp_squared_norms(
                uses, source.draw(shape[0], CPU), source.draw(shape[0], CPU), padded
            ).numpy()
            for _ in range(2000)
        ]
    )
    se = draws.std(0, ddof=1) / math.sqrt(len(draws))
    assert np.all(se > 0)
    assert np.all(np.abs(draws.mean(0) - exact) < Z * se)


def test_hutchpp_is_exact_when_the_rank_is_at_most_k():
    """T rows per use, two uses: rank M ≤ 2T ≤ k, so Q spans M's columns and the tail is 0; what
    is left is float32 rounding (unit roundoff 6e-8, summed over ≤ 20 terms per product and a QR
    of a 20 × 8 matrix), far below the 1e-5 relative tolerance; a random draw of Hutchinson at
    k = 8 is off by ~50% (relative sd √(2/k))."""
    uses, padded, shape = _tied_units([1, 3, 4])
    exact = batched_exact_squared_norms(uses, padded, shape).numpy()
    source = GaussianProbes(8, seed=12)
    for _ in range(20):
        got = batched_hutchpp_squared_norms(
            uses, source.draw(shape[0], CPU), source.draw(shape[0], CPU), padded
        ).numpy()
        np.testing.assert_allclose(got, exact, rtol=1e-5)


def test_hutchpp_is_exact_when_k_covers_the_leading_dimension():
    uses, padded, shape = _tied_units([9, 30], d0=6)  # k = 8 ≥ d0: Q is a basis of ℝ^{d0}
    exact = batched_exact_squared_norms(uses, padded, shape).numpy()
    source = GaussianProbes(8, seed=13)
    got = batched_hutchpp_squared_norms(uses, source.draw(6, CPU), source.draw(6, CPU), padded)
    np.testing.assert_allclose(got.numpy(), exact, rtol=1e-5)


def test_hutchpp_has_lower_variance_than_hutchinson_on_a_decaying_spectrum():
    """λ_j ∝ j⁻², d = 24, k = 4: Hutch++'s relative sd is ≈ 0.05 against ≈ 0.45 for Hutchinson
    with the same k and ≈ 0.23 with 4k probes (the same number of k-wide passes). The sample
    variances of 2000 draws carry a relative error √((κ − 1)/n) ≈ 0.1 for these χ²-like laws
    (kurtosis κ ≲ 20), so a factor-4 margin is many standard errors from failing."""
    d, k, n = 24, 4, 2000
    uses, padded, exact = spectral_uses([1 / j**2 for j in range(1, d + 1)], d, d)
    plus = estimates(hutchpp, uses, padded, d, k, n, seed=1)
    same_k = estimates(hutchinson, uses, padded, d, k, n, seed=2)
    same_cost = estimates(hutchinson, uses, padded, d, 4 * k, n, seed=3)
    assert abs(plus.mean() - exact) < Z * plus.std(ddof=1) / math.sqrt(n)
    assert plus.var() < same_cost.var() / 4 < same_k.var() / 4


@pytest.mark.parametrize("lengths", [[6, 6, 6], [3, 9, 5]], ids=["uniform", "ragged"])
def test_chunks_of_units_give_the_same_estimates(lengths, monkeypatch):
    uses, padded, shape = _tied_units(lengths)
    source = GaussianProbes(4, seed=15)
    probes = source.draw(shape[0], CPU), source.draw(shape[0], CPU)
    whole = batched_hutchpp_squared_norms(uses, *probes, padded)
    monkeypatch.setattr(norms, "MAX_BUFFER_ELEMENTS", 1)  # one unit per chunk
    chunked = batched_hutchpp_squared_norms(uses, *probes, padded)
    np.testing.assert_allclose(chunked.numpy(), whole.numpy(), rtol=1e-6)


def test_a_non_finite_unit_does_not_reach_the_others():
    uses, padded, shape = _tied_units([5, 7, 6])
    exact = batched_exact_squared_norms(uses, padded, shape).numpy()
    (left, right), tied = uses
    bad = right.clone()
    bad[6] = float("nan")  # a row of the second unit
    source = GaussianProbes(16, seed=14)  # k ≥ 2·7: exact for every unit
    got = batched_hutchpp_squared_norms(
        [(left, bad), tied], source.draw(20, CPU), source.draw(20, CPU), padded
    ).numpy()
    assert np.isnan(got[1])
    np.testing.assert_allclose(got[[0, 2]], exact[[0, 2]], rtol=1e-5)


def test_probes_and_engine_refuse_an_unknown_estimator(model):
    with pytest.raises(ValueError, match="'hutch'"):
        GaussianProbes(4, estimator="hutch")
    with pytest.raises(EngineError, match="'hutch'"):
        ClippingEngine(model, engine="randomized", estimator="hutch")
    engine = ClippingEngine(model, engine="randomized")
    with pytest.raises(EngineError, match="'hutch'"):
        engine.clipped_sum(random_units(1), 1.0, estimator="hutch")


def _short_units():
    # ≤ 2 examples of ≤ 5 tokens: ≤ 10 positions per unit, so every per-unit weight gradient has
    # rank ≤ 20 (the tied wte / lm_head: two uses) — exact for Hutch++ with k = 20, while the
    # smallest leading dimension (wpe, 24 positions) stays above k
    return random_units(5, seed=31, max_examples=2, lo=3, hi=5)


def test_a_hutchpp_training_step_clips_like_loop_when_ranks_are_small(model):
    units = _short_units()
    loop = ClippingEngine(model, engine="loop").clipped_sum(units, 10.0)
    assert 0 < loop.stats.clipped < len(units)
    engine = ClippingEngine(model, engine="randomized", probes=20, estimator="hutch++")
    plus = engine.clipped_sum(units, 10.0)
    assert plus.stats.clipped == loop.stats.clipped
    assert plus.stats.norm_sum == pytest.approx(loop.stats.norm_sum, rel=1e-5)
    assert_sums_close(plus.sums, loop.sums, rtol=2e-5)
    # plain Hutchinson with as many probes only estimates: its relative error on this norm sum
    # has a standard deviation of about 2 % (300 draws), so an unseeded draw lands within 1e-3
    # of the exact sum about 4 % of the time; seed 0's draw is 1.5 % off
    plain = ClippingEngine(model, engine="randomized", probes=20)
    estimate = plain.clipped_sum(units, 10.0, probe_seed=0)
    assert estimate.stats.norm_sum != pytest.approx(loop.stats.norm_sum, rel=1e-3)


def test_the_strategys_estimator_reaches_the_engine_over_the_wire_task(model):
    strategy = RandomizedClipping(
        probes=20, estimator="hutch++", noise_multiplier=1.0, clip_norm=10.0, sampling_prob=0.5
    )
    spec = strategy.configure_task(0, strategy.sample_cohort(0, ("a", "b")))
    assert spec.estimator == "hutch++"
    decoded = task_from_proto(task_proto(spec, 0, "t", 0, 0, ["a"], 60.0))
    units = _short_units()
    assert EngineRequest.of_task(decoded, units).estimator == "hutch++"
    loop = ClippingEngine(model, engine="loop").clipped_sum(units, decoded.clip_norm)
    engine = ClippingEngine(model)  # the worker's defaults: vectorized, Hutchinson
    got = engine.run(EngineRequest.of_task(decoded, units))
    assert got.stats.norm_sum == pytest.approx(loop.stats.norm_sum, rel=1e-5)
    assert_sums_close(got.sums, loop.sums, rtol=2e-5)


def test_an_empty_wire_estimator_means_hutchinson():
    task = pb.Task(engine=pb.EngineOptions(engine="randomized", probes=8))
    assert task_from_proto(task).estimator == "hutchinson"
    assert task_from_proto(pb.Task(engine=pb.EngineOptions(engine="vectorized"))).estimator is None


def test_the_engines_hutchpp_draws_the_tail_probes_apart_from_the_head_probes():
    # The accountant's argument needs P independent of S (hence of Q): the engine's sketch must
    # draw two fresh probe matrices per weight, S first, and use the second as P.
    from userdp.clients.sketch import sketched_squared_norms

    class Recording(GaussianProbes):
        def __init__(self):
            super().__init__(6, estimator="hutch++", seed=4)
            self.draws = []

        def draw(self, dim, device):
            probe = super().draw(dim, device)
            self.draws.append(probe.clone())
            return probe

    uses, padded, shape = _tied_units([30, 12, 25])
    source = Recording()
    got = sketched_squared_norms(uses, source, padded, shape[0], CPU)
    assert len(source.draws) == 2
    head, tail = source.draws
    assert not torch.equal(head, tail)
    expected = batched_hutchpp_squared_norms(uses, head, tail, padded)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
