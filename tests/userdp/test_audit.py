"""``userdp audit`` on the embedded corpus: a correct run's empirical lower bound stays below the
accountant's ε; with clipping disabled (test-only switch) the audit flags the run."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from userdp.audit import epsilon_lower_bound, run_audit
from userdp.config import parse_config


def audit_config():
    return parse_config(
        {
            "data": {"demo_users": 40, "seq_len": 32},
            "strategy": {
                "steps": 10,  # an included canary goes unsampled w.p. 0.5^10 only
                "sampling_prob": 0.5,
                "group_size": 2,
                "engine": "vectorized",
                "server_optimizer": "sgd",
                "server_lr": 0.1,
                "sampler_seed": 0,  # a fixed cohort sequence: the thresholds below are for it
            },
            "privacy": {"epsilon": 2.0, "delta": 1e-6},
            "output": {"seed": 0},
        }
    )


def test_correct_run_stays_below_the_claim_and_broken_clipping_is_flagged() -> None:
    config = audit_config()
    honest = run_audit(config, canaries=200, seed=1)
    assert honest.claimed_epsilon == pytest.approx(2.0, rel=1e-3)
    assert honest.epsilon_lower_bound <= honest.claimed_epsilon and not honest.flagged
    broken = run_audit(config, canaries=200, seed=1, test_only_disable_clipping=True)
    assert broken.correct >= broken.guesses - 1 >= 199  # an unclipped canary is plain to see
    assert broken.epsilon_lower_bound > broken.claimed_epsilon and broken.flagged


def test_lower_bound_inverts_the_binomial_tail() -> None:
    eps = epsilon_lower_bound(100, 90, 0.05)
    p = 1 / (1 + math.exp(-eps))
    assert stats.binom.sf(89, 100, p) == pytest.approx(0.05, rel=1e-6)
    assert epsilon_lower_bound(100, 50, 0.05) == 0.0  # chance level proves nothing
    assert epsilon_lower_bound(100, 100, 0.05) == pytest.approx(
        math.log(0.05**0.01 / (1 - 0.05**0.01)), rel=1e-6
    )
