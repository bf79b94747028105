"""The paper-reproduction benchmark drives the production path: its mean-estimation runs learn
the mean, and their σ is the accountant's for the paper's setting."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import papers  # noqa: E402


def test_methods_spend_the_same_compute_budget() -> None:
    for budget in (16, 64, 256):
        for method in papers.methods(budget):
            units = papers.USERS * (papers.ELS_GROUP if method.name == "els" else 1)
            per_unit = method.group_size if method.name == "uls" else 1
            assert np.isclose(method.sampling_prob(budget) * units * per_unit, budget)


def test_a_private_run_learns_the_population_mean(tmp_path, monkeypatch) -> None:
    """At ε = 8 the final squared error is far below the initial ‖μ‖² (θ₀ = 0): the step, the
    clipping and the normalization move θ towards μ. The bound is loose on purpose: the expected
    error is a few units (sampling of N = 256 user means plus the noise), ‖μ‖² ≈ d = 32."""
    monkeypatch.setenv("USERDP_CACHE_DIR", str(tmp_path))
    setting = papers.Setting(epsilon=8.0, budget=64, sigma_2=1.0)
    mu, _ = papers.user_data(0, setting.sigma_2)
    for method in (papers.Method("els", 16), papers.Method("uls", 4)):
        result = papers.run_once(setting, method, lr=0.2, clip=8.0, seed=0)
        assert result["error"] < 0.25 * float(mu @ mu), (method, result)
