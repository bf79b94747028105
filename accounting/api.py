"""ε for a mechanism run for some steps, and for a composition of phases: the accounting entry point.

Dispatch (all add-or-remove-one-user adjacency, pessimistic estimates):

* ``uls``  — PLD of ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``, built as the G = 1 mixture
  by :mod:`userdp.accounting.fast_pld` (ε equals ``PLDAccountant``'s to 1e-8 relative).
* ``els``  — PLD of ``MixtureOfGaussiansDpEvent(σ, 0..G, Binom(G, p))``, the same builder.
  ``pld_backend="dp_accounting"`` builds and composes either with the library's own (slow) code,
  ``PLDAccountant`` bit for bit.
* ``group-privacy`` — COMPARISON ONLY: example-level Poisson-Gaussian PLD, then the black-box
  group-privacy conversion (Vadhan 2017), minimized over the example-level ε₀.
* ``balls-in-bins`` — the smallest certified upper bound among the random-allocation PLD
  (C = I), the Gaussian bound without amplification and Monte Carlo Estimate-Verify-Release,
  :mod:`userdp.accounting.balls_in_bins_certified` (never the Monte Carlo point estimate).
* ``randomized-clipping`` — envelope accountant, :mod:`userdp.accounting.randomized_clipping`.
* ``user-wise-filter`` — AboveThreshold ε plus a q = 1 Gaussian PLD,
  :mod:`userdp.accounting.user_filter`.

uls, els and randomized-clipping steps compose with each other across phases as PLDs; group
privacy, balls-in-bins and user-wise-filter are whole-run accountants and cannot be composed with
anything else.

The PLD accountants (uls, els, randomized-clipping composition, group privacy) live in
:mod:`userdp.accounting.pld_accountant` and are imported on first use, like the whole-run
accountants, so importing this module loads neither dp_accounting nor scipy.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

from userdp.accounting.errors import NotComposableError
from userdp.accounting.mechanisms import (
    COMPOSABLE_KINDS,
    DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    PLD_KINDS,
    BallsInBinsMechanism,
    BandedPoissonMechanism,
    GroupPrivacyMechanism,
    InvalidMechanismError,
    Mechanism,
    RandomizedClippingMechanism,
    UlsMechanism,
    UserWiseFilterMechanism,
)
from userdp.accounting.validation import non_negative_float, non_negative_int, probability

if TYPE_CHECKING:
    from dp_accounting.pld.privacy_loss_distribution import PrivacyLossDistribution

__all__ = [
    "ACCOUNTANT_VERSION",
    "DEFAULT_VALUE_DISCRETIZATION_INTERVAL",
    "AccountantUnavailableError",
    "NotComposableError",
    "compose_delta",
    "compose_epsilon",
    "delta",
    "epsilon",
    "privacy_loss_distribution",
]

# Bump when any accountant's numbers may change (it keys the on-disk calibration cache).
ACCOUNTANT_VERSION = "5"


class AccountantUnavailableError(ValueError):
    """The accountant module for a mechanism kind is missing from this install."""


def epsilon(
    mechanism: Mechanism,
    steps: int,
    delta: float,
    *,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    pld_backend: str = "fast",
    **monte_carlo: Any,
) -> float:
    """ε(δ) after ``steps`` steps of ``mechanism`` (user level, add/remove one user).

    A balls-in-bins ε is certified (:mod:`userdp.accounting.balls_in_bins_certified`) and takes
    no ``monte_carlo`` keyword arguments.
    """
    return compose_epsilon(
        [(mechanism, steps)],
        delta,
        value_discretization_interval=value_discretization_interval,
        pld_backend=pld_backend,
        **monte_carlo,
    )


def compose_epsilon(
    phases: Sequence[tuple[Mechanism, int]],
    delta: float,
    *,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    pld_backend: str = "fast",
    **monte_carlo: Any,
) -> float:
    """ε(δ) of the sequential composition of ``phases``, each ``(mechanism, count)``.

    Repeated mechanisms are merged first (one ledger record per step is fine). A single
    non-uls/els mechanism is delegated to its own accountant (group privacy, balls-in-bins,
    randomized clipping). Otherwise uls, els and randomized-clipping phases (any σ, q, G) are
    composed exactly as PLDs at ``value_discretization_interval``; group privacy and
    balls-in-bins mixed with anything raise :class:`NotComposableError`.
    """
    _check_delta(delta)
    phases = _normalize_phases(phases)
    if not phases:
        return 0.0
    if len(phases) == 1 and phases[0][0].kind not in PLD_KINDS:
        mechanism, steps = phases[0]
        return _whole_run_epsilon(
            mechanism, steps, delta, value_discretization_interval, monte_carlo
        )
    blocking = [m.kind for m, _ in phases if m.kind not in COMPOSABLE_KINDS]
    if blocking:
        kinds = sorted({m.kind for m, _ in phases})
        raise NotComposableError(
            f"phases={kinds} cannot be composed: {blocking[0]!r} is accounted as a whole run "
            "and does not compose with other phases; account one phase at a time"
        )
    return _pld_accountant(phases).epsilon(
        phases, delta, value_discretization_interval, pld_backend
    )


def delta(
    mechanism: Mechanism,
    steps: int,
    epsilon: float,
    *,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    pld_backend: str = "fast",
) -> float:
    """δ(ε) after ``steps`` steps of a PLD mechanism (uls or els)."""
    return compose_delta(
        [(mechanism, steps)],
        epsilon,
        value_discretization_interval=value_discretization_interval,
        pld_backend=pld_backend,
    )


def compose_delta(
    phases: Sequence[tuple[Mechanism, int]],
    epsilon: float,
    *,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    pld_backend: str = "fast",
) -> float:
    """δ(ε) of the composition of PLD phases (uls, els)."""
    if epsilon != math.inf:  # δ(∞) = 0 is a valid query
        non_negative_float("epsilon", epsilon, InvalidMechanismError)
    pld = privacy_loss_distribution(
        phases, value_discretization_interval=value_discretization_interval, pld_backend=pld_backend
    )
    return float(pld.get_delta_for_epsilon(float(epsilon)))


def privacy_loss_distribution(
    phases: Sequence[tuple[Mechanism, int]],
    *,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    pld_backend: str = "fast",
    rc_tail_mass: float = 1e-12,
) -> PrivacyLossDistribution:
    """The composed dp_accounting PLD of ``phases`` (uls, els, randomized-clipping), in
    PLDAccountant's order. ``rc_tail_mass``: the randomized-clipping envelope mass above its
    grid, per step, charged as infinite privacy loss (valid for any value; smaller is tighter
    only while it stays well below δ/steps)."""
    phases = _normalize_phases(phases)
    return _pld_accountant(phases).privacy_loss_distribution(
        phases,
        value_discretization_interval=value_discretization_interval,
        pld_backend=pld_backend,
        rc_tail_mass=rc_tail_mass,
    )


# --------------------------------------------------------------------------------------------
# whole-run accountants


def _whole_run_epsilon(
    mechanism: Mechanism,
    steps: int,
    delta: float,
    value_discretization_interval: float,
    monte_carlo: dict[str, Any],
) -> float:
    if isinstance(mechanism, GroupPrivacyMechanism):
        return _pld_accountant([(mechanism, steps)]).group_privacy_epsilon(
            mechanism, steps, delta, value_discretization_interval
        )
    if isinstance(mechanism, BallsInBinsMechanism):
        if monte_carlo:
            raise InvalidMechanismError(
                f"{sorted(monte_carlo)} do not apply: a balls-in-bins ε is the certified bound of "
                "userdp.accounting.balls_in_bins_certified, a function of (mechanism, steps, δ) "
                "alone; Monte Carlo sample counts and seeds belong to the point estimate "
                "(userdp.accounting.balls_in_bins.epsilon), which is not a guarantee"
            )
        certified = _accountant_module("balls_in_bins_certified", mechanism.kind)
        epochs = balls_in_bins_epochs(mechanism, steps)
        return certified.certified_epsilon(mechanism, epochs, delta).epsilon
    if isinstance(mechanism, RandomizedClippingMechanism):
        randomized_clipping = _accountant_module("randomized_clipping", mechanism.kind)
        return float(
            randomized_clipping.epsilon(
                mechanism.noise_multiplier,
                mechanism.sampling_prob,
                steps,
                mechanism.probes,
                delta,
                estimator=mechanism.estimator,
            )
        )
    if isinstance(mechanism, BandedPoissonMechanism):
        banded_poisson = _accountant_module("banded_poisson", mechanism.kind)
        try:
            return banded_poisson.epsilon(
                mechanism,
                steps,
                delta,
                value_discretization_interval=value_discretization_interval,
            )
        except banded_poisson.BandedPoissonError as exc:
            raise InvalidMechanismError(str(exc)) from None
    if isinstance(mechanism, UserWiseFilterMechanism):
        user_filter = _accountant_module("user_filter", mechanism.kind)
        return user_filter.epsilon(
            mechanism, steps, delta, value_discretization_interval=value_discretization_interval
        )
    raise NotComposableError(f"mechanism kind {mechanism.kind!r} has no whole-run accountant")


def _accountant_module(name: str, kind: str) -> Any:
    """Import ``userdp.accounting.<name>`` lazily (it may be heavier, or not installed yet); a
    missing accountant module of this package, its own or one it imports, is named in one
    error."""
    try:
        return importlib.import_module(f"userdp.accounting.{name}")
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("userdp.accounting."):
            raise
        raise AccountantUnavailableError(
            f"mechanism kind {kind!r} needs {exc.name}, which is not available in this install"
        ) from None


def _pld_accountant(phases: Sequence[tuple[Mechanism, int]] = ()) -> ModuleType:
    """:mod:`userdp.accounting.pld_accountant`, imported on first use."""
    kinds = "+".join(sorted({m.kind for m, _ in phases})) or UlsMechanism.kind
    return _accountant_module("pld_accountant", kinds)


def balls_in_bins_epochs(mechanism: BallsInBinsMechanism, steps: int) -> int:
    """Epochs whose full run covers ``steps`` releases (a prefix of a run is post-processing)."""
    total = mechanism.bins * mechanism.epochs
    if steps > total:
        raise InvalidMechanismError(
            f"steps={steps} is out of range for balls-in-bins with bins={mechanism.bins}, "
            f"epochs={mechanism.epochs}; expected 0 <= steps <= {total}"
        )
    return max(1, math.ceil(steps / mechanism.bins))


# --------------------------------------------------------------------------------------------
# input checks


def _normalize_phases(phases: Sequence[tuple[Mechanism, int]]) -> list[tuple[Mechanism, int]]:
    out = []
    for entry in phases:
        try:
            mechanism, count = entry
        except (TypeError, ValueError):
            raise InvalidMechanismError(
                f"phase={entry!r} is not allowed; expected a (mechanism, steps) pair"
            ) from None
        if not hasattr(mechanism, "kind") or not hasattr(mechanism, "to_dict"):
            raise InvalidMechanismError(
                f"mechanism={mechanism!r} is not allowed; expected a userdp.accounting mechanism"
            )
        out.append((mechanism, _check_steps(count)))
    # Composition is commutative: merge repeated mechanisms (e.g. one ledger record per step)
    # into one entry each, in order of first appearance.
    counts: dict[Mechanism, int] = {}
    for mechanism, count in out:
        if count > 0:
            counts[mechanism] = counts.get(mechanism, 0) + count
    return list(counts.items())


def _check_steps(steps: Any) -> int:
    return non_negative_int("steps", steps, InvalidMechanismError)


def _check_delta(delta: Any) -> float:
    return probability("delta", delta, InvalidMechanismError, upper_open=True)
