"""The balls-in-bins accountant with C = I against the random-allocation bounds of Feldman &
Shenfeld ("Efficient Privacy Loss Accounting for Subsampling and Random Allocation", arXiv
2602.17284), and the Monte Carlo path against both.

The package's bounds are called here with the mapping written out in the test (fixed bins over E
epochs: one epoch at σ/√E; bins redrawn every epoch: E epochs), so a wrong mapping in userdp's
adapter puts its ε outside [lower, upper]."""

from __future__ import annotations

import math
import warnings

import pytest
from userdp.accounting import BallsInBinsMechanism, epsilon
from userdp.accounting import balls_in_bins as bb
from userdp.accounting.balls_in_bins_certified import certified_epsilon
from userdp.accounting.random_allocation import PACKAGE_VERSION, RandomAllocationError, _package

CONFIGS = [  # (σ, bins, epochs, semantics, δ)
    (1.0, 8, 2, "per-epoch", 1e-3),
    (1.5, 8, 2, "fixed", 1e-4),
    (0.8, 20, 3, "per-epoch", 1e-5),
    (1.231, 20, 3, "fixed", 2.5e-4),
    (2.0, 4, 5, "fixed", 1e-8),
    (0.9, 32, 1, "per-epoch", 1e-10),
]


def _package_bounds(sigma, bins, epochs, semantics, delta) -> tuple[float, float]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ImportWarning)
        import PLD_accounting

    if semantics == "fixed":
        sigma, epochs = sigma / math.sqrt(epochs), 1
    return PLD_accounting.gaussian_allocation_epsilon_range(
        delta=delta, sigma=sigma, num_steps=bins, num_epochs=epochs
    )


@pytest.mark.parametrize(("sigma", "bins", "epochs", "semantics", "delta"), CONFIGS)
def test_certified_epsilon_lies_between_the_random_allocation_bounds(
    sigma, bins, epochs, semantics, delta
) -> None:
    upper, lower = _package_bounds(sigma, bins, epochs, semantics, delta)
    mechanism = BallsInBinsMechanism(sigma, bins, epochs, semantics)
    stated = epsilon(mechanism, bins * epochs, delta)
    assert lower <= stated <= upper
    certified = certified_epsilon(mechanism, epochs, delta)
    assert certified.method == "random-allocation PLD" and certified.epsilon == stated
    assert stated < certified.candidates["no amplification"]  # amplification is worth it


@pytest.mark.parametrize(
    ("sigma", "bins", "epochs", "semantics", "delta"),
    [(1.0, 8, 2, "per-epoch", 1e-2), (1.5, 8, 3, "fixed", 1e-2), (0.7, 4, 1, "fixed", 1e-2)],
)
def test_the_monte_carlo_estimate_lies_between_the_random_allocation_bounds(
    sigma, bins, epochs, semantics, delta
) -> None:
    # The Monte Carlo path (the dominating pair's loss samples) against the deterministic bounds:
    # its δ̂ at the lower bound's ε is at least δ, and at the upper bound's ε at most δ, each
    # within Z = 5.33 standard errors (false alarm 1e-7 per comparison).
    upper, lower = _package_bounds(sigma, bins, epochs, semantics, delta)
    samples = {"num_samples": 2**18, "seed": 5}
    for eps, side in ((lower, 1), (upper, -1)):
        estimate = bb.delta_estimate(sigma, bins, epochs, eps, bin_semantics=semantics, **samples)
        assert side * (estimate.delta - delta) >= -5.33 * estimate.stderr


def test_a_package_of_another_version_is_refused(monkeypatch) -> None:
    import importlib.metadata

    real = importlib.metadata.version
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        lambda name: "9.9" if name == "PLD_accounting" else real(name),
    )
    with pytest.raises(RandomAllocationError, match=f"pld-accounting=={PACKAGE_VERSION}"):
        _package()
