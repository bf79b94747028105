"""``userdp audit`` on the embedded corpus: a correct run's empirical lower bound stays below the
accountant's ε; with clipping disabled (test-only switch) the audit flags the run."""

from __future__ import annotations

import math

import pytest
from scipy import stats

from userdp.config import parse_config
from userdp.run.audit import epsilon_lower_bound, run_audit


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


def test_the_audit_cli_says_its_reach_first_then_what_it_is_doing(tmp_path, monkeypatch, capsys):
    """Before minutes of training, `userdp audit` says the largest bound its canaries can show
    and, when the config's ε is above it, that only gross bugs can be caught; then each phase,
    with a progress bar over the steps; it runs inside the stop signals (SIGTERM ends it as
    Ctrl-C does)."""
    import signal

    from userdp.cli import main
    from userdp.cli.simulate import _interrupt
    from userdp.run import audit

    handlers = []
    real = audit.run_audit

    def observed(*args, **kwargs):
        handlers.append(signal.getsignal(signal.SIGTERM))
        return real(*args, **kwargs)

    monkeypatch.setattr(audit, "run_audit", observed)
    config = tmp_path / "audit.toml"
    config.write_text(
        "[data]\ndemo_users = 30\nseq_len = 16\n[strategy]\nsteps = 2\nsampling_prob = 0.5\n"
        "group_size = 1\nsampler_seed = 0\n[privacy]\nepsilon = 8.0\ndelta = 1e-5\n"
        "[output]\nseed = 0\n"
    )
    code = main(["audit", "--config", str(config), "--canaries", "40", "--output", str(tmp_path)])
    assert code == 0
    err = capsys.readouterr().err
    reach = audit.largest_lower_bound(40, 0.95)
    assert f"40 canaries at 95% confidence can show an ε lower bound of at most {reach:.2f}" in err
    assert "the config targets ε = 8: above that reach, the audit catches only gross bugs" in err
    phases = [
        err.index(audit_phase)
        for audit_phase in (
            "preparing the run",
            "training once with canary users",
            "2/2",
            "turning the canaries",
        )
    ]
    assert phases == sorted(phases)
    assert handlers == [_interrupt]
    assert reach < audit.largest_lower_bound(200, 0.95) < 5  # more canaries reach further
