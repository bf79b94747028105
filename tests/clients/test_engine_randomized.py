"""The ``randomized`` engine (DP-SGD-RC, "Efficient DP-SGD for LLMs with Randomized Clipping"):
Hutchinson sketches with Gaussian probes N(0, 1/k), fresh per call; exact in the identity-probe
test mode; unbiased; the rank-1 law χ²_k/k that accounting/randomized_clipping.py assumes;
clipping by the ESTIMATED norm."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats
from userdp.clients.batching import prepare_units
from userdp.clients.clipping import Accumulator, UnitWork
from userdp.clients.engine import ClippingEngine
from userdp.clients.norms import Factor, materialize, sketch_squared_norm
from userdp.clients.sketch import GaussianProbes, IdentityProbes
from userdp.clients.vectorized import vectorized_clipped_sum

from tests.clients.engine_fixtures import (
    assert_sums_close,
    random_units,
    tiny_model,
    total_norm,
)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_identity_probes_make_the_randomized_engine_equal_loop(model):
    units = random_units(6, seed=21, max_examples=5)
    loop = ClippingEngine(model, engine="loop").clipped_sum(units, 3.5)
    assert 0 < loop.stats.clipped < 6
    engine = ClippingEngine(model, engine="randomized")
    acc = Accumulator(engine.params, 3.5)
    prepared = prepare_units(units, engine.max_positions)
    indices = list(range(len(units)))
    vectorized_clipped_sum(
        UnitWork(model, engine.params, prepared, indices, acc, 8192, 0), probes=IdentityProbes()
    )
    exact = acc.result()
    assert_sums_close(exact.sums, loop.sums, rtol=2e-5)
    assert exact.stats.clipped == loop.stats.clipped
    assert exact.stats.norm_sum == pytest.approx(loop.stats.norm_sum, rel=1e-5)


def test_nothing_clipped_randomized_equals_loop(model):
    units = random_units(5, seed=22)
    loop = ClippingEngine(model, engine="loop").clipped_sum(units, 1e6)
    rnd = ClippingEngine(model, engine="randomized", probes=4).clipped_sum(units, 1e6)
    assert rnd.stats.clipped == 0
    assert_sums_close(rnd.sums, loop.sums, rtol=2e-5)
    assert rnd.stats.norm_sum != pytest.approx(
        loop.stats.norm_sum, rel=1e-6
    )  # estimates, not exact norms


def test_zero_probes_means_exact_norms(model):
    units = random_units(4, seed=23)
    loop = ClippingEngine(model, engine="loop").clipped_sum(units, 3.0)
    exact = ClippingEngine(model, engine="randomized").clipped_sum(units, 3.0, probes=0)
    assert_sums_close(exact.sums, loop.sums, rtol=2e-5)
    assert exact.stats.norm_sum == pytest.approx(loop.stats.norm_sum, rel=1e-5)


def test_units_are_clipped_by_the_estimated_norm(model):
    """Contribution = g·C/√n̂, so its norm is C·‖g‖/√n̂ (= C·Z), not C."""
    unit = random_units(1, seed=24)
    exact_norm = ClippingEngine(model, engine="loop").clipped_sum(unit, 1e6).stats.norm_max
    engine = ClippingEngine(model, engine="randomized", probes=2)
    ratios = []
    for seed in range(3):
        got = engine.clipped_sum(unit, 1e-3, probe_seed=seed)
        estimate = got.stats.norm_max
        assert got.stats.clipped == 1
        assert total_norm(got.sums) == pytest.approx(1e-3 * exact_norm / estimate, rel=1e-4)
        ratios.append(exact_norm / estimate)
    assert max(abs(r - 1) for r in ratios) > 1e-3


def test_fresh_probes_per_call_and_reproducible_only_with_a_test_seed(model):
    units = random_units(2, seed=25)
    engine = ClippingEngine(model, engine="randomized", probes=4)
    first = engine.clipped_sum(units, 1e6).stats.norm_sum_sq
    second = engine.clipped_sum(units, 1e6).stats.norm_sum_sq
    assert first != second
    seeded = [engine.clipped_sum(units, 1e6, probe_seed=7).stats.norm_sum_sq for _ in range(2)]
    assert seeded[0] == seeded[1]
    assert GaussianProbes(4).seed != GaussianProbes(4).seed  # os.urandom per task


def test_probes_are_gaussian_with_variance_one_over_k_and_fresh_per_draw():
    source = GaussianProbes(16, seed=0)
    a, b = source.draw(4000, torch.device("cpu")), source.draw(4000, torch.device("cpu"))
    assert a.shape == (4000, 16) and not torch.equal(a, b)
    scaled = (a * 4).flatten().numpy()  # √k·P ~ N(0, 1)
    assert stats.kstest(scaled, "norm").pvalue > 1e-3
    assert len(np.unique(np.abs(scaled))) > 1000  # not Rademacher ±1/√k


def _factors(rank_one: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    d0, d1, n = 12, 7, 10
    if rank_one:  # all rows of L parallel -> M = Σ l_t r_tᵀ is rank one
        base = torch.randn(1, d0, generator=gen)
        left = Factor(torch.randn(n, 1, generator=gen) * base, None, d0)
    else:
        left = Factor(torch.randn(n, d0, generator=gen), None, d0)
    onehot = Factor(None, torch.randint(0, d0, (n,), generator=gen), d0)
    uses = [(left, torch.randn(n, d1, generator=gen))]
    if not rank_one:
        uses.append((onehot, torch.randn(n, d1, generator=gen)))  # a tied second use
    return uses, torch.Size([d0, d1])


def test_sketch_is_unbiased_with_the_hutchinson_variance():
    uses, shape = _factors(rank_one=False)
    matrix = materialize(uses, shape).double()
    exact = float(matrix.pow(2).sum())
    eig = torch.linalg.svdvals(matrix).pow(2)
    k, draws = 8, 4000
    source = GaussianProbes(k, seed=1)
    estimates = np.array(
        [
            sketch_squared_norm(uses, source.draw(shape[0], torch.device("cpu")))
            for _ in range(draws)
        ]
    )
    se = estimates.std(ddof=1) / math.sqrt(draws)
    assert abs(estimates.mean() - exact) < 4 * se
    expected_var = 2 * float(eig.pow(2).sum()) / k  # Var n̂ = 2 Σ λ² / k
    assert estimates.var(ddof=1) == pytest.approx(expected_var, rel=0.12)


def test_rank_one_sketch_has_the_chi_square_law_the_accountant_assumes():
    """n̂ / ‖M‖² ~ χ²_k / k for a rank-one M: the worst case of the envelope accountant."""
    uses, shape = _factors(rank_one=True)
    exact = float(materialize(uses, shape).double().pow(2).sum())
    k = 4
    source = GaussianProbes(k, seed=2)
    ratios = [
        sketch_squared_norm(uses, source.draw(shape[0], torch.device("cpu"))) / exact
        for _ in range(3000)
    ]
    assert stats.kstest(np.array(ratios) * k, stats.chi2(k).cdf).pvalue > 1e-3
    assert stats.kstest(np.array(ratios) * k, stats.chi2(k + 2).cdf).pvalue < 1e-6


@pytest.mark.slow
def test_engine_norm_estimate_is_unbiased(model):
    """Statistical, fixed seeds (test-only path): E n̂_u = ‖g_u‖² through the whole engine."""
    unit = random_units(1, seed=26, max_examples=2)
    exact_sq = ClippingEngine(model, engine="loop").clipped_sum(unit, 1e6).stats.norm_sum_sq
    engine = ClippingEngine(model, engine="randomized", probes=4)
    estimates = np.array(
        [engine.clipped_sum(unit, 1e6, probe_seed=s).stats.norm_sum_sq for s in range(60)]
    )
    se = estimates.std(ddof=1) / math.sqrt(len(estimates))
    assert se > 0
    assert abs(estimates.mean() - exact_sq) < 4 * se
