"""User-wise DP-SGD with filter (Asi & Liu; Algorithm 3 of "Mind the Privacy Unit! User-Level
Differential Privacy for Language Model Fine-Tuning"): the filter's math on crafted gradients,
AboveThreshold, the noise on a real step, the halt, the refusal outside the in-process step, the
config, and a short ``simulate --in-process`` run on a tiny model.

Expected values are computed here from the test's constants, never read back from the code."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats
from userdp.accounting.ledger import Ledger
from userdp.strategies import AboveThreshold, NoiseRng, Sgd, TrainingHalted, UserWiseFilter
from userdp.strategies.base import StrategyError
from userdp.strategies.local_step import run_local_step
from userdp.strategies.noise import GaussianNoise
from userdp.strategies.step import CohortSum, run_step
from userdp.strategies.unit_stats import UnitStats
from userdp.strategies.user_filter import (
    concentration_score,
    keep_probabilities,
    neighbour_counts,
    pairwise_sq_distances,
)

from userdp import cli
from userdp.config import ConfigError, parse_config
from userdp.testing.stats import Z, assert_gaussian_noise

from .helpers import ZeroNoise

SIGMA, TAU, CLIP = 1.5, 0.3, 1.0
EPSILON, DELTA, STEPS = 8.0, 1e-5, 10


def _strategy(seed: int = 7, **overrides) -> UserWiseFilter:
    kwargs = dict(
        noise_multiplier=SIGMA,
        clip_norm=CLIP,
        concentration_threshold=TAU,
        epsilon=EPSILON,
        delta=DELTA,
        steps=STEPS,
        noise=GaussianNoise(NoiseRng.for_testing(seed)),
        optimizer=Sgd(1.0),
    )
    return UserWiseFilter(**{**kwargs, **overrides})


class PointWorker:
    """Each user's clipped update is a fixed vector (the crafted gradients)."""

    def __init__(self, points: dict[str, dict[str, np.ndarray]]) -> None:
        self.points = points
        self.calls = 0

    def __call__(self, task, unit_ids, params):
        self.calls += 1
        total = {name: np.zeros_like(value) for name, value in params.items()}
        for unit in unit_ids:
            for name, value in self.points[unit].items():
                total[name] = total[name] + value
        return total, UnitStats(count=len(unit_ids))


def _line(positions: list[float]) -> list[dict[str, np.ndarray]]:
    return [{"g": np.array([x, 0.0])} for x in positions]


# ---- the filter's math ------------------------------------------------------------------------


def _brute_counts(points: list[dict[str, np.ndarray]], radius: float) -> np.ndarray:
    vectors = [np.concatenate([np.ravel(v) for v in p.values()]) for p in points]
    return np.array(
        [sum(np.linalg.norm(a - b) <= radius for b in vectors) for a in vectors], dtype=float
    )


def _piecewise(f: float, n: int) -> float:
    """Algorithm 3, line 12, written as printed."""
    if f < n / 2:
        return 0.0
    if f >= 2 * n / 3:
        return 1.0
    return (f - n / 2) / (n / 6)


def test_keep_probabilities_follow_the_piecewise_formula_on_crafted_gradients():
    # N = 12, radius 2τ = 2: six users at 0 see 7 (→ 0.5), the user at 1.9 sees 9 (→ 1), the
    # two at 3.5 see 3 and the three at 10 see 3 (→ 0).
    points = _line([0.0] * 6 + [1.9] + [3.5] * 2 + [10.0] * 3)
    sq = pairwise_sq_distances(points)
    counts = neighbour_counts(sq, 2.0)
    np.testing.assert_array_equal(counts, _brute_counts(points, 2.0))
    np.testing.assert_array_equal(counts, [7] * 6 + [9] + [3] * 2 + [3] * 3)
    p = keep_probabilities(counts, 12)
    np.testing.assert_allclose(p, [_piecewise(f, 12) for f in counts], rtol=0, atol=1e-15)
    np.testing.assert_allclose(p, [0.5] * 6 + [1.0] + [0.0] * 5)
    # the edges: f = N/2 is not kept, f = 2N/3 always is; every middle value is linear
    assert keep_probabilities(np.array([6, 8, 7]), 12).tolist() == [0.0, 1.0, 0.5]
    f = np.arange(0, 31)
    np.testing.assert_allclose(keep_probabilities(f, 30), [_piecewise(x, 30) for x in f])


def test_concentration_score_counts_ordered_pairs_with_the_diagonal():
    rng = np.random.default_rng(3)
    points = [{"a": rng.normal(size=(3, 4)), "b": rng.normal(size=5)} for _ in range(9)]
    sq = pairwise_sq_distances(points)
    radius = 3.5
    brute = _brute_counts(points, radius).sum() / len(points)
    assert concentration_score(sq, radius) == pytest.approx(brute)
    assert concentration_score(sq, 1e-9) == 1.0  # only i = i' (N pairs / N)
    assert concentration_score(sq, 1e9) == 9.0  # all N² pairs / N


# ---- AboveThreshold ---------------------------------------------------------------------------


def test_above_threshold_laplace_scales_are_2_and_4_sensitivity_over_epsilon():
    at = AboveThreshold(epsilon=0.5, sensitivity=2.0)
    assert at.threshold_scale == pytest.approx(2 * 2.0 / 0.5)
    assert at.query_scale == pytest.approx(4 * 2.0 / 0.5)
    # the strategy's instance: ε/2 of the run, Δ = 2 for the score (derived in the accountant)
    at = _strategy().above_threshold
    assert at.epsilon == EPSILON / 2 and at.sensitivity == 2.0
    assert at.threshold_scale == pytest.approx(4 * 2.0 / EPSILON)
    assert at.query_scale == pytest.approx(8 * 2.0 / EPSILON)


def test_laplace_and_uniform_draws_have_the_right_law():
    rng = NoiseRng.for_testing(11)
    n = 40_000
    x = np.array([rng.laplace(3.0) for _ in range(n)])
    # |X| ~ Exp(mean 3): its mean has std 3/√n
    assert abs(np.abs(x).mean() - 3.0) <= Z * 3.0 / math.sqrt(n)
    assert stats.kstest(x, stats.laplace(scale=3.0).cdf).pvalue > 1e-7
    assert stats.kstest(rng.uniform(n), "uniform").pvalue > 1e-7
    secure = NoiseRng(secure=True)
    assert stats.kstest([secure.laplace(1.0) for _ in range(2000)], "laplace").pvalue > 1e-7


def _halt_probability(value: float, threshold_scale: float, query_scale: float) -> float:
    """P(value + ν < ρ), ν ~ Lap(query_scale), ρ ~ Lap(threshold_scale), by quadrature."""
    from scipy import integrate

    def integrand(r):
        return stats.laplace.pdf(r, scale=threshold_scale) * stats.laplace.cdf(
            r - value, scale=query_scale
        )

    parts = [
        (-np.inf, min(0.0, value)),
        (min(0.0, value), max(0.0, value)),
        (max(0.0, value), np.inf),
    ]
    return sum(integrate.quad(integrand, a, b, epsabs=1e-12)[0] for a, b in parts if a < b)


@pytest.mark.parametrize(
    ("value", "expected"), [(200.0, "continue"), (-200.0, "halt"), (3.0, "exact")]
)
def test_above_threshold_halts_with_the_right_probability(value, expected):
    eps, sens, trials = 1.0, 2.0, 4000
    p = _halt_probability(value, 2 * sens / eps, 4 * sens / eps)
    rng = NoiseRng.for_testing(5)
    halts = 0
    for _ in range(trials):
        at = AboveThreshold(eps, sens)
        if not at.above(value, rng):
            halts += 1
            with pytest.raises(StrategyError, match="no further query"):
                at.above(value, rng)
    lo, hi = stats.binom(trials, p).ppf(5e-8), stats.binom(trials, p).isf(5e-8) + 1
    assert lo <= halts <= hi, (halts, p)
    if expected == "continue":
        assert p < 1e-5 and halts == 0
    elif expected == "halt":
        assert p > 1 - 1e-5 and halts == trials


def test_above_threshold_continues_while_above_and_its_state_round_trips():
    rng = NoiseRng.for_testing(2)
    at = AboveThreshold(epsilon=1.0, sensitivity=1.0)
    assert all(at.above(100.0, rng) for _ in range(50))
    again = AboveThreshold(epsilon=1.0, sensitivity=1.0)
    again.load_state_dict(json.loads(json.dumps(at.state_dict())))
    assert again.state_dict() == at.state_dict() and again.state_dict()["noisy_threshold"] != 0


# ---- one step of the strategy -----------------------------------------------------------------


SHAPES = {"w": (200, 250)}  # 50 000 coordinates: the χ² interval is about ±2.4%


def _zeros():
    return {name: np.zeros(shape) for name, shape in SHAPES.items()}


def test_noise_std_on_the_filtered_mean_equals_algorithm_3():
    n = 100
    users = [f"u{i:03d}" for i in range(n)]
    worker = PointWorker({u: _zeros() for u in users})  # perfectly concentrated: all kept
    strategy = _strategy()
    expected = math.sqrt(8 * TAU**2 * math.log(math.exp(EPSILON) * STEPS / DELTA)) * SIGMA / n
    assert strategy.noise_std(n) == pytest.approx(expected, rel=1e-12)
    seen = []
    params = _zeros()
    run_local_step(strategy, 0, params, users, worker, on_release=seen.append)
    assert worker.calls == n  # one call per user: every user's own update
    (release,) = seen
    assert release.cohort.expected_size == n and len(release.cohort) == n
    mean = release.noisy_sum["w"] / n  # what the server divides by: the expected cohort N
    assert_gaussian_noise(mean, expected, "user-wise filter release / N")
    np.testing.assert_allclose(params["w"], -mean)  # SGD(1): θ ← θ − g̃


def test_filtered_mean_keeps_the_concentrated_users_only():
    # 90 users at one gradient, 10 far away: the score is (90² + 10²)/100 = 82 ≥ 4N/5 = 80; the
    # far users see 10 < N/2 users within 2τ (p = 0), the others 90 ≥ 2N/3 (p = 1). Noise is
    # zeroed (NOT PRIVATE) to check the arithmetic: the release is N times the centre's mean.
    n = 100
    users = [f"u{i:03d}" for i in range(n)]
    center = {"g": np.array([0.2, -0.1])}
    far = {"g": np.array([0.0, 0.9])}
    worker = PointWorker({u: (center if i < 90 else far) for i, u in enumerate(users)})
    # ε = 400: AboveThreshold's Laplace scales are 0.02 and 0.04 against a margin of 2
    strategy = _strategy(concentration_threshold=0.05, epsilon=400.0, noise=ZeroNoise())
    seen = []
    run_local_step(strategy, 0, {"g": np.zeros(2)}, users, worker, on_release=seen.append)
    np.testing.assert_allclose(seen[0].noisy_sum["g"], n * center["g"], rtol=1e-12)


def test_a_spread_population_halts_and_the_halt_is_charged_and_reported(tmp_path):
    n = 20
    users = [f"u{i:02d}" for i in range(n)]
    worker = PointWorker({u: {"g": np.array([10.0 * i])} for i, u in enumerate(users)})
    strategy = _strategy(concentration_threshold=1.0)
    ledger = Ledger.open(tmp_path / "ledger.jsonl", create=True, budget_epsilon=50.0, delta=DELTA)
    params = {"g": np.array([1.0])}
    seen = []
    run_local_step(strategy, 0, params, users, worker, ledger=ledger, on_release=seen.append)
    assert seen[0].noisy_sum == {}  # the halt releases nothing but itself
    assert params["g"].tolist() == [1.0]  # and moves nothing
    assert strategy.halted_at == 0 and ledger.steps == 1  # charged: ε/2 of AboveThreshold is spent
    assert ledger.spent(DELTA) >= EPSILON / 2
    with pytest.raises(TrainingHalted, match="answered below at step 0"):
        run_local_step(strategy, 1, params, users, worker, ledger=ledger)
    assert ledger.steps == 1
    caveats = strategy.facts().caveats
    assert any(c.startswith("HALT: AboveThreshold answered below at step 0") for c in caveats)
    assert any("epsilon/2 = 4 to AboveThreshold" in c for c in caveats)
    # a checkpoint keeps the halt and the noisy threshold
    resumed = _strategy(concentration_threshold=1.0)
    resumed.load_state_dict(strategy.state_dict())
    assert resumed.halted_at == 0
    assert resumed.above_threshold.state_dict() == strategy.above_threshold.state_dict()
    ledger.close()


def test_continuing_after_steps_lost_since_the_checkpoint_is_refused():
    users = [f"u{i:03d}" for i in range(100)]
    worker = PointWorker({u: {"g": np.zeros(2)} for u in users})
    strategy = _strategy()
    params = {"g": np.zeros(2)}
    run_local_step(strategy, 0, params, users, worker)
    checkpoint = strategy.state_dict()  # taken after step 0
    run_local_step(strategy, 1, params, users, worker)
    run_local_step(strategy, 2, params, users, worker)
    # a crash loses steps 1-2 (charged in the ledger); the resume skips them and goes on at 3
    resumed = _strategy()
    resumed.load_state_dict(checkpoint)
    with pytest.raises(StrategyError, match="checkpoint_every = 1"):
        run_local_step(resumed, 3, params, users, worker)
    fresh = _strategy()  # no checkpoint at all: a new AboveThreshold instance mid-run
    with pytest.raises(StrategyError, match="follows step -1"):
        run_local_step(fresh, 3, params, users, worker)
    resumed.load_state_dict(checkpoint)
    run_local_step(resumed, 1, params, users, worker)  # the next step is fine


def test_a_transport_that_gathers_only_sums_is_refused_before_any_work():
    strategy = _strategy()
    gathered = []

    def gather(planned):
        gathered.append(planned)
        return CohortSum({"g": np.zeros(2)}, UnitStats(count=2))

    with pytest.raises(StrategyError, match=r"userdp simulate --in-process"):
        run_step(strategy, 0, {"g": np.zeros(2)}, ["a", "b"], gather)
    assert gathered == []
    with pytest.raises(StrategyError, match="returned only their sum"):
        run_step(strategy, 0, {"g": np.zeros(2)}, ["a", "b"], gather, unit_updates=True)


def test_the_mechanism_states_the_split_and_the_horizon():
    m = _strategy().mechanism()
    assert m.to_dict() == {
        "kind": "user-wise-filter",
        "noise_multiplier": SIGMA,
        "above_threshold_epsilon": EPSILON / 2,
        "filter_delta": DELTA / 2,
        "horizon": STEPS,
    }
    facts = _strategy().facts()
    assert facts.sampling == "poisson" and facts.sampling_matches_accounting


# ---- config and CLI ---------------------------------------------------------------------------


def _raw(**strategy):
    return {
        "strategy": {
            "name": "user-wise-filter",
            "sampling_prob": 1.0,
            "concentration_threshold": 0.5,
            **strategy,
        }
    }


def test_config_requires_tau_and_the_full_batch():
    assert parse_config(_raw()).strategy.concentration_threshold == 0.5
    with pytest.raises(ConfigError, match="needs strategy.concentration_threshold"):
        parse_config(_raw(concentration_threshold=None))
    with pytest.raises(ConfigError, match="sampling_prob = 1.0"):
        parse_config(_raw(sampling_prob=0.05))
    with pytest.raises(ConfigError, match="concentration_threshold is set, but .* 'uls'"):
        parse_config({"strategy": {"concentration_threshold": 0.5}})


def test_config_check_prints_one_line_and_exits_2(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text('[strategy]\nname = "user-wise-filter"\nsampling_prob = 1.0\n')
    assert cli.main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "concentration_threshold" in err


# ---- a short in-process run on a tiny model ---------------------------------------------------


def _sim_config(tmp_path, tau: float):
    return parse_config(
        {
            "data": {"demo_users": 40, "seq_len": 32, "eval_fraction": 0.1},
            "model": {"preset": "gpt2-tiny"},
            "strategy": {
                "name": "user-wise-filter",
                "steps": 3,
                "sampling_prob": 1.0,
                "concentration_threshold": tau,
                "group_size": 2,
                "engine": "loop",
                "server_optimizer": "sgd",
                "server_lr": 0.5,
            },
            "privacy": {"epsilon": 20.0},
            "workers": {"count": 1},
            "output": {"dir": str(tmp_path / "run"), "seed": 0, "plots": False, "sample_count": 0},
        }
    )


def test_simulate_in_process_trains_and_the_report_names_the_mechanism(tmp_path):
    from userdp.run.launch import run
    from userdp.run.report import read_metrics

    # τ = 2C: every pair of clipped gradients is within τ, so AboveThreshold passes (the score
    # N is N/5 = 7.2 above its threshold, with Laplace scales 0.4 and 0.8) and all are kept.
    config = _sim_config(tmp_path, tau=2.0)
    result = run(config, mode="in-process", quiet=True)
    assert result.stopped == "finished" and result.steps_done == 3
    report = json.loads((result.run_dir / "privacy_report.json").read_text())
    assert report["mechanism"]["kind"] == "user-wise-filter"
    # the filter's noise covers replacing one user's data with N fixed, not adding a user
    assert report["adjacency"] == "replace one user (N public)"
    assert any("moves N·ĝ by up to the clip norm" in c for c in report["caveats"])
    assert report["mechanism"]["above_threshold_epsilon"] == 10.0
    assert 10.0 < report["epsilon"] <= 20.0  # ε/2 of AboveThreshold + the Gaussian steps
    assert any("Budget split of user-wise DP-SGD with filter" in c for c in report["caveats"])
    assert not any(c.startswith("HALT") for c in report["caveats"])
    steps = [r for r in read_metrics(result.run_dir / "metrics.jsonl") if r["kind"] == "step"]
    users = report["training_users"]
    assert [(r["step"], r["cohort_size"]) for r in steps] == [(s, users) for s in range(3)]
    assert all(math.isfinite(r["loss"]) for r in steps)
    assert (
        math.isfinite(result.final_eval_loss)
        and result.final_eval_loss != result.baseline_eval_loss
    )


def test_simulate_in_process_halts_on_spread_gradients(tmp_path):
    from userdp.run.launch import run

    config = _sim_config(tmp_path, tau=1e-6)  # only i = i' within τ: the score is 1 ≪ 4N/5
    result = run(config, mode="in-process", quiet=True)
    assert result.stopped == "budget" and result.steps_done == 1
    report = json.loads((result.run_dir / "privacy_report.json").read_text())
    assert any(
        c.startswith("HALT: AboveThreshold answered below at step 0") for c in report["caveats"]
    )
    assert report["epsilon"] >= 10.0
