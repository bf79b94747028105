"""The strategy matrix C from its description: coefficients, inverse, dense form, specs."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from userdp.accounting import balls_in_bins as bb
from userdp.accounting.correlation import (
    BandedCorrelation,
    BltCorrelation,
    CorrelationError,
    from_spec,
    toeplitz_matrix,
)
from userdp.accounting.correlation_spec import CorrelationSpec

BLT = BltCorrelation((0.9, 0.5), (0.3, 0.2))
BANDED = BandedCorrelation((2.0, 0.5, 0.25))


def test_blt_coefficients_follow_the_definition():
    # c_0 = 1, c_k = Σ_j ω_j θ_j^{k−1}
    expected = [1.0] + [0.3 * 0.9 ** (k - 1) + 0.2 * 0.5 ** (k - 1) for k in range(1, 6)]
    np.testing.assert_allclose(BLT.toeplitz_coefs(6), expected, rtol=1e-15)
    assert BLT.toeplitz_coefs(1).tolist() == [1.0] and BLT.toeplitz_coefs(0).size == 0


def test_banded_coefficients_are_zero_padded_and_truncated():
    assert BANDED.toeplitz_coefs(5).tolist() == [2.0, 0.5, 0.25, 0.0, 0.0]
    assert BANDED.toeplitz_coefs(2).tolist() == [2.0, 0.5]


@pytest.mark.parametrize("correlation", [BLT, BANDED], ids=["blt", "banded"])
def test_matrix_is_lower_triangular_toeplitz_and_inverse_is_its_inverse(correlation):
    n = 40
    c = correlation.matrix(n)
    coefs = correlation.toeplitz_coefs(n)
    assert np.array_equal(c, toeplitz_matrix(coefs))
    assert np.all(np.triu(c, 1) == 0.0)
    for lag in range(n):
        assert np.all(np.diagonal(c, -lag) == coefs[lag])
    c_inv = toeplitz_matrix(correlation.inverse_coefs(n))
    assert np.max(np.abs(c_inv @ c - np.eye(n))) < 1e-12


@pytest.mark.parametrize("correlation", [BLT, BANDED], ids=["blt", "banded"])
def test_spec_round_trips(correlation):
    spec = correlation.spec()
    assert from_spec(spec) == correlation
    assert from_spec(CorrelationSpec.from_dict(spec.to_dict())) == correlation
    assert from_spec(spec.to_dict()) == correlation


def test_identity_and_toeplitz_names():
    assert from_spec(CorrelationSpec.of("identity")).is_identity
    assert np.array_equal(from_spec(CorrelationSpec.of("identity")).matrix(4), np.eye(4))
    toeplitz = from_spec(CorrelationSpec.of("toeplitz", coefs=[1.0, 0.5]))
    assert toeplitz == BandedCorrelation((1.0, 0.5)) and not toeplitz.is_identity
    assert BltCorrelation((0.5,), (0.0,)).is_identity and not BLT.is_identity
    assert bb.correlation_matrix(CorrelationSpec.of("identity"), 4) is None
    assert np.array_equal(bb.correlation_matrix(BLT.spec(), 7), BLT.matrix(7))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (CorrelationSpec.of("tree"), "name='tree' is not allowed"),
        (CorrelationSpec.of("blt", buf_decay=[0.5]), "expected \\['buf_decay', 'output_scale'\\]"),
        (CorrelationSpec.of("banded", coefs=[1.0], bands=2), "expected \\['coefs'\\]"),
        (CorrelationSpec.of("blt", buf_decay=[1.0], output_scale=[0.1]), "expected values in"),
        (CorrelationSpec.of("blt", buf_decay=[0.5, 0.4], output_scale=[0.1]), "expected equal"),
        (CorrelationSpec.of("banded", coefs=[0.0, 1.0]), "need c_0 > 0"),
        (CorrelationSpec.of("banded", coefs=[]), "need c_0 > 0"),
    ],
)
def test_bad_specs_are_refused(spec, message):
    with pytest.raises(CorrelationError, match=message):
        from_spec(spec)
    with pytest.raises(bb.BallsInBinsError, match=message):
        bb.correlation_matrix(spec, 4)


def test_non_finite_parameters_are_refused():
    with pytest.raises(CorrelationError, match="non-finite"):
        BltCorrelation((0.5,), (float("nan"),))
    with pytest.raises(CorrelationError, match="non-finite"):
        BandedCorrelation((1.0, float("inf")))


def test_module_imports_neither_torch_nor_strategies():
    code = (
        "import sys, userdp.accounting.correlation; "
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith('userdp.strategies')]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
