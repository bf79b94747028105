"""Cyclic Poisson sampling for banded matrix factorization: the sampler's participation pattern and
rate, BLT-DP-FTRL's banded-Poisson mechanism, the config refusals, and a real in-process run."""

from __future__ import annotations

import json

import numpy as np
import pytest
from scipy import stats
from userdp.accounting import epsilon
from userdp.accounting.mechanisms import BallsInBinsMechanism, BandedPoissonMechanism
from userdp.strategies.base import StrategyError
from userdp.strategies.blt import BandedNoise
from userdp.strategies.builtins import UserLevelSampling
from userdp.strategies.dpftrl import BltDpFtrl
from userdp.strategies.samplers import CyclicPoissonSampler

from userdp import cli
from userdp.config import parse_config
from userdp.run.registry import build_strategy

ALPHA = 1e-7  # the suite's false-alarm rate per assertion


def test_a_unit_joins_only_the_steps_of_its_group_at_rate_p() -> None:
    n, bins, p, steps = 600, 4, 0.3, 200
    sampler = CyclicPoissonSampler(bins, p, seed=3)
    groups = sampler.groups.bin_of(0, n)
    joined = np.zeros((steps, n), dtype=bool)
    for t in range(steps):
        cohort = sampler.sample(t, n)
        assert np.all(groups[cohort] == t % bins)  # only the step's group
        joined[t, cohort] = True
    # Within its group's steps each unit joins independently at rate p: the total count is
    # Binomial(units × steps of their group, p).
    trials = sum(int(np.sum(groups == t % bins)) for t in range(steps))
    low, high = stats.binom.interval(1 - ALPHA, trials, p)
    assert low <= joined.sum() <= high
    assert np.array_equal(sampler.sample(7, n), CyclicPoissonSampler(bins, p, seed=3).sample(7, n))
    assert sampler.expected_size(n) == pytest.approx(p * n / bins)


def test_blt_dp_ftrl_with_cyclic_poisson_is_accounted_as_banded_poisson() -> None:
    strategy = BltDpFtrl(
        noise_multiplier=2.0, clip_norm=1.0, bins=3, epochs=4, bands=3, sampling_prob=0.4, seed=1
    )
    mechanism = strategy.mechanism()
    assert isinstance(mechanism, BandedPoissonMechanism)
    assert (mechanism.bands, mechanism.sampling_prob) == (3, 0.4)
    assert mechanism.correlation == strategy.correlation
    assert epsilon(mechanism, 12, 1e-5) > 0
    with pytest.raises(StrategyError, match="needs a banded C"):
        BltDpFtrl(noise_multiplier=2.0, clip_norm=1.0, bins=3, epochs=4, sampling_prob=0.4)
    with pytest.raises(StrategyError, match="use BltDpFtrl"):
        UserLevelSampling(
            noise_multiplier=1.0,
            clip_norm=1.0,
            sampling="cyclic-poisson",
            bins=3,
            epochs=2,
            sampling_prob=0.5,
        )


@pytest.mark.parametrize(
    "strategy",
    [
        'name = "uls"\nsampling = "cyclic-poisson"\nbands = 4\n',
        'name = "blt-dp-ftrl"\nsampling = "cyclic-poisson"\n',
        'name = "blt-dp-ftrl"\nsampling = "poisson"\nbands = 4\n',
    ],
)
def test_config_check_refuses_cyclic_poisson_without_its_pieces(tmp_path, capsys, strategy):
    path = tmp_path / "run.toml"
    path.write_text("[strategy]\n" + strategy)
    assert cli.main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "cyclic-poisson" in err


def test_a_banded_c_with_balls_in_bins_is_built_and_accounted_as_balls_in_bins(tmp_path):
    # bands with fixed bins: the banded noise, the balls-in-bins sampler, and the balls-in-bins
    # accountant with that C (Lemma 3.2 holds for any non-negative lower-triangular C whose bands
    # do not reach a user's next participation, bands <= bins).
    config = parse_config(
        {
            "strategy": {
                "name": "blt-dp-ftrl",
                "sampling": "balls-in-bins-fixed",
                "sampling_prob": 0.25,
                "bands": 2,
                "clip_norm": 1.0,
                "steps": 8,
            },
            "privacy": {"noise_multiplier": 3.0},
        }
    )
    strategy = build_strategy(config, 40, noise_multiplier=3.0)
    assert isinstance(strategy.noise, BandedNoise)
    mechanism = strategy.mechanism()
    assert isinstance(mechanism, BallsInBinsMechanism) and mechanism.bin_semantics == "fixed"
    assert (mechanism.bins, mechanism.epochs) == (4, 2)
    assert mechanism.correlation == strategy.noise.banded.spec()


def test_simulate_in_process_reports_the_banded_poisson_epsilon(tmp_path):
    from userdp.run.launch import run

    config = parse_config(
        {
            "data": {"demo_users": 40, "seq_len": 32, "eval_fraction": 0.1},
            "model": {"preset": "gpt2-tiny"},
            "strategy": {
                "name": "blt-dp-ftrl",
                "sampling": "cyclic-poisson",
                "bands": 2,
                "sampling_prob": 0.5,
                "steps": 4,
                "group_size": 2,
                "engine": "loop",
                "server_optimizer": "sgd",
                "server_lr": 0.5,
            },
            "privacy": {"noise_multiplier": 1.0, "epsilon": 100.0, "delta": 1e-5},
            "workers": {"count": 1},
            "output": {"dir": str(tmp_path / "run"), "seed": 0, "plots": False, "sample_count": 0},
        }
    )
    result = run(config, mode="in-process", quiet=True)
    assert result.stopped == "finished" and result.steps_done == 4
    report = json.loads((result.run_dir / "privacy_report.json").read_text())
    assert report["sampling"] == "cyclic-poisson" and report["accounting_matches_sampling"]
    mechanism = report["mechanism"]
    assert mechanism["kind"] == "banded-poisson" and mechanism["bands"] == 2
    expected = epsilon(
        BandedPoissonMechanism(**{k: v for k, v in mechanism.items() if k != "kind"}), 4, 1e-5
    )
    assert report["epsilon"] == pytest.approx(expected, rel=1e-9)


def test_restoring_a_state_in_place_samples_like_a_fresh_sampler_of_that_state() -> None:
    # The group assignment is cached per seed: a restore must not keep the old one.
    old, saved = CyclicPoissonSampler(4, 0.5, seed=1), CyclicPoissonSampler(4, 0.5, seed=2)
    old.sample(0, 50)
    old.load_state_dict(saved.state_dict())
    for t in range(8):
        assert np.array_equal(old.sample(t, 50), saved.sample(t, 50))


def test_a_population_change_mid_run_is_refused() -> None:
    from userdp.strategies.samplers import SamplerError

    sampler = CyclicPoissonSampler(4, 0.5, seed=1)
    sampler.sample(0, 50)
    with pytest.raises(SamplerError, match="population changed from 50 to 51"):
        sampler.sample(1, 51)
