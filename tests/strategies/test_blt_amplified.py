"""BLT optimized for fixed balls-in-bins amplification (strategies/blt_amplified.py): its Gram
matrix and σ against the balls-in-bins accountant, the gain over the unamplified optimum, the
RMSE objective of "Near Exact Privacy Amplification for Matrix Mechanisms" (arXiv:2410.06266,
§1.2 and §4.2) computed independently with dense numpy, CLI."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from userdp.accounting import balls_in_bins as bb
from userdp.accounting.balls_in_bins_losses import DominatingPair, toeplitz_modes
from userdp.accounting.correlation import BandedCorrelation
from userdp.strategies.blt import Blt, BltError
from userdp.strategies.blt_amplified import amplified_sigma, optimize_blt_amplified

from tests.accounting.account_cli import account

Z_TOL = 5.33  # two-sided normal quantile of the suite's 1e-7 false-alarm rate
BLT = Blt((0.9, 0.4), (0.3, 0.2))


@pytest.mark.parametrize(
    "correlation",
    [BLT, Blt((0.99, 0.7, 0.2), (0.1, 0.05, 0.3)), BandedCorrelation((1.0, 0.5, 0.25))],
)
@pytest.mark.parametrize(("bins", "epochs"), [(6, 4), (1, 5), (7, 1), (5, 3)])
def test_the_optimizers_toeplitz_gram_is_the_accountants_dominating_pair(
    correlation, bins, epochs
) -> None:
    # the optimizer builds C's modes from its first column (O(n·b)); the accountant from the
    # dense C it is given: the same Gram matrix, bit for bit
    n = bins * epochs
    mine = DominatingPair.of_modes(toeplitz_modes(correlation.toeplitz_coefs(n), bins, epochs))
    pair = bb.dominating_pair(bins, epochs, correlation=correlation.matrix(n))
    np.testing.assert_array_equal(mine.gram, pair.gram)


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


def test_a_search_that_ends_worse_than_its_start_returns_the_start(monkeypatch) -> None:
    # The search ranks BLTs on few draws; when its end measures worse than the start on the
    # final draws (here: a search that wanders off, made so by replacing Nelder–Mead), the
    # start is returned, with its own measurement.
    from scipy import optimize as sopt
    from userdp.strategies import blt_amplified

    real = sopt.minimize

    def wandering(fun, x0, **kwargs):
        result = real(fun, x0, **{**kwargs, "options": {"maxfev": 1}})
        result.x = np.asarray(x0) + np.array([0.5, 0.0, 0.0, 0.0])  # a valid, worse BLT
        result.fun = -math.inf  # the search believes it improved
        return result

    monkeypatch.setattr(blt_amplified.sopt, "minimize", wandering)
    found = optimize_blt_amplified(
        8, 4, 2, 1.0, 1e-3, num_samples=2**10, final_samples=2**14, seed=3, max_evaluations=5
    )
    assert found.blt == found.unamplified_blt
    assert found.loss == found.unamplified_loss
    assert found.noise_multiplier == found.unamplified_noise_multiplier


def _dense_errors(blt: Blt, n: int) -> tuple[float, float]:
    """(‖A C⁻¹‖²_F / n, max_t ‖row_t(A C⁻¹)‖²) from the dense n×n C built from (θ, ω) alone:
    c_0 = 1, c_k = Σ_i ω_i θ_i^(k−1), C[i, j] = c_{i−j}, A the all-ones lower triangle."""
    theta, omega = np.asarray(blt.buf_decay), np.asarray(blt.output_scale)
    coefs = np.concatenate([[1.0], [float(omega @ theta ** (k - 1)) for k in range(1, n)]])
    lags = np.subtract.outer(np.arange(n), np.arange(n))
    c = np.where(lags >= 0, coefs[np.clip(lags, 0, None)], 0.0)
    workload = np.tril(np.ones((n, n))) @ np.linalg.inv(c)
    return float(np.linalg.norm(workload, "fro") ** 2 / n), float(
        np.max(np.sum(workload**2, axis=1))
    )


def test_rmse_objective_is_the_papers_rmse_and_each_objective_wins_on_its_own() -> None:
    # δ = 1e-2 keeps the Monte Carlo σ of 2^12 draws precise enough that the two objectives'
    # optima separate (by 2–7 % in RMSE and 1–5 % in σ²·max error over seeds 3–6)
    bins, epochs, eps, delta = 6, 3, 1.0, 1e-2
    n, final, seed = bins * epochs, 2**14, 3
    found = {
        objective: optimize_blt_amplified(
            bins,
            epochs,
            2,
            eps,
            delta,
            num_samples=2**12,
            final_samples=final,
            seed=seed,
            max_evaluations=60,
            objective=objective,
        )
        for objective in ("rmse", "max-error")
    }
    losses = {}  # (objective, which BLT) -> σ² · error, σ from the result's own estimator
    for name, result in found.items():
        assert result.objective == name
        sigma = amplified_sigma(
            result.blt, bins, epochs, eps, delta, num_samples=final, seed=seed + 1
        )
        assert sigma == result.noise_multiplier  # the reported σ is that estimator's
        mean_sq, max_sq = _dense_errors(result.blt, n)
        losses["rmse", name], losses["max-error", name] = sigma**2 * mean_sq, sigma**2 * max_sq
        # the reported loss is σ² × the independent error of its objective: RMSE² for "rmse"
        np.testing.assert_allclose(result.loss, losses[name, name], rtol=1e-9)
    rmse = {name: math.sqrt(losses["rmse", name]) for name in found}
    assert rmse["rmse"] <= rmse["max-error"]
    assert losses["max-error", "max-error"] <= losses["max-error", "rmse"]
    assert found["rmse"].blt != found["max-error"].blt
    with pytest.raises(BltError, match="objective='mse'"):
        optimize_blt_amplified(bins, epochs, 2, eps, delta, objective="mse")


def test_cli_prints_a_correlation_the_accountant_accepts_and_refuses_bad_input() -> None:
    out = account(
        "optimize-blt", "--bins", "6", "--epochs", "3", "--buffers", "1", "--epsilon", "1",
        "--delta", "1e-3", "--samples", "2048", "--json", timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["objective"] == "rmse"  # the default
    assert result["loss"] <= result["unamplified"]["loss"]
    eps = account(
        "epsilon", "--mechanism", "balls-in-bins", "--bin-semantics", "fixed", "--bins", "6",
        "--epochs", "3", "--steps", "18", "--delta", "1e-3",
        "--noise-multiplier", str(result["noise_multiplier_estimate"]),
        "--correlation", result["correlation"], "--json", timeout=600,
    )  # fmt: skip
    assert eps.returncode == 0, eps.stderr
    assert json.loads(eps.stdout)["epsilon"] > 0
    bad = account("optimize-blt", "--bins", "0", "--epochs", "3", "--epsilon", "1", timeout=600)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
    assert "--bins=0" in bad.stderr


def test_cli_objective_flag_names_the_objective_and_refuses_an_unknown_one() -> None:
    out = account(
        "optimize-blt", "--bins", "4", "--epochs", "2", "--buffers", "1", "--epsilon", "1",
        "--delta", "1e-3", "--samples", "1024", "--objective", "max-error", "--json", timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["objective"] == "max-error"
    assert "max_t" in result["loss_definition"] and result["loss"] > 0
    bad = account(
        "optimize-blt", "--bins", "4", "--epochs", "2", "--epsilon", "1", "--objective", "mse"
    )
    assert bad.returncode == 2 and not bad.stdout
    errors = [line for line in bad.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, bad.stderr
    assert "--objective" in errors[0] and "'mse'" in errors[0]
    assert "rmse" in errors[0] and "max-error" in errors[0]
