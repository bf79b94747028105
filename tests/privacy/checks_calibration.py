"""Calibration reaches the noise and the ledger: strategies built as a run builds them.

A run builds its strategy once at σ = 1, calibrates σ on the strategy's mechanism value, and
then sets it (:func:`userdp.run.registry.build_strategy`). Two kinds of bug live between those
steps, and the strategy-level checks (strategies built directly at a fixed σ) cannot see them:

- **noise that does not follow calibration**: a quantity derived from σ once, at construction
  (adaptive clipping's σ_Δ, a cached σ·C), keeps the template's σ = 1 while the ledger records
  the calibrated σ. :func:`check_calibrated_noise_follows_the_ledger` builds each built-in
  strategy and the example plugin from a config with ``privacy.epsilon`` set, so σ is
  calibrated and far from 1, and χ²-tests the std of the noise it RELEASES against the σ its
  ledger record states;
- **calibration at a δ other than the run's**: with ``privacy.delta`` unset the run's δ is
  1/(10·N); :func:`check_calibration_delta_is_the_reports` calibrates at N = 2·10⁶ users (δ =
  5·10⁻⁸, below every library default) and checks that the report's δ is that δ and that the
  report's ε over the run's steps, charged to a ledger with the run's budget, is the budget
  itself (to the calibration's tolerance): σ calibrated at a larger δ overspends at the
  report's δ, and at a smaller one wastes budget.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from userdp.accounting.ledger import BudgetExceededError, Ledger
from userdp.accounting.report import build_report
from userdp.strategies.local_step import run_local_step
from userdp.strategies.unit_stats import UnitStats

from userdp.config import parse_config
from userdp.run.components import strategy_from_config
from userdp.testing.checks import Kit

from .stats import assert_gaussian_noise

EXAMPLE_PLUGIN = Path(__file__).resolve().parents[2] / "examples" / "plugin"
USERS = 400
EPSILON = 1.0  # calibrated σ ≈ 2–3 for these configs: far from the template's σ = 1
DELTA = 1e-5
COMMON = {"sampling_prob": 0.1, "steps": 20, "clip_norm": 0.7}
STRATEGIES: dict[str, dict] = {
    "uls": {},
    "els": {"group_size": 2},
    "group-privacy": {"group_size": 2},
    "dp-fedavg": {},
    "adaptive-clipping": {},  # σ_b = M/20 = 2, σ_Δ = (σ⁻² − (2σ_b)⁻²)^(−1/2)
    "randomized-clipping": {"engine": "randomized", "probes": 16},
    "blt-dp-ftrl": {"sampling": "cyclic-poisson", "bands": 4},
    "warmup_uls:WarmupUls": {
        "plugin_path": str(EXAMPLE_PLUGIN),
        "params": {"learning_rate": 0.5, "warmup_steps": 2},
    },
}
"""Every built-in strategy but the user-wise filter (its own check below) and the example
plugin, each with what its config needs."""
TEMPLATE_GAP = 0.3
"""The calibrated σ must differ from the template's σ = 1 by this much (relative), so that noise
of the template's σ is far outside the χ² acceptance interval (about ±2 % here)."""


@contextlib.contextmanager
def hermetic_cache(tmp_path: Path) -> Iterator[None]:
    """Calibration's on-disk cache in ``tmp_path``: no σ from another run's cache."""
    saved = os.environ.get("USERDP_CACHE_DIR")
    os.environ["USERDP_CACHE_DIR"] = str(Path(tmp_path) / "calibration-cache")
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("USERDP_CACHE_DIR", None)
        else:
            os.environ["USERDP_CACHE_DIR"] = saved


def _config(name: str, strategy: dict, privacy: dict):
    return parse_config({"strategy": {"name": name, **strategy}, "privacy": privacy})


def _ledger_sigma(strategy) -> float:
    """σ as the ledger records it: the ``noise_multiplier`` of the step's mechanism record."""
    return float(strategy.mechanism().to_dict()["noise_multiplier"])


def _assert_calibrated(name: str, sigma: float) -> None:
    assert abs(sigma - 1.0) >= TEMPLATE_GAP, (
        f"precondition: {name}'s calibrated σ = {sigma:.4g} is within {TEMPLATE_GAP:.0%} of the "
        "template's σ = 1, so noise of the template's σ would not be detected"
    )


def check_calibrated_noise_follows_the_ledger(name: str, tmp_path: Path) -> None:
    """A strategy built from a config with ``privacy.epsilon`` (σ calibrated after
    construction) releases, with zero contributions, noise of the std its ledger record states:
    σ·C per coordinate (‖row of C⁻¹‖·σ·C for correlated noise; the sum and the released
    statistics together one Gaussian of multiplier σ for adaptive clipping), by the conformance
    kit's χ² test (:meth:`userdp.testing.checks.Kit.check_noise`)."""
    config = _config(name, {**COMMON, **STRATEGIES[name]}, {"epsilon": EPSILON, "delta": DELTA})
    with hermetic_cache(tmp_path):
        probe = strategy_from_config(config, USERS)[0]
        _assert_calibrated(name, _ledger_sigma(probe))
        kit = Kit(lambda: strategy_from_config(config, USERS)[0], USERS)
        try:
            kit.check_noise()
        except AssertionError as exc:
            raise AssertionError(
                f"{name} built from a config and calibrated to ε = {EPSILON} (ledger σ = "
                f"{_ledger_sigma(probe):.4g}): {exc}; noise that does not follow calibration "
                "(a std derived from σ at construction, where σ = 1)"
            ) from None


FILTER_TAU = 0.3


def check_calibrated_user_filter_noise_follows_the_ledger(tmp_path: Path) -> None:
    """The user-wise filter (Algorithm 3 of "Mind the Privacy Unit! User-Level Differential
    Privacy for Language Model Fine-Tuning") built from a config and calibrated: its released
    mean carries N(0, 8τ² log(e^ε T/δ) σ²/N²) per coordinate with σ the ledger's."""
    steps = COMMON["steps"]
    config = _config(
        "user-wise-filter",
        {
            **COMMON,
            "sampling_prob": 1.0,
            "concentration_threshold": FILTER_TAU,
        },
        {"epsilon": EPSILON, "delta": DELTA},
    )
    with hermetic_cache(tmp_path):
        strategy = strategy_from_config(config, USERS)[0]
    sigma = _ledger_sigma(strategy)
    assert sigma > 1.0 + TEMPLATE_GAP, f"precondition: calibrated σ = {sigma:.4g}"
    users = [f"u{i:04d}" for i in range(USERS)]
    params = {"w": np.zeros((200, 200)), "b": np.zeros(400)}
    seen = []

    def zero_compute(task, unit_ids, params):
        return {n: np.zeros_like(v) for n, v in params.items()}, UnitStats(count=len(unit_ids))

    run_local_step(strategy, 0, params, users, zero_compute, on_release=seen.append)
    assert seen and seen[0].noisy_sum, "the concentrated step released nothing (halted)"
    values = np.concatenate([np.ravel(v) / USERS for v in seen[0].noisy_sum.values()])
    std = math.sqrt(8 * FILTER_TAU**2 * (EPSILON + math.log(steps / DELTA))) * sigma / USERS
    assert_gaussian_noise(
        values,
        std,
        f"user-wise filter calibrated to ε = {EPSILON} (ledger σ = {sigma:.4g}): noise on the "
        "filtered mean; noise that does not follow calibration",
    )


CAL_USERS = 2_000_000
"""δ = 1/(10·N) = 5·10⁻⁸: below every default δ a library or CLI might fall back on."""
CAL_Q = 0.001
CAL_STEPS = 200
CAL_EPSILON = 2.0
CAL_RTOL = 2e-3
"""Calibration returns σ within a relative 10⁻⁴ of the smallest σ meeting the target; ε moves by
at most a few times that (|dlog ε/dlog σ| < 5 here), so the report's ε lies in
[ε·(1 − 2·10⁻³), ε]. A δ off by a factor 2 moves ε by several percent."""


def check_calibration_delta_is_the_reports(tmp_path: Path) -> None:
    """σ is calibrated at the δ the report states: ``privacy.delta`` when set, else 1/(10·N).
    The run's strategy, δ and budget (:func:`userdp.run.components.strategy_from_config`) charge
    the run's steps to a ledger; the report built from it must state that δ and an ε equal to
    the budget within the calibration's tolerance."""
    for explicit in (None, 3e-9):
        config = _config(
            "uls",
            {"sampling_prob": CAL_Q, "steps": CAL_STEPS, "clip_norm": 1.0},
            {"epsilon": CAL_EPSILON, **({"delta": explicit} if explicit else {})},
        )
        expected_delta = explicit if explicit else 1.0 / (10 * CAL_USERS)
        setting = f"privacy.delta = {explicit:g}" if explicit else "privacy.delta unset"
        with hermetic_cache(tmp_path):
            strategy, _, delta = strategy_from_config(config, CAL_USERS)
        assert math.isclose(delta, expected_delta, rel_tol=1e-12), (
            f"{setting}, N = {CAL_USERS}: the run's δ is {delta:.4g}, expected {expected_delta:.4g}"
        )
        path = Path(tmp_path) / f"ledger-{'set' if explicit else 'unset'}.jsonl"
        ledger = Ledger.create(path, budget_epsilon=CAL_EPSILON, delta=delta)
        try:
            for step in range(CAL_STEPS):
                ledger.append(step, strategy.mechanism())
        except BudgetExceededError as exc:
            raise AssertionError(
                f"{setting}: σ = {_ledger_sigma(strategy):.6g} overspends the budget ε = "
                f"{CAL_EPSILON} at the run's δ = {delta:.3g} ({exc}): σ was calibrated at a δ "
                "other than the one the report states"
            ) from None
        finally:
            ledger.close()
        report = build_report(path, delta, unit="user", sampling="poisson")
        assert report.delta == expected_delta, (
            f"{setting}: the report states δ = {report.delta:.4g}, the run's is "
            f"{expected_delta:.4g}"
        )
        assert CAL_EPSILON * (1 - CAL_RTOL) <= report.epsilon <= CAL_EPSILON, (
            f"{setting}, N = {CAL_USERS}: the report states ε = {report.epsilon:.6g} at δ = "
            f"{report.delta:.3g} for σ = {_ledger_sigma(strategy):.6g} calibrated to ε = "
            f"{CAL_EPSILON}: σ was calibrated at a δ other than the one the report states"
        )
