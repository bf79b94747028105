"""The strategy conformance kit: the privacy checks of userdp's own test suite, run on any strategy.

::

    from userdp.testing import check_strategy

    result = check_strategy(lambda: MyStrategy(noise_multiplier=1.0, clip_norm=1.0, ...))
    print(result.passed, result.skipped)

``factory()`` must build a fresh strategy the way a run would (same arguments every call; a
secret sampler seed is fine). Each check drives the real hooks through the real step
(:mod:`userdp.strategies.step`) with numpy tensors and workers whose contributions are known, and
computes what a correct mechanism must produce from the strategy's own ledger entry
(``mechanism()``) — never from its noise code — so a bug cannot cancel itself out:

``noise``
    With zero contributions the release is pure noise. Its effective noise multiplier — the sum's
    std over the workers' clip norm C, combined with every noisy statistic's std over its stated
    sensitivity, ``(Σ (std/sensitivity)⁻²)^(−1/2)`` — must equal the mechanism's σ (exact χ²
    intervals); correlated noise must have the per-step variance of the mechanism's matrix C⁻¹.
``normalization``
    The cohort's ``expected_size`` is the same at every step (fixed in advance), and the server
    update does not depend on the realized cohort size.
``exactly_once``
    A cohort holds no unit twice, and through the coordinator's gather
    (:class:`userdp.server.aggregation.StepGather`), a duplicated and a late re-issued result
    count each unit once.
``fresh_noise``
    A retried step draws fresh noise (iid noise), and a strategy restored from ``state_dict()``
    samples the same cohorts and draws fresh noise with the same correlation state: the
    difference of its release and the original's for the same step is exactly the fresh part.
``sampling``
    The sampler draws what the accountant assumes: Poisson users at q (rate and Binomial
    cohort sizes), example-level Poisson at p over D_sub with at most G examples per user,
    each user once per epoch of balls-in-bins, or cyclic Poisson (every user's steps in one
    residue mod b̂, inclusions at p within the group).
``facts``
    The report's facts agree with the mechanism (sampling scheme, adjacency, the caveat when no
    accountant matches) and the mechanism round-trips through the ledger's JSON.

Every statistical assertion has a false-alarm probability of at most 1e-7
(:mod:`userdp.testing.stats`). A failed check raises :class:`StrategyCheckError` (an
AssertionError) naming every property that failed; a check that does not apply to the strategy
is listed in ``skipped`` with the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from userdp.testing.checks import Kit, Skip

__all__ = ["CHECKS", "ConformanceResult", "StrategyCheckError", "check_strategy"]

CHECKS = ("noise", "normalization", "exactly_once", "fresh_noise", "sampling", "facts")


class StrategyCheckError(AssertionError):
    """One or more conformance checks failed; the message names each failed property."""


@dataclass
class ConformanceResult:
    passed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def check_strategy(
    factory: Callable[[], Any],
    *,
    users: int = 400,
    checks: Iterable[str] = CHECKS,
) -> ConformanceResult:
    """Run ``checks`` (default: all, see the module docstring) on strategies from ``factory``
    over a population of ``users`` users holding 1..9 examples each."""
    unknown = sorted(set(checks) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown checks {unknown}; expected some of {CHECKS}")
    kit = Kit(factory, users)
    result, failures = ConformanceResult(), []
    for name in CHECKS:
        if name not in checks:
            continue
        try:
            getattr(kit, f"check_{name}")()
        except Skip as skip:
            result.skipped[name] = str(skip)
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
        else:
            result.passed.append(name)
    if failures:
        strategy = type(factory()).__name__
        raise StrategyCheckError(
            f"{strategy} fails {len(failures)} check(s):\n" + "\n".join(failures)
        )
    return result
