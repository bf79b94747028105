"""Test components: the real ULS strategy with a fixed sampler seed, and the real ledger."""

from __future__ import annotations

from pathlib import Path

from userdp.accounting.ledger import Ledger
from userdp.strategies.builtins import UserLevelSampling
from userdp.strategies.optimizers import Sgd


def uls_strategy(q=0.3, clip_norm=1.0, noise_multiplier=1.0, lr=0.1, seed=0):
    """userdp's real ULS strategy (Poisson users, iid Gaussian noise from os.urandom, SGD on the
    noisy sum ÷ expected cohort), with a fixed SAMPLER seed so a reference can replay cohorts."""
    return UserLevelSampling(
        noise_multiplier=noise_multiplier,
        clip_norm=clip_norm,
        sampling_prob=q,
        seed=seed,
        optimizer=Sgd(lr),
    )


def open_ledger(path: Path, budget_epsilon: float = 1e4, delta: float = 1e-5) -> Ledger:
    """userdp's ledger (fsync'd, hash-chained, locked), with a budget no test reaches."""
    return Ledger.open(path, create=True, budget_epsilon=budget_epsilon, delta=delta)


def ledger_steps(path: Path) -> list[int]:
    """Steps recorded in a ledger file (reads it without taking the writer lock)."""
    from userdp.accounting.ledger import read_ledger

    return [int(r["step"]) for r in read_ledger(path)[1]]
