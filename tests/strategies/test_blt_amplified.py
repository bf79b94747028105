"""BLT optimized for fixed balls-in-bins amplification (strategies/blt_amplified.py): its Gram
matrix and σ against the balls-in-bins accountant, the gain over the unamplified optimum, CLI."""

from __future__ import annotations

import json
import math

import numpy as np
from userdp.accounting import balls_in_bins as bb
from userdp.strategies.blt import Blt
from userdp.strategies.blt_amplified import _gram, amplified_sigma, optimize_blt_amplified

from tests.accounting.account_cli import account

Z_TOL = 5.33  # two-sided normal quantile of the suite's 1e-7 false-alarm rate
BLT = Blt((0.9, 0.4), (0.3, 0.2))


def test_gram_is_the_accountants_dominating_pair() -> None:
    bins, epochs = 6, 4
    mine = _gram(BLT.toeplitz_coefs(bins * epochs), bins, epochs)
    pair = bb.dominating_pair(bins, epochs, correlation=BLT.matrix(bins * epochs))
    np.testing.assert_allclose(mine, pair.gram, rtol=1e-12)


def test_sigma_reaches_delta_under_the_balls_in_bins_accountant() -> None:
    # σ solves δ̂ = δ on its own 2^16 draws; on 2^17 fresh draws of the accountant the δ̂ at that
    # σ must be δ within the Monte Carlo error of both estimates (terms in [0, 1): variance ≤ δ).
    bins, epochs, eps, delta = 8, 4, 1.0, 1e-2
    sigma = amplified_sigma(BLT, bins, epochs, eps, delta, num_samples=2**16, seed=1)
    fresh = bb.delta_estimate(
        sigma, bins, epochs, eps, correlation=BLT.spec(), num_samples=2**17, seed=2
    )
    se = math.sqrt(delta / 2**16 + delta / 2**17)
    assert abs(fresh.delta - delta) <= Z_TOL * se, (sigma, fresh)


def test_optimized_blt_beats_the_unamplified_optimum_under_amplification() -> None:
    found = optimize_blt_amplified(
        8, 4, 2, 1.0, 1e-3, num_samples=2**12, final_samples=2**16, seed=3, max_evaluations=150
    )
    assert all(0.0 < t < 1.0 for t in found.blt.buf_decay)
    assert all(w > 0.0 for w in found.blt.output_scale)  # C ≥ 0, as Lemma 3.2 needs
    # both losses use σ from the same fresh draws: the search's result is no worse
    assert found.loss <= found.unamplified_loss
    assert 0 < found.evaluations <= 150 + 1


def test_cli_prints_a_correlation_the_accountant_accepts_and_refuses_bad_input() -> None:
    out = account(
        "optimize-blt", "--bins", "6", "--epochs", "3", "--buffers", "1", "--epsilon", "1",
        "--delta", "1e-3", "--samples", "2048", "--json", timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["loss"] <= result["unamplified"]["loss"]
    eps = account(
        "epsilon", "--mechanism", "balls-in-bins", "--bin-semantics", "fixed", "--bins", "6",
        "--epochs", "3", "--steps", "18", "--delta", "1e-3", "--samples", "4096",
        "--noise-multiplier", str(result["noise_multiplier_estimate"]),
        "--correlation", result["correlation"], "--json", timeout=600,
    )  # fmt: skip
    assert eps.returncode == 0, eps.stderr
    assert json.loads(eps.stdout)["epsilon"] > 0
    bad = account("optimize-blt", "--bins", "0", "--epochs", "3", "--epsilon", "1", timeout=600)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "--bins=0" in bad.stderr
