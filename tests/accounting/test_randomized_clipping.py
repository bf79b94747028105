"""Randomized-clipping (Hutchinson, Hutch++) envelope accountant (Ullah et al., "Efficient DP-SGD
for LLMs with Randomized Clipping")."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting import pld
from scipy import stats
from userdp.accounting import randomized_clipping as rc

# Single step, no subsampling, Z_cons; (σ, ε) → (δ RC k=32, δ RC k=8), reference values from an
# independent numerical integration of E_Z[δ_Gauss(ε; Z/σ)].
SINGLE_STEP_REFERENCE = [
    (1.0, 0.5, 2.64e-1, 3.04e-1),
    (1.0, 1.0, 1.51e-1, 1.92e-1),
    (1.0, 2.0, 3.24e-2, 6.28e-2),
    (2.0, 1.0, 1.07e-2, 2.23e-2),
    (2.0, 2.0, 8.27e-5, 1.85e-3),
    (4.0, 1.0, 2.60e-5, 6.19e-4),
    (4.0, 2.0, 4.9e-10, 1.7e-5),
]


@pytest.mark.parametrize(("sigma", "eps", "k32", "k8"), SINGLE_STEP_REFERENCE)
def test_single_step_delta_matches_reference_table(sigma, eps, k32, k8) -> None:
    digits = 3e-2 if k32 < 1e-9 else 5e-3  # the table prints 3 (or 2) significant digits
    assert rc.single_step_delta(sigma, 32, eps) == pytest.approx(k32, rel=digits)
    assert rc.single_step_delta(sigma, 8, eps) == pytest.approx(k8, rel=3e-2 if k8 < 1e-4 else 5e-3)


def test_pld_of_one_full_batch_step_is_a_tight_upper_bound() -> None:
    one = rc.privacy_loss_distribution(2.0, 1.0, 32, tail_mass=1e-12)
    exact = rc.single_step_delta(2.0, 32, 1.0)
    got = one.get_delta_for_epsilon(1.0)
    assert exact <= got <= 1.15 * exact  # pessimistic (grid rounds Z up), and close


def test_many_probes_recover_exact_clipping() -> None:
    sigma, q, steps, delta = 1.0, 0.01, 200, 1e-5
    acc = pld.PLDAccountant(value_discretization_interval=1e-3)
    acc.compose(
        dp_accounting.SelfComposedDpEvent(
            dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps
        )
    )
    exact = acc.get_epsilon(delta)
    got = rc.epsilon(sigma, q, steps, 10**7, delta)
    assert exact - 1e-9 <= got <= exact * 1.003


def test_epsilon_decreases_as_probes_grow_and_with_noise() -> None:
    kwargs = dict(sampling_prob=0.05, steps=50, delta=1e-5)
    by_k = [rc.epsilon(2.0, probes=k, **kwargs) for k in (16, 32, 128)]
    assert by_k[0] > by_k[1] > by_k[2]
    assert rc.epsilon(3.0, probes=32, **kwargs) < by_k[1]


def test_envelope_dominates_random_spectra() -> None:
    # RC-7: P(Z > z) for Dirichlet spectra is below the Z_cons tail (+ Monte Carlo error).
    rng = np.random.default_rng(0)
    k, d, draws = 8, 16, 40_000
    lam = rng.dirichlet(np.full(d, 0.3), size=draws)
    y = (lam * rng.chisquare(k, size=(draws, d)) / k).sum(axis=1)
    z = 1 / np.sqrt(y)
    grid, masses, tail = rc.envelope_atoms(k, 1e-9)
    assert masses.sum() + tail == pytest.approx(1.0, abs=1e-12)
    assert np.all(masses >= 0) and np.all(np.diff(grid) > 0)
    for level in (1.0, 1.2, 1.5, 2.0):
        envelope_tail = stats.chi2.cdf(k / level**2, k)
        empirical = float(np.mean(z > level))
        assert empirical <= envelope_tail + 4 * math.sqrt(envelope_tail / draws)


def test_calibration_is_on_the_private_side() -> None:
    kwargs = dict(sampling_prob=0.05, steps=20, probes=10**6)
    sigma = rc.calibrate_noise_multiplier(2.0, 1e-5, rtol=1e-2, **kwargs)
    assert rc.epsilon(sigma, delta=1e-5, **kwargs) <= 2.0
    assert rc.epsilon(sigma / 1.02, delta=1e-5, **kwargs) > 2.0


def test_hutch_plus_plus_is_accounted_like_hutchinson_with_its_tail_probes() -> None:
    """Z_{Hutch++} ≤ max(1, 1/√Y) with Y the k-tail-probe Hutchinson law of the residual (module
    docstring): the same envelope, so the same ε at the same (σ, q, steps, k)."""
    from userdp.accounting import RandomizedClippingMechanism, epsilon

    args = (1.5, 0.02, 40, 16, 1e-5)
    assert rc.epsilon(*args, estimator="hutch++") == rc.epsilon(*args, estimator="hutchinson")
    plus = RandomizedClippingMechanism(1.5, 0.02, 16, "hutch++")
    assert plus.to_dict()["estimator"] == "hutch++"
    assert epsilon(plus, 40, 1e-5) == epsilon(RandomizedClippingMechanism(1.5, 0.02, 16), 40, 1e-5)


# ---- the envelope against the engine's Hutch++ -------------------------------------------------
#
# Z = ‖M‖/√n̂ from the engine's own Hutch++ (clients/norms.py) on one unit with a chosen spectrum.
# The check: at every grid point the empirical CDF F̂(z) of n draws is at least F_env(z) minus
# 5.33 binomial standard errors √(F_env(1 − F_env)/n). If the true CDF F(z) ≥ F_env(z) (the
# claim), P(F̂ < F_env − 5.33·se) ≤ Φ(−5.33) ≈ 5e-8 per point, the worst case being F = F_env
# (P(Binomial(n, F) ≤ c) decreases in F); n(1 − F_env) ≥ 60 at the largest z keeps the normal
# approximation of the binomial honest there. Grid points start at 1.001: exact (head-only)
# estimates give Z = 1 up to float32 rounding (~1e-6), which must not count as Z > 1.
ENVELOPE_GRID = np.array([1.001, 1.02, 1.05, 1.1, 1.2, 1.35, 1.5, 1.75, 2.0, 2.5])
DOMINATION_K, DOMINATION_D, DOMINATION_DRAWS = 4, 24, 1500
SPECTRA = {
    "rank-1": [1.0],
    "flat rank 2k": [1.0] * 8,
    "decaying j^-1": [1.0 / j for j in range(1, DOMINATION_D + 1)],
    # full rank and flat: the head captures only k/d = 1/6 of the norm, the tail does the rest
    "head captures little": [1.0] * DOMINATION_D,
}


def _z_draws(estimator, spectrum, seed: int = 0) -> np.ndarray:
    from tests.clients.spectra import estimates, spectral_uses

    d, k = DOMINATION_D, DOMINATION_K
    uses, padded, exact = spectral_uses(spectrum, d, d, seed=seed)
    n_hat = estimates(estimator, uses, padded, d, k, DOMINATION_DRAWS, seed=seed + 1)
    return np.sqrt(exact / n_hat)


def _dominated(z: np.ndarray, probes: int) -> bool:
    """F̂_Z(z) ≥ F_env(z) − 5.33 binomial se at every grid point (see the section comment)."""
    f_env = rc.envelope_cdf(ENVELOPE_GRID, probes)
    f_hat = (z[None, :] <= ENVELOPE_GRID[:, None]).mean(axis=1)
    se = np.sqrt(f_env * (1 - f_env) / len(z))
    return bool(np.all(f_hat >= f_env - 5.33 * se))


def test_envelope_cdf_is_z_cons() -> None:
    assert np.all(rc.envelope_cdf(np.array([0.5, 0.999]), 8) == 0.0)
    assert rc.envelope_cdf(1.0, 8) == pytest.approx(stats.chi2.sf(8, 8))
    assert rc.envelope_cdf(2.0, 8) == pytest.approx(stats.chi2.sf(2, 8))


@pytest.mark.parametrize("spectrum", list(SPECTRA), ids=list(SPECTRA))
def test_the_engines_hutchpp_is_dominated_by_the_envelope(spectrum) -> None:
    from tests.clients.spectra import hutchpp

    assert _dominated(_z_draws(hutchpp, SPECTRA[spectrum]), DOMINATION_K)


def test_the_check_is_tight_for_rank_one_hutchinson() -> None:
    """Rank-1 Hutchinson has EXACTLY the envelope's law on Z ≥ 1: the check passes it, and a
    20% stretch of Z fails it (the CDF drops by ≥ 0.15 around z = 1.2, about 12 se)."""
    from tests.clients.spectra import hutchinson

    z = _z_draws(hutchinson, SPECTRA["rank-1"])
    assert _dominated(z, DOMINATION_K)
    assert not _dominated(1.2 * z, DOMINATION_K)


def test_a_hutchpp_without_its_tail_is_caught() -> None:
    """MUTATION: n̂ = head only under-estimates a full-rank norm (Z ≈ √(d/k) ≈ 2.4 here); the
    domination check must refuse it."""
    from tests.clients.spectra import head_only

    z = _z_draws(head_only, SPECTRA["head captures little"])
    assert not _dominated(z, DOMINATION_K)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(noise_multiplier=0.0), "noise_multiplier=0.0"),
        (dict(sampling_prob=1.5), "sampling_prob=1.5"),
        (dict(steps=0), "steps=0"),
        (dict(probes=0), "probes=0"),
        (dict(delta=1.0), "delta=1.0"),
        (dict(estimator="exact"), "estimator='exact'"),
    ],
)
def test_bad_input_is_a_one_line_value_error(kwargs, match) -> None:
    args = dict(noise_multiplier=1.0, sampling_prob=0.01, steps=10, probes=32, delta=1e-5)
    with pytest.raises(rc.RandomizedClippingError, match=match) as info:
        rc.epsilon(**{**args, **kwargs})
    assert "\n" not in str(info.value)


def test_api_dispatch_reaches_this_accountant() -> None:
    from userdp.accounting import RandomizedClippingMechanism, epsilon

    mech = RandomizedClippingMechanism(2.0, 0.05, 32)
    assert epsilon(mech, 20, 1e-5) == rc.epsilon(2.0, 0.05, 20, 32, 1e-5)


def test_atoms_built_with_fast_pld_equal_dp_accountings_subsampled_gaussian() -> None:
    """Each Z atom's PLD now comes from userdp.accounting.fast_pld (the subsampled Gaussian as a
    two-component mixture); the mixture built from dp_accounting's own from_gaussian_mechanism
    atoms must give the same ε."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    sigma, q, k, steps, delta, vdi = 1.5, 0.02, 16, 50, 1e-6, 1e-3
    grid, masses, tail = rc.envelope_atoms(k, 0.01 * delta / steps)
    remove = add = None
    total = 0.0
    for z, w in zip(grid, masses, strict=True):
        if w <= 0.0:
            continue
        atom = pld_lib.from_gaussian_mechanism(
            standard_deviation=sigma / z, sampling_prob=q, value_discretization_interval=vdi
        )
        if remove is None:
            remove, add = atom._pmf_remove, atom._pmf_add
        else:
            remove = remove.compute_mixture(atom._pmf_remove, total / (total + w))
            add = add.compute_mixture(atom._pmf_add, total / (total + w))
        total += w
    infinite = pld.pld_pmf.DensePLDPmf(vdi, 0, np.zeros(1), 1.0, pessimistic_estimate=True)
    remove = remove.compute_mixture(infinite, total / (total + tail))  # Z above the grid: ∞ loss
    add = add.compute_mixture(infinite, total / (total + tail))
    reference = pld_lib.PrivacyLossDistribution(remove, add).self_compose(steps)
    want = reference.get_epsilon_for_delta(delta)
    got = rc.epsilon(sigma, q, steps, k, delta, value_discretization_interval=vdi)
    assert got == pytest.approx(want, rel=1e-6)
