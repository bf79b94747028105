"""Built-in strategies: cohorts, normalizers, mechanisms, report facts, task specs, state."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from userdp.accounting.mechanisms import (
    BallsInBinsMechanism,
    ElsMechanism,
    GroupPrivacyMechanism,
    RandomizedClippingMechanism,
    UlsMechanism,
    mechanism_from_dict,
)
from userdp.strategies import (
    DpFedAvg,
    ExampleLevelSampling,
    GroupPrivacyComparison,
    RandomizedClipping,
    Sgd,
    StrategyError,
    UserLevelSampling,
    parse_example_unit_id,
)
from userdp.strategies.adaptive_clipping import AdaptiveClipping, update_noise_multiplier
from userdp.strategies.base import Cohort, Release, UnitStats
from userdp.strategies.compute_budget import estimate_and_double
from userdp.strategies.dpftrl import BltDpFtrl

from .helpers import ZeroNoise

USERS = tuple(f"u{i}" for i in range(1000))


def uls(**kw):
    base = dict(noise_multiplier=1.0, clip_norm=1.0, sampling_prob=0.05, seed=0)
    return UserLevelSampling(**{**base, **kw})


def test_uls_cohort_mechanism_and_facts():
    s = uls()
    cohort = s.sample_cohort(0, USERS)
    assert set(cohort.unit_ids) <= set(USERS) and cohort.expected_size == 50.0
    assert s.mechanism() == UlsMechanism(1.0, 0.05)
    facts = s.facts()
    assert facts.sampling_matches_accounting and facts.adjacency == "add-remove"
    assert any("secret" in c for c in facts.caveats)  # explicit seed is flagged
    assert not any("secret" in c for c in uls(seed=None).facts().caveats)
    assert any("public" in c for c in facts.caveats)
    fixed = uls(seed=None, expected_cohort_size=48.0)
    assert fixed.facts().caveats == () and fixed.sample_cohort(0, USERS).expected_size == 48.0
    assert s.configure_task(0, cohort).unit == "user"


def test_server_update_divides_by_expected_not_realized_size():
    s = uls(noise=ZeroNoise(), optimizer=Sgd(1.0))
    params = {"w": np.zeros(2)}
    cohort = Cohort(0, ("u1", "u2", "u3"), expected_size=50.0)
    noisy = s.add_noise(0, {"w": np.array([3.0, -6.0])})
    s.server_update(params, Release(0, cohort, noisy))
    np.testing.assert_allclose(params["w"], [-3.0 / 50, 6.0 / 50])


def test_shuffle_is_flagged_as_not_matching_accounting():
    s = uls(sampling="shuffle")
    cohort = s.sample_cohort(0, USERS)
    assert len(cohort) == 50
    facts = s.facts()
    assert not facts.sampling_matches_accounting
    assert any("DOES NOT MATCH" in c for c in facts.caveats)


def test_truncated_states_zero_out_adjacency_and_pads():
    s = uls(sampling="padding", cohort_cap=40, sampling_prob=0.2)
    cohort = s.sample_cohort(0, USERS)
    assert len(cohort) <= 40 and cohort.padded_size == 40
    assert s.facts().adjacency == "zero-out"


def test_balls_in_bins_uls_declares_its_epochs():
    s = uls(sampling="balls-in-bins-epoch", bins=10, epochs=2, sampling_prob=None)
    units = [u for t in range(10) for u in s.sample_cohort(t, USERS).unit_ids]
    assert sorted(units) == sorted(USERS)
    assert s.mechanism() == BallsInBinsMechanism(1.0, 10, 2, "per-epoch")
    with pytest.raises(StrategyError):
        s.sample_cohort(20, USERS)


def test_els_cohort_respects_group_size_and_poisson_rate():
    rng = np.random.default_rng(0)
    population = {f"u{i}": int(c) for i, c in enumerate(rng.integers(1, 30, size=300))}
    g, p = 8, 0.2
    s = ExampleLevelSampling(noise_multiplier=1.0, clip_norm=1.0, sampling_prob=p, group_size=g)
    d_sub = sum(min(c, g) for c in population.values())
    hits: dict[str, int] = {}
    steps = 200
    for t in range(steps):
        cohort = s.sample_cohort(t, population)
        assert cohort.expected_size == pytest.approx(p * d_sub)
        for unit in cohort.unit_ids:
            user, index = parse_example_unit_id(unit)
            assert 0 <= index < population[user]
            hits[unit] = hits.get(unit, 0) + 1
    per_user: dict[str, set] = {}
    for unit in hits:
        per_user.setdefault(parse_example_unit_id(unit)[0], set()).add(unit)
    assert max(len(v) for v in per_user.values()) <= g  # D_sub chosen once: ≤ G distinct ever
    assert len(hits) <= d_sub
    mean_rate = sum(hits.values()) / (steps * d_sub)
    assert abs(mean_rate - p) < 4 * math.sqrt(p * (1 - p) / (steps * d_sub))
    assert s.mechanism() == ElsMechanism(1.0, p, g)
    assert s.configure_task(0, cohort).unit == "example"
    with pytest.raises(StrategyError):
        s.sample_cohort(0, USERS)  # no example counts: refuses


def test_els_state_round_trip_rebuilds_same_subset():
    population = {f"u{i}": 20 for i in range(50)}
    a = ExampleLevelSampling(noise_multiplier=1.0, clip_norm=1.0, sampling_prob=0.3, group_size=4)
    b = ExampleLevelSampling(noise_multiplier=1.0, clip_norm=1.0, sampling_prob=0.3, group_size=4)
    a.sample_cohort(0, population)
    b.load_state_dict(a.state_dict())
    assert a.sample_cohort(5, population).unit_ids == b.sample_cohort(5, population).unit_ids


def test_group_privacy_and_randomized_clipping_describe_themselves():
    gp = GroupPrivacyComparison(
        noise_multiplier=1.0, clip_norm=1.0, sampling_prob=0.1, group_size=4
    )
    assert gp.mechanism() == GroupPrivacyMechanism(1.0, 0.1, 4)
    els = ExampleLevelSampling(noise_multiplier=1.0, clip_norm=1.0, sampling_prob=0.1, group_size=4)
    assert gp.facts().caveats == els.facts().caveats  # the report states the comparison, once
    rc = RandomizedClipping(probes=8, noise_multiplier=1.0, clip_norm=1.0, sampling_prob=0.1)
    assert rc.mechanism() == RandomizedClippingMechanism(1.0, 0.1, 8, "hutchinson")
    spec = rc.configure_task(0, rc.sample_cohort(0, USERS))
    assert spec.engine == "randomized" and spec.probes == 8


def test_dp_fedavg_task_asks_for_local_steps_and_uses_uls_accounting():
    s = DpFedAvg(
        local_steps=5, local_lr=0.05, noise_multiplier=1.0, clip_norm=0.5, sampling_prob=0.1
    )
    spec = s.configure_task(0, s.sample_cohort(0, USERS))
    assert (spec.local_steps, spec.local_lr, spec.clip_norm) == (5, 0.05, 0.5)
    assert s.mechanism() == UlsMechanism(1.0, 0.1)
    with pytest.raises(StrategyError):
        DpFedAvg(
            local_steps=0, local_lr=0.1, noise_multiplier=1.0, clip_norm=1.0, sampling_prob=0.1
        )


def test_banded_dpftrl_optimizes_its_bands():
    s = BltDpFtrl(noise_multiplier=1.0, clip_norm=1.0, bins=4, epochs=3, bands=3)
    m = s.mechanism()
    assert m.correlation.name == "banded" and len(dict(m.correlation.params)["coefs"]) == 3
    with pytest.raises(StrategyError):
        BltDpFtrl(noise_multiplier=1.0, clip_norm=1.0, bins=4, epochs=3, bands=5)


def test_mechanisms_serialize_for_the_ledger():
    for strategy in (uls(), BltDpFtrl(noise_multiplier=1.0, clip_norm=1.0, bins=4, epochs=3)):
        m = strategy.mechanism()
        assert mechanism_from_dict(m.to_dict()) == m


def test_adaptive_clipping_noise_split_is_one_gaussian_of_multiplier_z():
    z, sigma_b = 1.0, 5.0
    sigma_delta = update_noise_multiplier(z, sigma_b)
    # neighbour adds a user with ‖Δ‖ = C and centered count ½: normalized shift has norm 1/z
    shift = math.hypot(1.0 / sigma_delta, 0.5 / sigma_b)
    assert shift == pytest.approx(1.0 / z)
    assert sigma_delta > z
    with pytest.raises(StrategyError):
        update_noise_multiplier(1.0, 0.4)


def test_adaptive_clipping_tracks_the_target_quantile():
    rng = np.random.default_rng(0)
    s = AdaptiveClipping(
        clip_norm=0.1,
        target_quantile=0.5,
        clip_lr=0.2,
        count_stddev=2.0,
        noise_multiplier=1.0,
        sampling_prob=0.5,
        optimizer=Sgd(1.0),
    )
    assert s.mechanism() == UlsMechanism(1.0, 0.5)
    params = {"w": np.zeros(1)}
    for t in range(300):
        cohort = s.sample_cohort(t, USERS)
        norms = rng.uniform(0.0, 2.0, size=len(cohort))  # median 1.0
        clipped = int((norms > s.clip_norm).sum())
        stats = UnitStats(count=len(cohort), clipped=clipped)
        s.server_update(params, s.privatize(t, {"w": np.zeros(1)}, stats, cohort))
    assert s.clip_norm == pytest.approx(1.0, rel=0.1)


def test_adaptive_clipping_refuses_a_calibrated_sigma_its_count_noise_cannot_share(tmp_path):
    """The run's strategy is built at σ = 1 and calibrated after; a calibrated z ≥ 2σ_b leaves
    the sum no noise share, so the build stops naming count_stddev (before any step)."""
    from userdp.config import parse_config
    from userdp.run.registry import build_strategy

    config = parse_config(
        {
            "strategy": {"name": "adaptive-clipping", "sampling_prob": 0.2, "steps": 8},
            "privacy": {"epsilon": 1.0, "delta": 1e-5},
        }
    )
    calibrated = build_strategy(config, 1000, lambda template: 19.5)  # σ_b = qN/20 = 10
    assert calibrated.noise_multiplier == 19.5 and calibrated.count_stddev == 10.0
    with pytest.raises(StrategyError, match=r"count_stddev=10.0 is too small.*noise_multiplier=20"):
        build_strategy(config, 1000, lambda template: 20.0)


def test_estimate_and_double_rules():
    def norm(g):
        return 10.0 / math.sqrt(g)  # τ_G = 0.707 (iid gradients)

    def sigma(m):
        return max(1.0, m / 256.0) * (m / 32.0) ** 0.1  # sub-linear until 256, then linear

    std = estimate_and_double(2**14, norm, sigma)
    assert (std.group_size, std.cohort_size) == (64, 256)  # grow M first, then G
    assert [d.doubled for d in std.trace][:3] == ["M", "M", "M"]
    paper = estimate_and_double(2**14, norm, sigma, rule="paper")
    assert paper.cohort_size == 32  # the literal rule (τ_G < τ_M) always doubles G here
    capped = estimate_and_double(2**14, norm, lambda m: 1.0, max_cohort_size=128)
    assert capped.cohort_size == 128 and capped.compute <= 2**14


@pytest.mark.parametrize(
    ("strategy", "optimizer", "cached"),
    [
        (
            {"name": "blt-dp-ftrl", "sampling": "balls-in-bins-fixed"},
            "optimize_blt",
            "optimized_blt",
        ),
        (
            {"name": "blt-dp-ftrl", "sampling": "cyclic-poisson", "bands": 2},
            "optimize_banded",
            "optimized_banded",
        ),
    ],
)
def test_a_calibrated_blt_build_optimizes_its_correlation_once(
    monkeypatch, strategy, optimizer, cached
):
    """A calibrated build makes the strategy once at σ = 1, calibrates its mechanism value and
    sets σ: the real optimizer runs once, counted with the per-process cache bypassed (a second
    construction would optimize again), and the strategy records the mechanism calibrated."""
    from userdp.strategies import dpftrl

    from userdp.config import parse_config
    from userdp.run.registry import build_strategy

    calls = []
    real = getattr(dpftrl, optimizer)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(dpftrl, optimizer, counted)
    monkeypatch.setattr(dpftrl, cached, getattr(dpftrl, cached).__wrapped__)
    config = parse_config(
        {
            "strategy": {**strategy, "sampling_prob": 0.25, "steps": 8},
            "privacy": {"epsilon": 8.0, "delta": 1e-5},
        }
    )
    templates = []

    def calibrate(template):
        templates.append(template)
        return 2.5

    built = build_strategy(config, 40, calibrate)
    assert len(calls) == 1
    assert [t.noise_multiplier for t in templates] == [1.0]
    assert built.mechanism() == dataclasses.replace(templates[0], noise_multiplier=2.5)


def test_aggregate_is_not_a_hook_a_strategy_can_override():
    """Every transport sums the clipped partials itself (the coordinator while they stream in),
    so an `aggregate` override would change `simulate --in-process` and not a deployment: the
    class is refused where it is defined, naming what to do instead."""
    from userdp.strategies.base import StrategyError

    with pytest.raises(
        StrategyError, match=r"defines aggregate\(\), which is not a hook.*privatize"
    ):

        class Rescaled(UserLevelSampling):
            def aggregate(self, partials):
                return {}


@pytest.mark.parametrize(
    ("strategy", "key"),
    [
        ({"name": "uls"}, "expected_cohort_size"),
        ({"name": "dp-fedavg"}, "expected_cohort_size"),
        ({"name": "blt-dp-ftrl", "sampling": "balls-in-bins-fixed"}, "expected_cohort_size"),
        ({"name": "els"}, "expected_batch_size"),
    ],
)
def test_the_normalizer_keys_the_caveat_names_fix_the_normalizer(strategy, key):
    """The report's advice ("set strategy.expected_cohort_size / expected_batch_size") can be
    followed: the key fixes the normalizer whatever the population, and the caveat that N (or
    the example counts) was treated as public goes away."""
    from userdp.config import parse_config
    from userdp.run.registry import build_strategy

    def build(extra):
        config = parse_config(
            {"strategy": {**strategy, "sampling_prob": 0.25, "steps": 8, **extra}}
        )
        return build_strategy(config, 40, 1.5)

    population = {f"u{i}": 1 + i % 3 for i in range(40)}
    default, fixed = build({}), build({key: 7.5})
    assert fixed.expected_cohort_size(population) == 7.5
    assert default.expected_cohort_size(population) != 7.5
    public = [c for c in default.caveats() if "treated" in c and "public" in c]
    assert public and f"strategy.{key}" in public[0]
    assert not [c for c in fixed.caveats() if c in public]


def test_els_with_a_ranked_selection_samples_ranks_below_g_and_refuses_chunks() -> None:
    from userdp.strategies import ExampleLevelSampling
    from userdp.strategies.base import parse_example_unit_id
    from userdp.strategies.population import PopulationCounts

    population = PopulationCounts(["a", "b", "c"], np.array([7, 1, 3]))
    strategy = ExampleLevelSampling(
        noise_multiplier=1.0, clip_norm=1.0, sampling_prob=1.0, group_size=2, selection="longest"
    )
    cohort = strategy.sample_cohort(0, population)
    assert sorted(parse_example_unit_id(u) for u in cohort.unit_ids) == [
        ("a", 0), ("a", 1), ("b", 0), ("c", 0), ("c", 1)
    ]  # fmt: skip
    with pytest.raises(StrategyError, match="selection='random_chunk'"):
        ExampleLevelSampling(
            noise_multiplier=1.0, clip_norm=1.0, sampling_prob=0.5, group_size=2,
            selection="random_chunk",
        )  # fmt: skip
