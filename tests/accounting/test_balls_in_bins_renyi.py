"""The sampling-free Rényi bound for balls-in-bins, against independent references.

The privacy suite (``tests/privacy/checks_renyi.py``) checks the program's moments against
enumeration and quadrature; these tests place the resulting ε beside the other accountants.
"""

from __future__ import annotations

import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant
from userdp.accounting import balls_in_bins as bb
from userdp.accounting import balls_in_bins_renyi as renyi
from userdp.accounting.balls_in_bins_certified import (
    NO_AMPLIFICATION,
    RENYI,
    certified_epsilon,
    gaussian_epsilon,
    random_allocation_bounds,
)
from userdp.accounting.correlation_spec import CorrelationSpec
from userdp.accounting.mechanisms import BallsInBinsMechanism

from tests.privacy.checks_renyi import enumerated_log_moment

BANDED = CorrelationSpec.of("banded", coefs=[1.0, 0.6, 0.3])


BLT = CorrelationSpec.of("blt", buf_decay=[0.9, 0.5], output_scale=[0.3, 0.2])


def test_conversion_is_dp_accountings():
    """ε from Rényi divergences: the same conversion as dp_accounting's RDP accountant
    (Canonne, Kamath & Steinke, Proposition 12)."""
    orders = np.arange(2, 33, dtype=np.float64)
    for scale, delta in ((0.3, 1e-6), (0.02, 1e-9), (2.0, 1e-5)):
        divergences = scale * orders
        expected, _ = rdp_privacy_accountant.compute_epsilon(orders, divergences, delta)
        assert renyi.epsilon_from_renyi(orders, divergences, delta) == pytest.approx(
            float(expected), rel=1e-12
        )


@pytest.mark.parametrize(
    ("bins", "epochs", "semantics", "sigma", "delta"),
    [
        (16, 4, "per-epoch", 2.0, 1e-5),
        (32, 2, "fixed", 3.0, 1e-6),
        (20, 3, "fixed", 1.231, 1e-5),
    ],
)
def test_identity_bound_is_above_the_random_allocation_lower_bound(
    bins, epochs, semantics, sigma, delta
):
    """For C = I the random-allocation package gives a certified LOWER bound on ε: an upper bound
    below it would be wrong. The Rényi bound is also amplified: below the Gaussian bound."""
    pair = bb.dominating_pair(bins, epochs, bin_semantics=semantics)
    stated = renyi.renyi_epsilon(pair.gram, pair.compositions, sigma, delta).epsilon
    upper, lower = random_allocation_bounds(pair, sigma, delta)
    assert stated >= lower
    assert stated >= upper * 0.999  # the tight upper bound; the Rényi one is looser
    assert stated < gaussian_epsilon(pair.sensitivity / sigma, delta)


def test_correlated_bound_is_above_the_monte_carlo_estimate():
    """A 3-band C and a BLT at a δ the Monte Carlo point estimate resolves well (2^16 draws at δ = 10⁻²,
    about 650 draws in the tail: a few percent on ε): the certified bound is above it."""
    sigma, delta = 2.0, 1e-2
    pair = bb.dominating_pair(16, 4, correlation=BANDED)
    stated = renyi.renyi_epsilon(pair.gram, pair.compositions, sigma, delta).epsilon
    estimate = bb.epsilon(sigma, 16, 4, delta, correlation=BANDED, num_samples=2**16, seed=3)
    assert stated >= 1.05 * estimate
    blt = bb.dominating_pair(16, 4, correlation=BLT)
    stated = renyi.renyi_epsilon(blt.gram, blt.compositions, sigma, delta).epsilon
    assert stated >= 1.05 * bb.epsilon(sigma, 16, 4, delta, correlation=BLT, num_samples=2**16)


@pytest.mark.parametrize(("spec", "gain"), [(BANDED, 0.8), (BLT, 0.9)])
def test_small_delta_is_certified_by_renyi_and_amplified(spec, gain):
    """Where the Monte Carlo method cannot run (δ = 10⁻⁸ at b = 64, E = 4), a 3-band C's and a
    BLT's stated ε come from the Rényi bound, below the bound without amplification."""
    mechanism = BallsInBinsMechanism(6.0, 64, 4, "fixed", spec)
    certified = certified_epsilon(mechanism, 4, 1e-8, use_cache=False)
    assert certified.method == RENYI
    assert certified.epsilon < gain * certified.candidates[NO_AMPLIFICATION]


def test_identity_leaves_renyi_to_the_random_allocation_pld():
    mechanism = BallsInBinsMechanism(2.0, 16, 2, "fixed")
    certified = certified_epsilon(mechanism, 2, 1e-5, use_cache=False)
    assert certified.candidates[RENYI] is None and "random-allocation" in certified.skipped[RENYI]


def test_the_cyclic_program_keeps_the_wrap_around_exactly():
    """A Gram matrix with two off-diagonals and the entries that tie the last bins to the first
    (a banded C's when bins repeat): the cyclic program is the exact sum over every tuple."""
    ring = 3.0 * np.eye(7) + sum(
        weight * (np.roll(np.eye(7), shift, axis=1) + np.roll(np.eye(7), -shift, axis=1))
        for shift, weight in ((1, 1.5), (-2, 0.8))
    )
    for sign in (-1, +1):
        computed = renyi.log_moments(renyi.banded_bound(ring, 0.0, cyclic=True), 1.3, 4, sign)
        straight = renyi.log_moments(renyi.banded_bound(ring, 0.0), 1.3, 4, sign)
        for k in range(5):
            exact = enumerated_log_moment(ring, 1.3, k, sign)
            assert computed[k] == pytest.approx(exact, rel=1e-12, abs=1e-12)
            assert straight[k] >= exact
        assert straight[4] > computed[4] + 0.1  # the straight form pays for the wrap-around
