"""The PLD accountants: uls, els and randomized-clipping steps composed as dp_accounting privacy
loss distributions, and group privacy (comparison only) on top of one.

:mod:`userdp.accounting.api` dispatches here on first use: this module loads dp_accounting (and
through it scipy.signal and scipy.stats, about 1.5 CPU-s of imports on a 2-core machine), which
the whole-run Monte Carlo accountants (balls-in-bins) never need. Callers go through ``api``,
which validates and merges the phases first.

* ``uls``  — PLD of ``PoissonSampledDpEvent(q, GaussianDpEvent(σ))``: the mixture
  (1 − q)·N(0, σ²) + q·N(1, σ²) against N(0, σ²), built by :mod:`userdp.accounting.fast_pld`.
* ``els``  — PLD of ``MixtureOfGaussiansDpEvent(σ, 0..G, Binom(G, p))``, the same builder
  (ULS is its G = 1 case).

:mod:`userdp.accounting.fast_pld` is dp_accounting's connect-the-dots construction, vectorized
(ε agrees with ``PLDAccountant`` to 1e-8 relative; tests/accounting/test_fast_pld.py), and
:func:`userdp.accounting.pld_ops.self_compose` its FFT composition with real FFTs.
``pld_backend="dp_accounting"`` builds and composes with the library's own (slow) code instead,
``PLDAccountant``'s result bit for bit.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from userdp.accounting import fast_pld, pld_ops, randomized_clipping
from userdp.accounting.errors import NotComposableError
from userdp.accounting.mechanisms import (
    COMPOSABLE_KINDS,
    DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    ElsMechanism,
    GroupPrivacyMechanism,
    InvalidMechanismError,
    Mechanism,
    RandomizedClippingMechanism,
    UlsMechanism,
    binomial_sensitivities,
)
from userdp.accounting.validation import positive_float

__all__ = [
    "PLD_BACKENDS",
    "epsilon",
    "group_privacy_epsilon",
    "privacy_loss_distribution",
    "single_step_pld",
]

PLD_BACKENDS = ("fast", "dp_accounting")


def epsilon(
    phases: Sequence[tuple[Mechanism, int]],
    delta: float,
    value_discretization_interval: float,
    pld_backend: str,
) -> float:
    """ε(δ) of composed uls, els and randomized-clipping ``phases`` (validated, merged)."""
    rc_steps = sum(c for m, c in phases if isinstance(m, RandomizedClippingMechanism))
    pld = privacy_loss_distribution(
        phases,
        value_discretization_interval=value_discretization_interval,
        pld_backend=pld_backend,
        # As randomized_clipping.epsilon does: the envelope's cut-off tail (charged as infinite
        # loss) gets at most 0.1·δ over all of its steps.
        rc_tail_mass=0.1 * delta / max(rc_steps, 1),
    )
    return pld_ops.epsilon_for_delta(pld, delta)


def privacy_loss_distribution(
    phases: Sequence[tuple[Mechanism, int]],
    *,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    pld_backend: str = "fast",
    rc_tail_mass: float = 1e-12,
) -> pld_lib.PrivacyLossDistribution:
    """The composed dp_accounting PLD of ``phases`` (uls, els, randomized-clipping), in
    PLDAccountant's order. ``rc_tail_mass``: the randomized-clipping envelope mass above its
    grid, per step, charged as infinite privacy loss (valid for any value; smaller is tighter
    only while it stays well below δ/steps)."""
    if pld_backend not in PLD_BACKENDS:
        raise InvalidMechanismError(
            f"pld_backend={pld_backend!r} is not allowed; expected one of {PLD_BACKENDS}"
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
        step = single_step_pld(mechanism, value_discretization_interval, pld_backend)
        if pld_backend == "fast":
            composed = composed.compose(pld_ops.self_compose(step, count))
        else:
            composed = composed.compose(step.self_compose(count))
    return composed


@functools.lru_cache(maxsize=4)  # PLDs can be tens of MB; max_steps reuses one
def single_step_pld(
    mechanism: Mechanism, value_discretization_interval: float, pld_backend: str = "fast"
) -> pld_lib.PrivacyLossDistribution:
    """The pessimistic PLD of ONE step of a uls/els mechanism (cached; PLDs are immutable)."""
    if isinstance(mechanism, UlsMechanism) and pld_backend == "dp_accounting":
        # PLDAccountant's construction for PoissonSampledDpEvent(GaussianDpEvent)
        return pld_lib.from_gaussian_mechanism(
            standard_deviation=mechanism.noise_multiplier,
            value_discretization_interval=value_discretization_interval,
            sampling_prob=mechanism.sampling_prob,
        )
    if isinstance(mechanism, UlsMechanism | ElsMechanism):
        # A ULS step is the G = 1 mixture: sensitivity 1 with probability q, else 0.
        group = mechanism.group_size if isinstance(mechanism, ElsMechanism) else 1
        if pld_backend == "fast" and mechanism.sampling_prob == 1.0:
            # every unit in every step: the Gaussian mechanism of sensitivity G itself (the
            # library's Gaussian PLD; its mixture code fails at some σ for a one-point mixture)
            return pld_lib.from_gaussian_mechanism(
                standard_deviation=mechanism.noise_multiplier,
                sensitivity=float(group),
                value_discretization_interval=value_discretization_interval,
            )
        sensitivities, probs = binomial_sensitivities(group, mechanism.sampling_prob)
        if pld_backend == "dp_accounting":
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
    # Hutchinson and Hutch++ share the Z_cons envelope with k = the tail probes (see the module)
    randomized_clipping._check_estimator(mechanism.estimator)
    return randomized_clipping.privacy_loss_distribution(
        mechanism.noise_multiplier,
        mechanism.sampling_prob,
        mechanism.probes,
        tail_mass=tail_mass,
        value_discretization_interval=value_discretization_interval,
    )


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


def _check_vdi(vdi: object) -> None:
    if positive_float("value_discretization_interval", vdi, InvalidMechanismError) > 0.1:
        raise InvalidMechanismError(
            f"value_discretization_interval={vdi!r} is out of range; expected a float in (0, 0.1]"
        )
