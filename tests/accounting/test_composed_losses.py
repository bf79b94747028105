"""The grouped-composition estimator of an E-fold composition (accounting/composed_losses.py),
checked against a brute-force sum over every tuple, the block-sum Monte Carlo estimator it
replaces for per-epoch bins, and the exact Gaussian composition."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from userdp.accounting import balls_in_bins as bb
from userdp.accounting import monte_carlo as mc
from userdp.accounting.composed_losses import composed_losses

Z_TOL = 5.33  # two-sided normal quantile of the suite's 1e-7 false-alarm rate


def test_estimate_equals_the_average_over_every_tuple_of_the_rounded_samples() -> None:
    # 3 groups of 7 samples: 343 tuples, enumerated directly. The estimator rounds every sample
    # UP to its grid, so the brute force does too; the FFT adds only round-off.
    rng = np.random.default_rng(0)
    y = rng.normal(0.3, 1.2, size=22)  # 22 = 3·7 + 1: the last sample is not used
    est = composed_losses([y[:10], y[10:]], 3, y.size)
    step = est.step
    rounded = np.ceil(y[:21] / step) * step
    groups = [rounded[j::3] for j in range(3)]
    for eps in (0.0, 0.4, 1.3, 2.5):
        brute = np.mean(
            [max(0.0, 1.0 - math.exp(eps - sum(t))) for t in itertools.product(*groups)]
        )
        assert est.point(eps) == pytest.approx(brute, abs=1e-13)
        assert est.delta(eps)[0] == est.point(eps)
    assert est.num_samples == 7
    assert est.point(est.max_loss()) <= 1e-15
    # rounding up never lowers a loss, so the estimate is at least the unrounded one
    exact = [y[j:21:3] for j in range(3)]
    unrounded = np.mean([max(0.0, 1.0 - math.exp(1.3 - sum(t))) for t in itertools.product(*exact)])
    assert unrounded <= est.point(1.3) <= unrounded + 3 * step * math.exp(1.3)


def _block_sum_estimate(sigma, bins, epochs, eps, samples, seed) -> tuple[float, float]:
    """The block-sum estimator: ``samples`` independent E-epoch losses, each the sum of E fresh
    one-epoch losses (max over the directions; its standard error)."""
    pair = bb.dominating_pair(bins, epochs, bin_semantics="per-epoch")
    sampler = bb.LossSampler(pair, samples * epochs, seed, bb.ESTIMATE)
    best = (-1.0, 0.0)
    for y in sampler.losses(sigma):
        total = y.reshape(samples, epochs).sum(axis=1)
        best = max(best, mc.delta_from_losses(total[total > 0], eps, samples))
    return best


@pytest.mark.parametrize(
    ("sigma", "bins", "epochs", "eps"),
    [(1.0, 4, 3, 1.0), (2.0, 16, 8, 0.5), (0.8, 8, 2, 2.0), (1.5, 32, 5, 1.0)],
)
def test_per_epoch_estimate_agrees_with_the_block_sum_estimator(sigma, bins, epochs, eps) -> None:
    new = bb.delta_estimate(
        sigma, bins, epochs, eps, bin_semantics="per-epoch", num_samples=2**17, seed=1
    )
    old, old_se = _block_sum_estimate(sigma, bins, epochs, eps, 2**15, seed=2)
    assert new.independent_samples == 2**17 // epochs
    assert abs(new.delta - old) <= Z_TOL * math.hypot(new.stderr, old_se), (new, old, old_se)
    # from the same draws, the grouped estimate is more precise than E-sample blocks would be
    assert new.stderr < old_se * math.sqrt(2**15 / (2**17 // epochs))


@pytest.mark.parametrize("eps", [0.5, 1.5, 3.0])
def test_one_bin_per_epoch_estimate_is_the_exact_gaussian_composition(eps) -> None:
    # One bin: each epoch is the Gaussian mechanism, E of them compose to sensitivity √E.
    sigma, epochs = 2.0, 5
    est = bb.delta_estimate(
        sigma, 1, epochs, eps, bin_semantics="per-epoch", num_samples=2**18, seed=4
    )
    exact = bb.gaussian_delta(eps, math.sqrt(epochs), sigma)
    assert abs(est.delta - exact) <= Z_TOL * est.stderr + 1e-12, (est, exact)
    assert est.upper_bound >= exact


def test_reported_standard_error_covers_the_spread_across_seeds() -> None:
    # The reported error is a plug-in value of an upper bound on the variance; over 40 seeds the
    # sample standard deviation of δ̂ (relative error ≈ 1/√80 ≈ 11 %) must not exceed it by more
    # than chance allows (1.5×: over 4 standard deviations of that estimate).
    ests = [
        bb.delta_estimate(1.0, 4, 4, 1.0, bin_semantics="per-epoch", num_samples=2**12, seed=s)
        for s in range(40)
    ]
    spread = float(np.std([e.delta for e in ests], ddof=1))
    reported = float(np.mean([e.stderr for e in ests]))
    assert spread <= 1.5 * reported, (spread, reported)
    assert reported <= 3.0 * spread, (spread, reported)  # and the bound is not vacuous


def test_too_few_draws_for_the_epochs_is_a_clear_error() -> None:
    with pytest.raises(bb.BallsInBinsError, match=r"num_samples=3 is fewer than the 4 epochs"):
        bb.delta_estimate(1.0, 2, 4, 1.0, bin_semantics="per-epoch", num_samples=3)


def test_fft_round_off_stays_within_the_stated_bound() -> None:
    # The certificate adds roundoff_bound(ε) to δ̂: the FFT tail must be within it of the same
    # composition done exactly (direct convolution of the group histograms in float64 sums of
    # products, no transforms), down to tails far below any δ the accountant is asked for.
    rng = np.random.default_rng(5)
    groups, n = 4, 20_000
    y = rng.normal(-0.2, 0.6, size=groups * n)
    est = composed_losses([y], groups, y.size)
    cells = np.ceil(y / est.step).astype(np.int64)
    lo = int(cells.min())
    pmfs = [np.bincount(cells[j::groups] - lo) / n for j in range(groups)]
    exact = pmfs[0]
    for pmf in pmfs[1:]:
        exact = np.convolve(exact, pmf)
    sums = (groups * lo + np.arange(exact.size)) * est.step
    for eps in (0.5, 1.5, 2.5, 3.5):
        direct = float(np.sum(exact * -np.expm1(np.minimum(eps - sums, 0.0))))
        assert abs(est.point(eps) - direct) <= est.roundoff_bound(eps), (eps, direct)
        assert est.roundoff_bound(eps) < 1e-8


@pytest.mark.parametrize("delta", [1e-1, 1e-3, 1e-5])
def test_epsilon_is_the_exact_smallest_root_of_both_estimators(delta) -> None:
    # The closed form on the support's intervals against the definition: δ̂ at the returned ε is
    # δ (to float64 round-off of the tail sums), and a hair below it δ̂ exceeds δ. Losses with
    # ties exercise the duplicate support points of the sample mean.
    rng = np.random.default_rng(1)
    y = np.round(rng.normal(0.5, 1.5, size=50_000), 2)
    sampled = mc.SampledLosses(y, y.size)
    composed = composed_losses([y], 4, y.size)
    for est in (sampled, composed):
        eps = est.epsilon(delta)
        assert eps > 0.0
        assert est.point(eps) == pytest.approx(delta, rel=1e-9)
        assert est.point(eps * (1 - 1e-6)) > delta
    # the max over estimators is the larger of their own ε (each δ̂ is non-increasing)
    both = mc.epsilon_from_estimates([sampled, composed], delta)
    assert both == max(sampled.epsilon(delta), composed.epsilon(delta))
    assert max(sampled.point(both), composed.point(both)) <= delta * (1 + 1e-9)


def test_epsilon_is_zero_when_delta_is_met_at_zero_and_for_no_positive_loss() -> None:
    y = np.array([-1.0, -0.5, 0.2])  # δ̂(0) = (1 − e^{−0.2})/3 ≈ 0.060
    assert mc.SampledLosses(y, 3).epsilon(0.1) == 0.0
    assert mc.SampledLosses(np.array([-1.0, 0.0]), 2).epsilon(1e-9) == 0.0
    eps = mc.SampledLosses(y, 3).epsilon(0.01)
    assert 0.0 < eps < 0.2 and (1 - math.exp(eps - 0.2)) / 3 == pytest.approx(0.01, rel=1e-12)
