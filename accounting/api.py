"""ε for a mechanism run for some steps, and for a composition of phases: the accounting entry point.

Dispatch (all add-or-remove-one-user adjacency, pessimistic estimates):

* ``uls``  — dp_accounting PLD of ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``, exactly as
  ``PLDAccountant`` builds and composes it (bit for bit; :mod:`userdp.accounting.pld_ops` only
  computes the truncation bounds and the final ε(δ) scan faster, with the same results).
* ``els``  — PLD of ``MixtureOfGaussiansDpEvent(σ, 0..G, Binom(G, p))`` built by
  :mod:`userdp.accounting.fast_pld` (the same construction as dp_accounting, vectorized);
  ``els_backend="dp_accounting"`` uses the library's own (slow) builder instead.
* ``group-privacy`` — COMPARISON ONLY: example-level Poisson-Gaussian PLD, then the black-box
  group-privacy conversion (Vadhan 2017), minimized over the example-level ε₀.
* ``balls-in-bins`` — Monte Carlo, :mod:`userdp.accounting.balls_in_bins`.
* ``randomized-clipping`` — envelope accountant, :mod:`userdp.accounting.randomized_clipping`.
* ``user-wise-filter`` — AboveThreshold ε plus a q = 1 Gaussian PLD,
  :mod:`userdp.accounting.user_filter`.

uls, els and randomized-clipping steps compose with each other across phases as PLDs; group
privacy, balls-in-bins and user-wise-filter are whole-run accountants and cannot be composed with
anything else.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from userdp.accounting import fast_pld, pld_ops
from userdp.accounting.mechanisms import (
    DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    BallsInBinsMechanism,
    BandedPoissonMechanism,
    ElsMechanism,
    GroupPrivacyMechanism,
    InvalidMechanismError,
    Mechanism,
    RandomizedClippingMechanism,
    UlsMechanism,
    UserWiseFilterMechanism,
    binomial_sensitivities,
)
from userdp.accounting.validation import (
    non_negative_float,
    non_negative_int,
    positive_float,
    probability,
)

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
ACCOUNTANT_VERSION = "1"
ELS_BACKENDS = ("fast", "dp_accounting")
PLD_KINDS = (UlsMechanism.kind, ElsMechanism.kind)
# Kinds whose per-step PLDs compose with each other across phases.
COMPOSABLE_KINDS = (*PLD_KINDS, RandomizedClippingMechanism.kind)


class AccountantUnavailableError(ValueError):
    """The accountant module for a mechanism kind is missing from this install."""


class NotComposableError(ValueError):
    """The phases mix mechanisms whose accountants cannot be composed (e.g. Monte Carlo with PLD)."""


def epsilon(
    mechanism: Mechanism,
    steps: int,
    delta: float,
    *,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    els_backend: str = "fast",
    **monte_carlo: Any,
) -> float:
    """ε(δ) after ``steps`` steps of ``mechanism`` (user level, add/remove one user).

    ``monte_carlo`` keyword arguments (``num_samples``, ``seed``) go to the balls-in-bins
    accountant only.
    """
    return compose_epsilon(
        [(mechanism, steps)],
        delta,
        value_discretization_interval=value_discretization_interval,
        els_backend=els_backend,
        **monte_carlo,
    )


def compose_epsilon(
    phases: Sequence[tuple[Mechanism, int]],
    delta: float,
    *,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    els_backend: str = "fast",
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
    rc_steps = sum(c for m, c in phases if isinstance(m, RandomizedClippingMechanism))
    pld = privacy_loss_distribution(
        phases,
        value_discretization_interval=value_discretization_interval,
        els_backend=els_backend,
        # As randomized_clipping.epsilon does: the envelope's cut-off tail (charged as infinite
        # loss) gets at most 0.1·δ over all of its steps.
        rc_tail_mass=0.1 * delta / max(rc_steps, 1),
    )
    return pld_ops.epsilon_for_delta(pld, delta)


def delta(
    mechanism: Mechanism,
    steps: int,
    epsilon: float,
    *,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    els_backend: str = "fast",
) -> float:
    """δ(ε) after ``steps`` steps of a PLD mechanism (uls or els)."""
    return compose_delta(
        [(mechanism, steps)],
        epsilon,
        value_discretization_interval=value_discretization_interval,
        els_backend=els_backend,
    )


def compose_delta(
    phases: Sequence[tuple[Mechanism, int]],
    epsilon: float,
    *,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    els_backend: str = "fast",
) -> float:
    """δ(ε) of the composition of PLD phases (uls, els)."""
    if epsilon != math.inf:  # δ(∞) = 0 is a valid query
        non_negative_float("epsilon", epsilon, InvalidMechanismError)
    pld = privacy_loss_distribution(
        phases, value_discretization_interval=value_discretization_interval, els_backend=els_backend
    )
    return float(pld.get_delta_for_epsilon(float(epsilon)))


def privacy_loss_distribution(
    phases: Sequence[tuple[Mechanism, int]],
    *,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    els_backend: str = "fast",
    rc_tail_mass: float = 1e-12,
) -> pld_lib.PrivacyLossDistribution:
    """The composed dp_accounting PLD of ``phases`` (uls, els, randomized-clipping), in
    PLDAccountant's order. ``rc_tail_mass``: the randomized-clipping envelope mass above its
    grid, per step, charged as infinite privacy loss (valid for any value; smaller is tighter
    only while it stays well below δ/steps)."""
    phases = _normalize_phases(phases)
    if els_backend not in ELS_BACKENDS:
        raise InvalidMechanismError(
            f"els_backend={els_backend!r} is not allowed; expected one of {ELS_BACKENDS}"
        )
    _check_vdi(value_discretization_interval)
    composed = pld_lib.identity(value_discretization_interval)
    for mechanism, count in phases:
        if mechanism.kind not in COMPOSABLE_KINDS:
            raise NotComposableError(
                f"mechanism kind {mechanism.kind!r} has no PLD; only {COMPOSABLE_KINDS} compose"
            )
        if isinstance(mechanism, RandomizedClippingMechanism):
            step = _randomized_clipping_pld(mechanism, value_discretization_interval, rc_tail_mass)
            composed = composed.compose(step.self_compose(count))
            continue
        step = single_step_pld(mechanism, value_discretization_interval, els_backend)
        if isinstance(mechanism, ElsMechanism) and els_backend == "fast":
            composed = composed.compose(pld_ops.self_compose(step, count))
        elif isinstance(mechanism, UlsMechanism):
            # PLDAccountant's arithmetic bit for bit, with faster truncation bounds.
            composed = composed.compose(pld_ops.self_compose(step, count, bit_exact=True))
        else:
            composed = composed.compose(step.self_compose(count))
    return composed


@functools.lru_cache(maxsize=4)  # PLDs can be tens of MB; max_steps reuses one
def single_step_pld(
    mechanism: Mechanism, value_discretization_interval: float, els_backend: str = "fast"
) -> pld_lib.PrivacyLossDistribution:
    """The pessimistic PLD of ONE step of a uls/els mechanism (cached; PLDs are immutable)."""
    if isinstance(mechanism, UlsMechanism):
        # Exactly PLDAccountant's construction for PoissonSampledDpEvent(GaussianDpEvent).
        return pld_lib.from_gaussian_mechanism(
            standard_deviation=mechanism.noise_multiplier,
            value_discretization_interval=value_discretization_interval,
            sampling_prob=mechanism.sampling_prob,
        )
    if isinstance(mechanism, ElsMechanism):
        sensitivities, probs = binomial_sensitivities(mechanism.group_size, mechanism.sampling_prob)
        if els_backend == "dp_accounting":
            return pld_lib.from_mixture_gaussian_mechanism(
                standard_deviation=mechanism.noise_multiplier,
                sensitivities=sensitivities,
                sampling_probs=probs,
                value_discretization_interval=value_discretization_interval,
            )
        return fast_pld.mixture_gaussian_pld(
            mechanism.noise_multiplier,
            sensitivities,
            probs,
            value_discretization_interval=value_discretization_interval,
        )
    raise NotComposableError(f"mechanism kind {mechanism.kind!r} has no single-step PLD")


@functools.lru_cache(maxsize=2)
def _randomized_clipping_pld(
    mechanism: RandomizedClippingMechanism, value_discretization_interval: float, tail_mass: float
) -> pld_lib.PrivacyLossDistribution:
    randomized_clipping = _accountant_module("randomized_clipping", mechanism.kind)
    # Hutchinson and Hutch++ share the Z_cons envelope with k = the tail probes (see the module)
    randomized_clipping._check_estimator(mechanism.estimator)
    return randomized_clipping.privacy_loss_distribution(
        mechanism.noise_multiplier,
        mechanism.sampling_prob,
        mechanism.probes,
        tail_mass=tail_mass,
        value_discretization_interval=value_discretization_interval,
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
        return group_privacy_epsilon(mechanism, steps, delta, value_discretization_interval)
    if isinstance(mechanism, BallsInBinsMechanism):
        balls_in_bins = _accountant_module("balls_in_bins", mechanism.kind)
        epochs = balls_in_bins_epochs(mechanism, steps)
        return float(
            balls_in_bins.epsilon(
                mechanism.noise_multiplier,
                mechanism.bins,
                epochs,
                delta,
                bin_semantics=mechanism.bin_semantics,
                correlation=mechanism.correlation,
                **monte_carlo,
            )
        )
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
    """Import ``userdp.accounting.<name>`` lazily (it may be heavier, or not installed yet)."""
    module = f"userdp.accounting.{name}"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        raise AccountantUnavailableError(
            f"mechanism kind {kind!r} needs {module}, which is not available in this install"
        ) from None


def balls_in_bins_epochs(mechanism: BallsInBinsMechanism, steps: int) -> int:
    """Epochs whose full run covers ``steps`` releases (a prefix of a run is post-processing)."""
    total = mechanism.bins * mechanism.epochs
    if steps > total:
        raise InvalidMechanismError(
            f"steps={steps} is out of range for balls-in-bins with bins={mechanism.bins}, "
            f"epochs={mechanism.epochs}; expected 0 <= steps <= {total}"
        )
    return max(1, math.ceil(steps / mechanism.bins))


def group_privacy_epsilon(
    mechanism: GroupPrivacyMechanism,
    steps: int,
    delta: float,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
) -> float:
    """COMPARISON ONLY. User-level ε from example-level DP-SGD by black-box group privacy.

    Example level: T-fold Poisson-subsampled Gaussian (q = p, σ), PLD → δ₀(ε₀). A group of G
    examples gets (G·ε₀, δ₀(ε₀)·(e^{Gε₀} − 1)/(e^{ε₀} − 1)) (Vadhan 2017, Lemma 2.2). Returns
    the smallest G·ε₀ over a grid of ε₀ whose group δ is ≤ ``delta``, or ∞ if none is ("the
    black-box accountant diverged", Fig. 1 of "Fine-Tuning Large Language Models with User-Level Differential Privacy"). Each grid point is itself a
    valid guarantee, so the grid only costs tightness.
    """
    example = UlsMechanism(mechanism.noise_multiplier, mechanism.sampling_prob)
    pld = privacy_loss_distribution(
        [(example, steps)], value_discretization_interval=value_discretization_interval
    )
    group = mechanism.group_size
    eps_low = float(pld.get_epsilon_for_delta(delta))  # group factor ≥ 1, so ε₀ ≥ this
    if group == 1 or not math.isfinite(eps_low):
        return eps_low
    span = max(eps_low, 1.0)
    eps0 = np.unique(
        np.concatenate(
            [
                eps_low + np.linspace(0.0, span, 4001),
                eps_low + np.geomspace(1e-6, 50.0 * span, 2001),
            ]
        )
    )
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        delta0 = np.asarray(pld.get_delta_for_epsilon(eps0), dtype=float)
        log_factor = (
            group * eps0 + np.log1p(-np.exp(-group * eps0)) - eps0 - np.log1p(-np.exp(-eps0))
        )
        log_group_delta = np.log(delta0) + log_factor
    feasible = np.nan_to_num(log_group_delta, nan=np.inf) <= math.log(delta)
    if not feasible.any():
        return math.inf
    return float(group * eps0[feasible].min())


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


def _check_vdi(vdi: Any) -> None:
    if positive_float("value_discretization_interval", vdi, InvalidMechanismError) > 0.1:
        raise InvalidMechanismError(
            f"value_discretization_interval={vdi!r} is out of range; expected a float in (0, 0.1]"
        )
