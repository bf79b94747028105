"""Strategies end to end in the in-process loop, on per-user clipped mean estimation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from userdp.accounting import epsilon
from userdp.strategies import ExampleLevelSampling, NoiseRng, Sgd, UserLevelSampling
from userdp.strategies.blt import Blt
from userdp.strategies.dpftrl import BltDpFtrl
from userdp.strategies.local_step import run_local_steps
from userdp.strategies.noise import GaussianNoise

from .helpers import ListLedger, MeanEstimationWorker, example_plugin

WarmupUls = example_plugin()


def _error(params, worker):
    return float(np.linalg.norm(np.asarray(params["theta"]) - worker.center))


def test_example_plugin_runs_end_to_end_and_fills_the_ledger():
    worker = MeanEstimationWorker()
    strategy = WarmupUls(
        sampling_prob=0.25, noise_multiplier=1.0, clip_norm=1.0, learning_rate=0.5, warmup_steps=5
    )
    params = {"theta": np.zeros_like(worker.center)}
    start = _error(params, worker)
    ledger = ListLedger()
    records = run_local_steps(strategy, params, worker.population, worker, 40, ledger=ledger)
    assert _error(params, worker) < 0.15 * start
    assert [step for step, _ in ledger.entries] == list(range(40))
    assert all(m == strategy.mechanism().to_dict() for _, m in ledger.entries)
    assert all(r.expected_size == 100.0 for r in records)
    # every task the worker saw carried the clip norm and only sampled users
    assert all(task.clip_norm == 1.0 for task, _ in worker.calls)
    # the ledger's mechanism accounts like the textbook Poisson-subsampled Gaussian
    import dp_accounting

    reference = dp_accounting.pld.PLDAccountant()
    event = dp_accounting.PoissonSampledDpEvent(0.25, dp_accounting.GaussianDpEvent(1.0))
    reference.compose(dp_accounting.SelfComposedDpEvent(event, 40))
    eps = epsilon(strategy.mechanism(), steps=40, delta=1e-5)
    assert eps == pytest.approx(reference.get_epsilon(1e-5), rel=2e-2)


def test_example_plugin_checkpoint_resume_matches_uninterrupted_sampling():
    worker = MeanEstimationWorker(n_users=50)
    kw = dict(sampling_prob=0.3, noise_multiplier=0.5, clip_norm=1.0, learning_rate=0.1)
    a = WarmupUls(**kw)
    run_local_steps(a, {"theta": np.zeros(3)}, worker.population, worker, 3)
    b = WarmupUls(**kw)
    b.load_state_dict(a.state_dict())
    assert (
        a.sample_cohort(7, list(worker.data)).unit_ids
        == b.sample_cohort(7, list(worker.data)).unit_ids
    )


@pytest.mark.parametrize("kind", ["uls", "els", "blt"])
def test_builtins_learn_the_mean(kind):
    worker = MeanEstimationWorker(n_users=600, seed=1)
    rng = NoiseRng.for_testing(11)
    if kind == "uls":
        strategy = UserLevelSampling(
            noise_multiplier=1.0,
            clip_norm=1.0,
            sampling_prob=0.2,
            noise=GaussianNoise(rng),
            optimizer=Sgd(0.5),
        )
    elif kind == "els":
        strategy = ExampleLevelSampling(
            noise_multiplier=1.0,
            clip_norm=1.0,
            sampling_prob=0.05,
            group_size=4,
            noise=GaussianNoise(rng),
            optimizer=Sgd(0.5),
        )
    else:
        strategy = BltDpFtrl(
            noise_multiplier=1.0,
            clip_norm=1.0,
            bins=5,
            epochs=8,
            blt=Blt((0.95, 0.6), (0.05, 0.3)),
            rng=rng,
            optimizer=Sgd(0.5),
        )
    params = {"theta": torch.zeros(3, dtype=torch.float64)}
    start = _error(params, worker)
    ledger = ListLedger()
    run_local_steps(strategy, params, worker.population, worker, 40, ledger=ledger)
    assert isinstance(params["theta"], torch.Tensor)
    assert _error(params, worker) < 0.2 * start
    assert len(ledger.entries) == 40
    if kind == "els":
        assert all(task.unit == "example" for task, _ in worker.calls)
