"""Fast, exact-equivalent PLD of the mixture-of-Gaussians (ELS) mechanism.

dp_accounting builds the pessimistic connect-the-dots PLD of ``MixtureOfGaussiansDpEvent``
(Doroshenko et al. 2022, "Connect the Dots", Algorithm 1) from the hockey-stick curve
δ(ε) of ONE step, evaluated on the grid ε_i = i·Δ (Δ = value_discretization_interval):

    δ(ε) = μ_up(X ≤ x*(ε)) − e^ε μ_low(X ≤ x*(ε)),   x*(ε) = the point where loss(x*) = ε.

Its slow part is x*(ε): the mixture loss has no closed-form inverse, and the library inverts it
with a recursive Python bisection over ~10⁵–10⁶ grid values. This module computes the SAME grid,
tails and δ values, but inverts the loss with vectorized Newton iterations: the loss is ±h(x)
with h = log-sum-exp of affine functions of x, convex and monotone, so Newton started where
h ≥ goal converges monotonically. A coarse subset of the grid is solved that way; the rest is
cubic-Hermite interpolated from it and polished by one Newton step. The remaining pieces are
dp_accounting's own code — ``MixtureGaussianPrivacyLoss`` (truncation tails, connect-dots
bounds), ``create_pmf_pessimistic_connect_dots_fixed_gap``, ``PrivacyLossDistribution`` and
``get_epsilon_for_delta`` — except the CDFs (same formulas via scipy.special) and
:func:`userdp.accounting.pld_ops.self_compose` (the library's FFT self-composition with the same
truncation bounds and FFT length, using real FFTs). The result is a ``PrivacyLossDistribution`` that composes with
any other dp_accounting PLD.

Why the result is still a valid (pessimistic) upper bound: for any threshold x, the set
{X ≤ x} gives μ_up(S) − e^ε μ_low(S) ≤ H_{e^ε}(μ_up, μ_low), with equality at the exact x*.
dp_accounting evaluates δ at x* rounded to a multiple of 1e-6; we at x* within ~1e-9 relative
(a Newton step below 1e-7 leaves an O(step²) error), and the δ error is second order in the x
error, so each δ_i is the exact hockey-stick value up to float rounding (in tests, never below
the library's by more than 1e-13), and the connect-the-dots PMF built from exact δ_i dominates
the true PLD (Doroshenko et al., Thm. 3.2). Both adjacency directions (REMOVE: mixture vs N(0,σ²); ADD: N(0,σ²) vs mixture)
are built, as dp_accounting does, so ε(δ) covers the symmetric divergence.
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from dp_accounting.pld import privacy_loss_mechanism as plm
from scipy import interpolate, special
from userdp.accounting import dp_accounting_adapter as adapter

__all__ = ["mixture_gaussian_deltas", "mixture_gaussian_pld", "non_increasing_cover"]

_CHUNK_ELEMENTS = 1 << 24
_ADD = plm.AdjacencyType.ADD
_REMOVE = plm.AdjacencyType.REMOVE


def mixture_gaussian_pld(
    standard_deviation: float,
    sensitivities: np.ndarray | list[float],
    sampling_probs: np.ndarray | list[float],
    value_discretization_interval: float = 1e-4,
    log_mass_truncation_bound: float = -50.0,
) -> pld_lib.PrivacyLossDistribution:
    """Drop-in for ``privacy_loss_distribution.from_mixture_gaussian_mechanism`` (pessimistic,
    connect-the-dots), one step, both adjacency directions."""
    pmfs = []
    for adjacency in (_REMOVE, _ADD):
        loss = plm.MixtureGaussianPrivacyLoss(
            standard_deviation,
            sensitivities,
            sampling_probs,
            pessimistic_estimate=True,
            log_mass_truncation_bound=log_mass_truncation_bound,
            adjacency_type=adjacency,
        )
        bounds = loss.connect_dots_bounds()
        lower = math.floor(bounds.epsilon_lower / value_discretization_interval)
        upper = math.ceil(bounds.epsilon_upper / value_discretization_interval)
        epsilons = np.arange(lower, upper + 1) * value_discretization_interval
        deltas = mixture_gaussian_deltas(loss, epsilons)
        pmfs.append(
            pld_pmf.create_pmf_pessimistic_connect_dots_fixed_gap(
                value_discretization_interval, lower, upper, deltas
            )
        )
    return pld_lib.PrivacyLossDistribution(pmfs[0], pmfs[1])


def mixture_gaussian_deltas(
    loss: plm.MixtureGaussianPrivacyLoss, epsilons: np.ndarray
) -> np.ndarray:
    """Vectorized ``loss.get_delta_for_epsilon(epsilons)`` for non-decreasing ``epsilons``.

    Same case split as dp_accounting (losses beyond the mixture's asymptote map to x = ±∞), but
    x*(ε) is found by Newton instead of bisection, and the final non-increasing repair is a
    reversed running maximum instead of a Python loop.
    """
    epsilons = np.asarray(epsilons, dtype=np.float64)
    if np.any(np.diff(epsilons) < 0):
        raise ValueError("epsilons must be non-decreasing")
    q = float(np.clip(loss.sampling_probs[loss.sensitivities > 0].sum(), 0.0, 1.0))
    deltas = np.zeros_like(epsilons)
    if q == 1.0:
        inverse = np.ones_like(epsilons, dtype=bool)
    elif loss.adjacency_type == _ADD:
        inverse = epsilons < -math.log1p(-q)
    else:
        inverse = epsilons > math.log1p(-q)
        deltas[~inverse] = -np.expm1(epsilons[~inverse])
    targets = epsilons[inverse]
    values = np.empty_like(targets)
    # Chunks bound the n×K work buffers (about 8·_CHUNK_ELEMENTS bytes each).
    chunk = max(1024, _CHUNK_ELEMENTS // max(1, loss.sensitivities.size))
    for start in range(0, targets.size, chunk):
        part = targets[start : start + chunk]
        x = _inverse_losses(loss, part, q)
        upper_cdf, lower_log_cdf = _cdfs(loss, x)
        with np.errstate(over="ignore", invalid="ignore"):
            values[start : start + chunk] = upper_cdf - np.exp(part + lower_log_cdf)
    deltas[inverse] = values
    return non_increasing_cover(np.clip(deltas, 0.0, 1.0))


def non_increasing_cover(deltas: np.ndarray) -> np.ndarray:
    """The smallest non-increasing sequence ≥ ``deltas`` (a reversed running maximum). δ(ε) is
    non-increasing; where rounding makes computed values rise, the repair RAISES the earlier
    ones, so each stays an upper bound (lowering the later ones would not)."""
    return np.maximum.accumulate(deltas[::-1])[::-1]


def _cdfs(loss: plm.MixtureGaussianPrivacyLoss, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``loss.mu_upper_cdf(x)`` and ``loss.mu_lower_log_cdf(x)`` with scipy.special directly.

    REMOVE: μ_up = Σ_k b_k N(−s_k, σ²), μ_low = N(0, σ²). ADD: μ_up = N(0, σ²),
    μ_low = Σ_k b_k N(s_k, σ²). Same formulas as dp_accounting, without scipy.stats overhead.
    """
    sigma, _, _ = adapter.mixture_loss_constants(loss)
    probs, sens = loss.sampling_probs, loss.sensitivities
    if loss.adjacency_type == _REMOVE:
        upper = special.ndtr((x[:, None] + sens[None, :]) / sigma) @ probs
        lower_log = special.log_ndtr(x / sigma)
    else:
        upper = special.ndtr(x / sigma)
        lower_log = _logsumexp_rows(special.log_ndtr((x[:, None] - sens[None, :]) / sigma), probs)
    return upper, lower_log


def _logsumexp_rows(z: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """log Σ_k w_k e^{z_ik} per row (w ≥ 0), overwriting ``z``: scipy's ``logsumexp(z, axis=1,
    b=w)`` without its per-call array-API overhead. Rows that are all −∞ give −∞."""
    peak = z.max(axis=1)
    shift = np.where(np.isfinite(peak), peak, 0.0)
    z -= shift[:, None]
    np.exp(z, out=z)
    with np.errstate(divide="ignore"):
        return np.log(z @ weights) + shift


def _inverse_losses(
    loss: plm.MixtureGaussianPrivacyLoss, targets: np.ndarray, q: float
) -> np.ndarray:
    """x*(ℓ) with loss(x*) = ℓ for each target ℓ (loss is decreasing in x).

    REMOVE: loss(x) = logsumexp_k(a_k − s_k x/σ²) is convex and decreasing; Newton from a point
    left of the root stays left and converges monotonically. ADD: loss(x) = −logsumexp_k(a_k +
    s_k x/σ²); solve logsumexp(...) = −ℓ (convex, increasing) from the right.
    """
    out = np.empty_like(targets)
    if targets.size == 0:
        return out
    _, variance, consts = adapter.mixture_loss_constants(loss)
    sens = loss.sensitivities
    log_1m_q = math.log1p(-q) if q < 1.0 else -math.inf
    if loss.adjacency_type == _ADD:
        finite = ~np.isclose(targets, -log_1m_q)
        out[~finite] = -np.inf
        slope = sens / variance  # h(x) = logsumexp(consts + slope·x), increasing; solve h = −ℓ
        goal = -targets[finite]
    else:
        finite = ~np.isclose(targets, log_1m_q)
        out[~finite] = np.inf
        slope = -sens / variance  # h(x) = logsumexp(consts + slope·x), decreasing; solve h = ℓ
        goal = targets[finite]
    if goal.size:
        out[finite] = _newton_logsumexp(consts, slope, goal, increasing=loss.adjacency_type == _ADD)
    return out


def _newton_logsumexp(
    consts: np.ndarray, slope: np.ndarray, goal: np.ndarray, *, increasing: bool
) -> np.ndarray:
    """Solve h(x) = logsumexp_k(consts_k + slope_k·x) = goal for x, vectorized over goal.

    h is convex. Newton started where h ≥ goal (right of the root when h increases, left when it
    decreases) stays on that side, because the tangent lies below h, and converges monotonically.
    For a long sorted grid of goals, a coarse subset is solved first and the rest is
    interpolated from it and polished (see _refine_from_coarse).
    """
    order = np.argsort(goal, kind="stable")
    sorted_goal = goal[order]
    n = sorted_goal.size
    stride = 128
    if n <= 4 * stride:
        x0 = _component_start(consts, slope, sorted_goal, increasing)
        x = _newton(consts, slope, sorted_goal, x0, increasing)
    else:
        coarse_idx = np.unique(np.append(np.arange(0, n, stride), n - 1))
        coarse_goal = sorted_goal[coarse_idx]
        coarse_x = _newton(
            consts,
            slope,
            coarse_goal,
            _component_start(consts, slope, coarse_goal, increasing),
            increasing,
        )
        x = _refine_from_coarse(consts, slope, sorted_goal, coarse_goal, coarse_x, increasing)
    out = np.empty_like(x)
    out[order] = x
    return out


def _refine_from_coarse(
    consts: np.ndarray,
    slope: np.ndarray,
    goal: np.ndarray,
    coarse_goal: np.ndarray,
    coarse_x: np.ndarray,
    increasing: bool,
) -> np.ndarray:
    """Roots for all (sorted) goals from the coarse roots: cubic Hermite interpolation of
    x*(goal) (slopes 1/h'(x*)), then ONE Newton step. Where that step was not already tiny
    (|Δx| > 1e-7, so the remaining O(Δx²) error could matter), the safeguarded Newton takes over.
    """
    _, coarse_deriv = _h_and_slope(consts, slope, coarse_x)
    with np.errstate(divide="ignore", invalid="ignore"):
        dx_dgoal = 1.0 / coarse_deriv
    secant = np.gradient(coarse_x, coarse_goal)
    dx_dgoal = np.where(np.isfinite(dx_dgoal), dx_dgoal, secant)
    x = interpolate.CubicHermiteSpline(coarse_goal, coarse_x, dx_dgoal)(goal)
    value, deriv = _h_and_slope(consts, slope, x)
    with np.errstate(divide="ignore", invalid="ignore"):
        step = (value - goal) / deriv
    x_new = x - step
    settled = np.isfinite(x_new) & (np.abs(step) <= 1e-7 * np.maximum(1.0, np.abs(x_new)))
    x[settled] = x_new[settled]
    rest = np.flatnonzero(~settled)
    if rest.size:
        x[rest] = _newton(consts, slope, goal[rest], x[rest], increasing)
    return x


def _component_start(
    consts: np.ndarray, slope: np.ndarray, goal: np.ndarray, increasing: bool
) -> np.ndarray:
    """A point with h ≥ goal: h ≥ consts_k + slope_k·x for each k, so where one component alone
    reaches the goal is on the right side; take the one nearest the root."""
    moving = slope != 0.0
    starts = (goal[:, None] - consts[None, moving]) / slope[None, moving]
    return starts.min(axis=1) if increasing else starts.max(axis=1)


def _h_and_slope(
    consts: np.ndarray, slope: np.ndarray, x: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """h(x) = logsumexp_k(consts_k + slope_k·x) and h'(x), row-wise, with one n×K buffer."""
    z = np.multiply.outer(x, slope)
    z += consts
    peak = z.max(axis=1)
    z -= peak[:, None]
    np.exp(z, out=z)
    total = z.sum(axis=1)
    return peak + np.log(total), (z @ slope) / total


def _newton(
    consts: np.ndarray, slope: np.ndarray, goal: np.ndarray, x: np.ndarray, increasing: bool
) -> np.ndarray:
    """Newton for h(x) = goal from start ``x``: one free step (from either side of the root it
    lands where h ≥ goal, by convexity), a guard walk outward for float rounding, then
    monotone steps until x stops moving."""
    direction = 1.0 if increasing else -1.0
    value, deriv = _h_and_slope(consts, slope, x)
    with np.errstate(divide="ignore", invalid="ignore"):
        step_ok = (value < goal) & (deriv * direction > 0)
    if step_ok.any():
        idx = np.flatnonzero(step_ok)
        x[idx] -= (value[idx] - goal[idx]) / deriv[idx]
        value[idx], deriv[idx] = _h_and_slope(consts, slope, x[idx])
    step = 1.0
    for _ in range(200):  # guard: walk outward until h ≥ goal
        low = np.flatnonzero(value < goal)
        if low.size == 0:
            break
        x[low] += direction * step
        step *= 2.0
        value[low], deriv[low] = _h_and_slope(consts, slope, x[low])
    active = np.arange(x.size)
    for _ in range(100):
        if active.size == 0:
            break
        delta = (value[active] - goal[active]) / deriv[active]
        x_new = x[active] - delta
        moved_wrong = (x_new - x[active]) * direction > 0  # only float noise at the root
        # Quadratic convergence: after a step of size |Δ| the error is O(Δ²), so a step below
        # 1e-9 relative leaves x* exact to float precision without another evaluation. (Any x
        # gives a δ ≤ the true one, with an error second order in x − x*.)
        done = moved_wrong | (np.abs(delta) <= 1e-9 * np.maximum(1.0, np.abs(x_new)))
        keep = ~moved_wrong
        x[active[keep]] = x_new[keep]
        active = active[~done]
        if active.size:
            value[active], deriv[active] = _h_and_slope(consts, slope, x[active])
    return x
