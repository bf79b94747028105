"""The privacy checks' statistics live in the package (:mod:`userdp.testing.stats`), shared with
the strategy conformance kit that plugin authors run."""

from userdp.testing.stats import (
    ALPHA,
    Z,
    assert_gaussian_noise,
    assert_uncorrelated,
    binomial_interval,
    chi2_interval,
    std_bounds,
)

__all__ = [
    "ALPHA",
    "Z",
    "assert_gaussian_noise",
    "assert_uncorrelated",
    "binomial_interval",
    "chi2_interval",
    "std_bounds",
]
