"""The accountant of user-wise DP-SGD with filter, with the noise scale and sensitivities it rests on.

The mechanism is Asi & Liu's ("User-level Differentially Private Stochastic Convex Optimization:
Efficient Algorithms with Optimal Rates", AISTATS 2024) as Algorithm 3 of "Mind the Privacy Unit!
User-Level Differential Privacy for Language Model Fine-Tuning" states it: every user in every
step, AboveThreshold on a concentration score, a randomized filter, Gaussian noise scaled by the
concentration radius τ instead of the clip norm. A run targeting (ε, δ) over T steps splits its
budget in two (Algorithm 3, line 2):

* **ε/2 to AboveThreshold** over the T concentration scores: pure ε/2-DP for the whole sequence of
  answers up to and including the first "below", which halts the run; charged once, however
  many "above" answers come first.
* **ε/2 at δ/2 to T Gaussian steps with q = 1**: σ = PrivAccounting(ε/2, δ/2, N, N, T), the
  T-fold composition of the Gaussian mechanism with noise multiplier σ (dp_accounting's PLD,
  through :func:`userdp.accounting.api.privacy_loss_distribution`).
* **δ/2 to the filter**: the filtered mean ĝ has sensitivity at most
  Δ = √(8 log(e^ε T/δ))·τ/N except with that probability over the run, and the noise is
  N(0, (σΔ)² I) (Algorithm 3, line 14).

So after t ≤ T released steps, ε(δ') = ε/2 + ε_Gauss(σ, t; δ' − δ/2) (∞ when δ' ≤ δ/2). This
module reproduces that statement of the analysis; it does not re-derive Asi & Liu's stability
bound for the filter.

**Sensitivity of the AboveThreshold query** (:data:`CONCENTRATION_SCORE_SENSITIVITY`). Let
S(D) = Σ_{i,i'} 1(‖g_i − g_i'‖ ≤ τ) over ordered pairs of D's N users, the diagonal included, so
N ≤ S ≤ N². AboveThreshold compares the score s = S/N with 4N/5, i.e. the query
q(D) = S/N − 4N/5 with the fixed threshold 0 (N moves with D, so it belongs to the query).
Adding one user (N → N + 1) adds its row and column: S' = S + a with 1 ≤ a ≤ 2N + 1, and
q(D') − q(D) = (N·a − S)/(N(N + 1)) − 4/5. The first term is at most
(N(2N + 1) − N)/(N(N + 1)) = 2N/(N + 1) < 2 and at least (N − N²)/(N(N + 1)) > −1, so
−9/5 < q(D') − q(D) < 6/5; removing a user is the same pair read backwards. Replacing one user
(N fixed) moves S by at most 2(N − 1), so s by less than 2. Δ = 2 bounds every case.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from userdp.accounting import api, pld_ops
from userdp.accounting.mechanisms import (
    DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    InvalidMechanismError,
    UlsMechanism,
    UserWiseFilterMechanism,
)
from userdp.accounting.validation import positive_float

__all__ = [
    "CONCENTRATION_SCORE_SENSITIVITY",
    "SCORE_THRESHOLD_FRACTION",
    "BudgetSplit",
    "epsilon",
    "filter_noise_std",
    "filter_sensitivity",
    "split_budget",
]

CONCENTRATION_SCORE_SENSITIVITY = 2.0
"""Δ of the query s − 4N/5 under adding or removing one user (module docstring)."""
SCORE_THRESHOLD_FRACTION = 4.0 / 5.0
"""AboveThreshold's threshold on the score s, as a fraction of N (Algorithm 3, line 9)."""


@dataclass(frozen=True)
class BudgetSplit:
    """How a (ε, δ) target is spent (module docstring): AboveThreshold, Gaussian steps, filter."""

    above_threshold_epsilon: float
    gaussian_epsilon: float
    gaussian_delta: float
    filter_delta: float


def split_budget(epsilon: float, delta: float) -> BudgetSplit:
    """Algorithm 3's split of (ε, δ): ε/2 to AboveThreshold, (ε/2, δ/2) to the Gaussian steps,
    δ/2 to the filter."""
    positive_float("epsilon", epsilon, InvalidMechanismError)
    if not 0.0 < delta < 1.0:
        raise InvalidMechanismError(f"delta={delta!r} is out of range; expected a float in (0, 1)")
    return BudgetSplit(epsilon / 2.0, epsilon / 2.0, delta / 2.0, delta / 2.0)


def filter_sensitivity(
    concentration_threshold: float, num_users: int, epsilon: float, delta: float, steps: int
) -> float:
    """Δ = √(8 log(e^ε T/δ))·τ/N: the filtered mean's sensitivity bound for a run of T steps at
    (ε, δ) over N users (Algorithm 3, line 14, without σ)."""
    positive_float("concentration_threshold", concentration_threshold, InvalidMechanismError)
    positive_float("epsilon", epsilon, InvalidMechanismError)
    if num_users < 1 or steps < 1 or not 0.0 < delta < 1.0:
        raise InvalidMechanismError(
            f"num_users={num_users!r}, steps={steps!r}, delta={delta!r}: expected N >= 1, "
            "T >= 1 and delta in (0, 1)"
        )
    log_term = epsilon + math.log(steps) - math.log(delta)  # log(e^ε T/δ)
    return math.sqrt(8.0 * log_term) * concentration_threshold / num_users


def filter_noise_std(
    noise_multiplier: float,
    concentration_threshold: float,
    num_users: int,
    epsilon: float,
    delta: float,
    steps: int,
) -> float:
    """The std of the noise on the filtered mean: √(8τ² log(e^ε T/δ))·σ/N (Algorithm 3)."""
    positive_float("noise_multiplier", noise_multiplier, InvalidMechanismError)
    return noise_multiplier * filter_sensitivity(
        concentration_threshold, num_users, epsilon, delta, steps
    )


def epsilon(
    mechanism: UserWiseFilterMechanism,
    steps: int,
    delta: float,
    *,
    value_discretization_interval: float = DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
) -> float:
    """ε(δ) after ``steps`` ≤ horizon steps: the AboveThreshold ε plus the ε of ``steps``
    Gaussian(σ) steps with q = 1 at δ − filter_delta; ∞ when δ ≤ filter_delta."""
    if steps > mechanism.horizon:
        raise InvalidMechanismError(
            f"steps={steps} is out of range for user-wise-filter with horizon="
            f"{mechanism.horizon}: its filter bound covers at most that many steps"
        )
    if steps == 0:
        return 0.0
    gaussian_delta = delta - mechanism.filter_delta
    if gaussian_delta <= 0.0:
        return math.inf
    gaussian = UlsMechanism(mechanism.noise_multiplier, 1.0)
    pld = api.privacy_loss_distribution(
        [(gaussian, steps)], value_discretization_interval=value_discretization_interval
    )
    return mechanism.above_threshold_epsilon + pld_ops.epsilon_for_delta(pld, gaussian_delta)
