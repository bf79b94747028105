"""The fast mixture-of-Gaussians PLD (ELS, and ULS as its G = 1 case) against dp_accounting's own
construction."""

from __future__ import annotations

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism as plm
from scipy import stats
from userdp.accounting import ElsMechanism, UlsMechanism, epsilon
from userdp.accounting.fast_pld import mixture_gaussian_deltas, mixture_gaussian_pld


def _binomial(group: int, p: float) -> tuple[list[int], np.ndarray]:
    sens = list(range(group + 1))
    return sens, stats.binom.pmf(sens, group, p)


@pytest.mark.parametrize("adjacency", [plm.AdjacencyType.REMOVE, plm.AdjacencyType.ADD])
@pytest.mark.parametrize(("group", "sigma", "p"), [(1, 1.0, 0.01), (16, 1.0, 0.01), (5, 0.6, 0.3)])
def test_hockey_stick_curve_matches_dp_accounting(adjacency, group, sigma, p) -> None:
    sens, probs = _binomial(group, p)
    loss = plm.MixtureGaussianPrivacyLoss(sigma, sens, probs, adjacency_type=adjacency)
    bounds = loss.connect_dots_bounds()
    eps = np.linspace(bounds.epsilon_lower, bounds.epsilon_upper, 1500)
    reference = loss.get_delta_for_epsilon(eps)
    fast = mixture_gaussian_deltas(loss, eps)
    np.testing.assert_allclose(fast, reference, rtol=1e-9, atol=1e-13)
    # Newton finds the exact maximizer x*, the library a 1e-6-rounded one: never below it.
    assert np.all(fast >= reference - 1e-13)
    assert np.all(np.diff(fast) <= 0)


@pytest.mark.parametrize(("group", "sigma", "p"), [(2, 1.0, 0.1), (8, 2.0, 0.01), (1, 0.8, 0.5)])
def test_pmfs_match_dp_accounting_both_directions(group, sigma, p) -> None:
    sens, probs = _binomial(group, p)
    fast = mixture_gaussian_pld(sigma, sens, probs, value_discretization_interval=3e-3)
    ref = pld_lib.from_mixture_gaussian_mechanism(
        sigma, sens, probs, value_discretization_interval=3e-3
    )
    for mine, theirs in ((fast._pmf_remove, ref._pmf_remove), (fast._pmf_add, ref._pmf_add)):
        assert mine._lower_loss == theirs._lower_loss
        assert mine._probs.shape == theirs._probs.shape
        # δ differences of ~1e-13 (x* rounding in the library) are divided by e^Δ − 1 here.
        np.testing.assert_allclose(mine._probs, theirs._probs, rtol=0, atol=1e-9)
        assert mine._infinity_mass == pytest.approx(theirs._infinity_mass, rel=1e-9, abs=1e-15)
        assert mine._pessimistic_estimate and theirs._pessimistic_estimate


def _both(mechanism: ElsMechanism, steps: int, vdi: float) -> tuple[float, float]:
    kwargs = {"value_discretization_interval": vdi}
    fast = epsilon(mechanism, steps, 1e-6, **kwargs)
    ref = epsilon(mechanism, steps, 1e-6, pld_backend="dp_accounting", **kwargs)
    return fast, ref


@pytest.mark.parametrize(("group", "sigma", "p", "steps"), [(2, 1.0, 0.1, 10), (8, 2.0, 0.01, 50)])
def test_epsilon_matches_dp_accounting_small_grid(group, sigma, p, steps) -> None:
    fast, ref = _both(ElsMechanism(sigma, p, group), steps, 1e-3)
    assert fast == pytest.approx(ref, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("group", [1, 2, 4, 16])
@pytest.mark.parametrize("sigma", [0.5, 1.0, 4.0])
@pytest.mark.parametrize("p", [0.01, 0.2])
@pytest.mark.parametrize("steps", [1, 100, 2000])
def test_epsilon_matches_dp_accounting_grid(group, sigma, p, steps) -> None:
    fast, ref = _both(ElsMechanism(sigma, p, group), steps, 1e-3)
    assert fast == pytest.approx(ref, rel=1e-3)


@pytest.mark.slow
def test_paper_setting_at_fine_discretization() -> None:
    # dp_accounting's MixtureOfGaussiansDpEvent (the recipe of App. A.1 of "Fine-Tuning Large
    # Language Models with User-Level Differential Privacy") gives 90.90121 at vdi 1e-4 (~100 s).
    fast, ref = _both(ElsMechanism(1.0, 0.01, 16), 2000, 1e-4)
    assert fast == pytest.approx(ref, rel=1e-3)
    assert fast == pytest.approx(90.90121, rel=1e-5)


def test_group_size_one_equals_poisson_gaussian() -> None:
    # dp_accounting's Poisson-subsampled Gaussian: 2.95526 (T=2000, p=0.01, σ=1) and 3.70619
    # (T=1000, σ=0.8), δ=1e-6.
    for sigma, steps, expected in ((1.0, 2000, 2.95526), (0.8, 1000, 3.70619)):
        els = epsilon(ElsMechanism(sigma, 0.01, 1), steps, 1e-6)
        uls = epsilon(UlsMechanism(sigma, 0.01), steps, 1e-6)
        assert els == pytest.approx(uls, rel=1e-6)
        assert els == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize(
    ("sigma", "group", "expected"),
    [(1.0, 2, 6.4333), (1.0, 4, 14.535), (1.0, 8, 34.891), (1.0, 16, 90.901),
     (2.0, 4, 4.7693), (4.0, 8, 4.4447), (0.5, 2, 42.137)],
)  # fmt: skip
def test_reference_table_fig1_setting(sigma, group, expected) -> None:
    # The Fig. 1 setting of "Fine-Tuning Large Language Models with User-Level Differential
    # Privacy" (§2): T=2000, p=0.01, δ=1e-6, vdi 1e-3 (dp_accounting 0.6.0 numbers).
    eps = epsilon(ElsMechanism(sigma, 0.01, group), 2000, 1e-6, value_discretization_interval=1e-3)
    assert eps == pytest.approx(expected, rel=2e-4)


@pytest.mark.parametrize(
    ("sigma", "q", "steps"), [(0.58, 0.05, 80), (1.0, 0.01, 1000), (4.0, 0.5, 3), (1.0, 1.0, 5)]
)
def test_uls_matches_pld_accountant_at_the_default_grid(sigma, q, steps) -> None:
    # A ULS step is built as the G = 1 mixture; PLDAccountant builds the Poisson-subsampled
    # Gaussian with its closed-form inverse loss. Both are connect-the-dots at the same grid with
    # probabilities equal to ~1e-11; they cut the loss tails at different points (the mixture's
    # log-mass bound, the Gaussian's tail bound), each charging the cut mass as infinite loss,
    # which moves ε by a few 1e-9 relative.
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    accountant = PLDAccountant(value_discretization_interval=1e-4)
    accountant.compose(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
    )
    mechanism = UlsMechanism(sigma, q)
    reference = accountant.get_epsilon(1e-5)
    assert epsilon(mechanism, steps, 1e-5) == pytest.approx(reference, rel=1e-8)
    library = epsilon(mechanism, steps, 1e-5, pld_backend="dp_accounting")
    assert library == reference  # the library's own construction and composition, bit for bit


def test_full_sampling_is_a_gaussian_with_sensitivity_g() -> None:
    # p = 1: the mixture is one Gaussian with sensitivity G, i.e. noise multiplier σ/G.
    from dp_accounting import GaussianDpEvent, SelfComposedDpEvent
    from dp_accounting.pld import PLDAccountant

    accountant = PLDAccountant()
    accountant.compose(SelfComposedDpEvent(GaussianDpEvent(4.0 / 3), 5))
    assert epsilon(ElsMechanism(4.0, 1.0, 3), 5, 1e-6) == pytest.approx(
        accountant.get_epsilon(1e-6), rel=1e-6
    )


def test_monotone_in_group_size_steps_and_noise() -> None:
    def eps(sigma: float, group: int, steps: int) -> float:
        mech = ElsMechanism(sigma, 0.02, group)
        return epsilon(mech, steps, 1e-6, value_discretization_interval=1e-3)

    assert eps(1.0, 2, 100) < eps(1.0, 4, 100) < eps(1.0, 8, 100)
    assert eps(1.0, 4, 50) < eps(1.0, 4, 100) < eps(1.0, 4, 200)
    assert eps(2.0, 4, 100) < eps(1.5, 4, 100) < eps(1.0, 4, 100)


def test_chunked_evaluation_gives_the_same_curve(monkeypatch) -> None:
    from userdp.accounting import fast_pld

    sens, probs = _binomial(4, 0.1)
    for adjacency in (plm.AdjacencyType.REMOVE, plm.AdjacencyType.ADD):
        loss = plm.MixtureGaussianPrivacyLoss(1.0, sens, probs, adjacency_type=adjacency)
        bounds = loss.connect_dots_bounds()
        eps = np.linspace(bounds.epsilon_lower, bounds.epsilon_upper, 5000)
        whole = mixture_gaussian_deltas(loss, eps)
        monkeypatch.setattr(fast_pld, "_CHUNK_ELEMENTS", 5 * 1024)  # chunks of 1024 points
        chunked = mixture_gaussian_deltas(loss, eps)
        monkeypatch.undo()
        np.testing.assert_allclose(chunked, whole, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(("group", "steps"), [(1, 1), (3, 7), (4, 300)])
def test_real_fft_self_composition_equals_the_library(group, steps) -> None:
    from userdp.accounting.pld_ops import self_compose

    sens, probs = _binomial(group, 0.05)
    pld = mixture_gaussian_pld(1.0, sens, probs, value_discretization_interval=1e-3)
    ref, mine = pld.self_compose(steps), self_compose(pld, steps)
    for a, b in ((ref._pmf_remove, mine._pmf_remove), (ref._pmf_add, mine._pmf_add)):
        assert a._lower_loss == b._lower_loss
        assert a._infinity_mass == b._infinity_mass
        np.testing.assert_allclose(b._probs, a._probs, rtol=0, atol=1e-15)
    assert mine.get_epsilon_for_delta(1e-6) == pytest.approx(ref.get_epsilon_for_delta(1e-6))


@pytest.mark.parametrize(("group", "sigma", "p"), [(1, 1.0, 0.01), (4, 0.7, 0.2), (16, 2.0, 0.5)])
@pytest.mark.parametrize("steps", [1, 10, 2000])
def test_self_convolve_bounds_equal_the_library(group, sigma, p, steps) -> None:
    from dp_accounting.pld import common
    from userdp.accounting.pld_ops import _self_convolve_bounds

    sens, probs = _binomial(group, p)
    pld = mixture_gaussian_pld(sigma, sens, probs, value_discretization_interval=1e-3)
    for pmf in (pld._pmf_remove, pld._pmf_add):
        for tail in (0.0, 1e-15, 1e-6):
            expected = common.compute_self_convolve_bounds(pmf._probs, steps, tail)
            assert _self_convolve_bounds(pmf._probs, steps, tail) == expected


def test_row_logsumexp_equals_scipy_including_empty_rows() -> None:
    from scipy import special
    from userdp.accounting.fast_pld import _logsumexp_rows

    rng = np.random.default_rng(0)
    z = rng.normal(scale=30.0, size=(50, 17))
    z[3] = -np.inf
    z[7, :5] = -np.inf
    weights = rng.random(17)
    weights[2] = 0.0
    with np.errstate(divide="ignore"):
        expected = special.logsumexp(z, axis=1, b=weights)
    np.testing.assert_allclose(_logsumexp_rows(z.copy(), weights), expected, rtol=1e-13)
    assert _logsumexp_rows(z.copy(), weights)[3] == -np.inf


@pytest.mark.parametrize("delta", [1e-12, 1e-6, 1e-2, 0.5, 0.999])
@pytest.mark.parametrize(("group", "sigma", "p", "steps"), [(1, 1.0, 0.01, 100), (4, 0.6, 0.2, 30)])
def test_vectorized_epsilon_for_delta_equals_the_library(group, sigma, p, steps, delta) -> None:
    from dp_accounting.pld import privacy_loss_distribution as pld_lib
    from userdp.accounting.pld_ops import epsilon_for_delta, self_compose

    sens, probs = _binomial(group, p)
    pld = self_compose(mixture_gaussian_pld(sigma, sens, probs, 1e-3), steps)
    gaussian = pld_lib.from_gaussian_mechanism(sigma, value_discretization_interval=1e-3)
    for dist in (pld, pld.compose(gaussian), gaussian, pld_lib.identity(1e-3)):
        expected = dist.get_epsilon_for_delta(delta)
        assert epsilon_for_delta(dist, delta) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def _long_double_delta(mechanism, steps: int, epsilon_value: float) -> float:
    """δ(ε) of ``steps`` compositions of one step's PLD (both directions, the larger), computed
    in long double (80-bit on x86: 2¹¹ times float64's precision) from ONE exponentially tilted
    transform whose mean sits at the loss ε, where the entries that δ(ε) sums are largest: each
    of them is then accurate to about T·2⁻⁶⁴·log N of itself. The transform is 4 times longer
    than the window, so that the tilted mass beyond it (heavy: the tilt weights large losses)
    does not wrap around into it (4 and 8 times agree to 10⁻¹⁴ here; 1 time is 3·10⁻⁴ off). Same truncation bounds
    and infinity mass as userdp's composition; nothing of its tilt selection."""
    import math

    from scipy import fft
    from userdp.accounting import dp_accounting_adapter as adapter
    from userdp.accounting import pld_accountant, pld_ops

    step = pld_accountant.single_step_pld(mechanism, 1e-4)
    deltas = []
    for pmf in adapter.distinct_pmfs(step):
        dense = adapter.dense_arrays(pmf)
        probs = np.asarray(dense.probs, dtype=np.longdouble)
        index = np.arange(probs.size, dtype=np.longdouble)
        lower, upper = pld_ops._self_convolve_bounds(dense.probs, steps, 1e-15)
        composed = lower + np.arange(upper - lower + 1, dtype=np.longdouble)
        losses = (dense.lower_loss * steps + composed) * dense.discretization
        target = epsilon_value / dense.discretization - dense.lower_loss * steps  # index of ε
        lo, hi = 0.0, 1.0
        for _ in range(200):  # the tilt whose T-fold mean is at ε (the mean increases in λ)
            lam = (lo + hi) / 2
            weights = probs * np.exp(lam * index - lam * index[-1])
            mean = steps * (weights @ index) / weights.sum()
            lo, hi = (lam, hi) if mean < target else (lo, lam)
        weights = probs * np.exp(lam * index - lam * index[-1])
        log_m = np.log(weights.sum()) + lam * index[-1]
        length = fft.next_fast_len(4 * max(upper - lower + 1, probs.size))
        tilted = np.fft.irfft(np.fft.rfft(weights / weights.sum(), length) ** steps, length)
        above = losses > epsilon_value
        window = np.roll(tilted, -lower)[: upper - lower + 1][above]
        values = window * np.exp(steps * log_m - lam * composed[above])
        infinity = 1e-15 - math.expm1(steps * math.log1p(-dense.infinity_mass))
        deltas.append(float(np.sum(values * -np.expm1(epsilon_value - losses[above]))) + infinity)
    return max(deltas)


def test_small_delta_epsilon_is_not_below_a_long_double_composition(monkeypatch) -> None:
    # q = 10⁻³, σ = 0.5, T = 10⁴, δ = 10⁻¹⁰: the plain float64 FFT power (dp_accounting's) puts
    # the tail probabilities that δ is made of below their true values, so its ε is optimistic
    # by 3·10⁻⁴ relative (its δ, recomputed in long double, is 0.7 % above δ). The tilted
    # composition's ε has δ ≤ δ in long double, to the float64 round-off of its own tail sums
    # (the tilted transforms leave each entry within ~10⁻¹¹ of itself; 10⁻⁸ is ample).
    from userdp.accounting import pld_accountant, pld_ops

    mechanism, steps, delta = UlsMechanism(0.5, 1e-3), 10_000, 1e-10
    stated = epsilon(mechanism, steps, delta)
    assert _long_double_delta(mechanism, steps, stated) <= delta * (1 + 1e-8)
    monkeypatch.setattr(pld_ops, "TILTS", 0)  # the plain transform only: the test has power
    pld_accountant.single_step_pld.cache_clear()
    plain = epsilon(mechanism, steps, delta)
    assert plain < stated and _long_double_delta(mechanism, steps, plain) > delta * (1 + 1e-3)
