"""Faster equivalents of dp_accounting's PLD operations, with the library's results.

Used for every PLD mechanism (uls, els); each function names the library routine it replaces
and how the result compares (tests/accounting/test_fast_pld.py):

* :func:`self_compose` — ``PrivacyLossDistribution.self_compose``: same truncation bounds, FFT
  length and infinity mass, with real FFTs (half the work), and the upper tail computed from
  exponentially tilted transforms (:func:`_tilted_power`), so that its small probabilities keep
  their own precision instead of the largest one's: at δ ≤ 10⁻⁸ the library's round-off makes
  ε optimistic, this composition does not (tested against a long-double composition).
* :func:`epsilon_for_delta` — ``get_epsilon_for_delta``: the library's scan over the losses
  (a Python loop, up to ~10⁶ iterations) with prefix sums in the same summation order.
* ``_self_convolve_bounds`` — ``common.compute_self_convolve_bounds``: the same 40 Chernoff
  bounds in one numpy pass per order instead of 40 ``scipy.special.logsumexp`` calls (same
  integers).
"""

from __future__ import annotations

import math

import numpy as np
from dp_accounting.pld import pld_pmf
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from scipy import fft
from userdp.accounting import dp_accounting_adapter as adapter

__all__ = ["epsilon_for_delta", "self_compose"]


def self_compose(
    pld: pld_lib.PrivacyLossDistribution,
    num_times: int,
    tail_mass_truncation: float = 1e-15,
) -> pld_lib.PrivacyLossDistribution:
    """``pld.self_compose(num_times)``: the same truncation bounds
    (``common.compute_self_convolve_bounds``, computed by :func:`_self_convolve_bounds`), FFT
    length and infinity mass, with real FFTs (half the work), equal up to float rounding. Falls
    back to the library for sparse PMFs."""
    composed = []
    for pmf in adapter.distinct_pmfs(pld):
        dense = adapter.dense_arrays(pmf)
        if dense is None:
            return pld.self_compose(num_times, tail_mass_truncation)
        composed.append(_self_compose_dense(dense, num_times, tail_mass_truncation))
    return pld_lib.PrivacyLossDistribution(*composed)


def _self_compose_dense(
    pmf: adapter.DenseArrays, num_times: int, tail_mass_truncation: float
) -> pld_pmf.DensePLDPmf:
    if num_times <= 0:
        raise ValueError(f"num_times should be >= 1, num_times={num_times}")
    probs = pmf.probs
    lower, upper = _self_convolve_bounds(probs, num_times, tail_mass_truncation)
    output_len = upper - lower + 1
    # The library's length (complex next_fast_len), so the circular wrap-around is identical.
    fast_len = fft.next_fast_len(max(output_len, len(probs)))
    out = _tilted_power(np.asarray(probs, dtype=np.float64), num_times, lower, upper, fast_len)
    infinity_mass = tail_mass_truncation - math.expm1(num_times * math.log1p(-pmf.infinity_mass))
    return pld_pmf.DensePLDPmf(
        pmf.discretization,
        pmf.lower_loss * num_times + lower,
        out,
        infinity_mass,
        pmf.pessimistic_estimate,
    )


TILTS = 4
"""Exponential tilts of the upper tail in :func:`_tilted_power`, besides the plain transform."""
TILT_TAIL_MASS = 1e-30
"""The tilted composition is transformed over its own Chernoff window (this mass outside, at
most), so the circular convolution wraps around no tilted mass above float64 resolution."""
TILT_WINDOW_LIMIT = 4
"""A tilt whose window is longer than this many times the plain one is not used (cost)."""


def _tilted_power(
    probs: np.ndarray, num_times: int, lower: int, upper: int, fast_len: int
) -> np.ndarray:
    """``probs`` self-convolved ``num_times`` times, at composed indices ``lower..upper``, each
    entry accurate RELATIVE TO ITSELF, not to the largest one.

    A plain FFT power (the library's) gets every entry to within about T·u·log N of the largest
    probability (u = 2⁻⁵³): far above the tail entries that δ ≤ 10⁻⁸ is made of, whose round-off
    then makes ε optimistic. Exponential tilting moves the tail to the middle: with p̃ᵢ =
    pᵢe^{λi}/M(λ), M(λ) = Σ pᵢe^{λi}, the T-fold convolution is p^{*T}_k = M(λ)^T e^{−λk}
    p̃^{*T}_k, and the FFT's round-off of p̃^{*T} is small next to p̃^{*T}_k near the tilted
    mean T·E_λ[i]. The plain transform (λ = 0) and :data:`TILTS` tilts whose means are spread
    over the upper tail are computed, and each entry takes the one with the smallest scale
    M(λ)^T e^{−λk}, the Chernoff-optimal tilt among them (the absolute round-off of p^{*T}_k is
    that scale times the tilted transform's). Entries at or below the mean take the plain
    transform, so they are the library's."""
    n = probs.size
    index = np.arange(n, dtype=np.float64)
    composed = lower + np.arange(upper - lower + 1, dtype=np.float64)

    def tilted(lam: float) -> tuple[np.ndarray, float]:
        exponent = lam * index
        shift = float(exponent.max())
        weighted = probs * np.exp(exponent - shift)
        total = float(weighted.sum())
        return weighted / total, math.log(total) + shift

    def power(p: np.ndarray, start: int, stop: int, length: int) -> np.ndarray:
        """p^{*T} at ``lower..upper``, by a circular convolution of ``length`` ≥ the window
        ``start..stop`` that holds all but a negligible part of p^{*T}."""
        circular = fft.irfft(fft.rfft(p, length) ** num_times, length)
        return np.roll(circular, -start)[lower - start : upper - start + 1]

    out = power(probs, lower, upper, fast_len)
    mean = num_times * float(probs @ index) / float(probs.sum())
    if num_times == 1 or not upper > mean:  # nothing composed: no round-off to keep small
        return out
    best = np.zeros_like(out)  # log of the chosen tilt's scale (0: the plain transform)

    def moments(lam: float) -> tuple[float, float]:
        """(mean, variance) of the T-fold sum under tilt ``lam``: d mean/dλ = variance."""
        p, _ = tilted(lam)
        m = float(p @ index)
        return num_times * m, num_times * max(float(p @ (index - m) ** 2), 0.0)

    lam = 0.0
    for fraction in np.arange(1, TILTS + 1) / (TILTS + 1):
        target = mean + fraction * (upper - mean)
        low, high = lam, math.inf  # the mean increases with λ (its derivative is the variance)
        for _ in range(50):  # Newton, kept inside the bracket
            centre, variance = moments(lam)
            if abs(centre - target) <= 1e-3 * math.sqrt(variance) or variance <= 0:
                break
            if centre < target:
                low = lam
            else:
                high = lam
            step = lam + (target - centre) / variance
            lam = (
                step
                if low < step < high
                else (low + high) / 2
                if high < math.inf
                else 2 * lam + 1 / n
            )
        if lam <= 0:
            break
        p, log_m = tilted(lam)
        # the tilted sum has its own (heavier, higher) tails: transform over its window
        tilted_lower, tilted_upper = _self_convolve_bounds(p, num_times, TILT_TAIL_MASS, 10)
        start, stop = min(lower, tilted_lower), max(upper, tilted_upper)
        if stop - start + 1 > TILT_WINDOW_LIMIT * (upper - lower + 1):
            break
        length = fft.next_fast_len(max(stop - start + 1, n))
        log_scale = num_times * log_m - lam * composed
        better = log_scale < best
        if better.any():
            with np.errstate(over="ignore", under="ignore"):
                out[better] = power(p, start, stop, length)[better] * np.exp(log_scale[better])
            best[better] = log_scale[better]
    return out


def epsilon_for_delta(pld: pld_lib.PrivacyLossDistribution, delta: float) -> float:
    """``pld.get_epsilon_for_delta(delta)`` with the library's scan over losses (a Python loop of
    up to one iteration per grid point, ~10⁶ for long ELS runs) done with prefix sums.

    Same algorithm and summation order (sequential sums from the largest loss down), so the
    result equals the library's up to the last bits of ``exp``; sparse PMFs go to the library."""
    pmfs = [adapter.dense_arrays(pmf) for pmf in adapter.distinct_pmfs(pld)]
    if any(pmf is None for pmf in pmfs):
        return float(pld.get_epsilon_for_delta(delta))
    return max(_dense_epsilon_for_delta(pmf, delta) for pmf in pmfs)


def _dense_epsilon_for_delta(pmf: adapter.DenseArrays, delta: float) -> float:
    """The library's ε(δ) scan of one dense PMF, vectorized (see epsilon_for_delta)."""
    infinity_mass = pmf.infinity_mass
    if infinity_mass > delta:
        return math.inf
    probs = np.flip(np.asarray(pmf.probs, dtype=np.float64))
    n = probs.size
    if n == 0:
        return 0.0 if infinity_mass <= delta else math.inf
    step = pmf.discretization
    upper_loss = (pmf.lower_loss + n - 1) * step
    # itertools.count(upper_loss, -step) adds the step repeatedly: the same sequential sums.
    losses = np.add.accumulate(np.concatenate(([upper_loss], np.full(n - 1, -step))))
    mass_upper = np.add.accumulate(np.concatenate(([infinity_mass], probs)))
    with np.errstate(over="ignore"):  # e^{-loss} = inf only far below where the scan stops
        mass_lower = np.add.accumulate(np.concatenate(([0.0], np.exp(-losses) * probs)))
    upper_before, lower_before = mass_upper[:-1], mass_lower[:-1]
    upper_after, lower_after = mass_upper[1:], mass_lower[1:]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        stop = (
            (upper_before > delta)
            & (lower_before > 0)
            & (np.log((upper_before - delta) / lower_before) >= losses)
        )
    overflow = (upper_after >= delta) & (lower_after == 0)  # exp(-loss) underflowed to 0
    first_stop = int(np.argmax(stop)) if stop.any() else n
    first_overflow = int(np.argmax(overflow)) if overflow.any() else n
    if first_overflow < first_stop:
        return max(0.0, float(losses[first_overflow]))
    final_upper, final_lower = float(mass_upper[first_stop]), float(mass_lower[first_stop])
    if final_upper <= final_lower + delta:
        return 0.0
    return math.log((final_upper - delta) / final_lower)


def _self_convolve_bounds(
    probs: np.ndarray, num_times: int, tail_mass_truncation: float, orders_per_side: int = 20
) -> tuple[int, int]:
    """``common.compute_self_convolve_bounds`` (Chernoff bounds at the library's 40 default
    orders ±1..20 / len) with the 40 log-MGFs computed in one pass instead of 40 scipy calls;
    ``orders_per_side`` < 20 takes every other, every fourth, ... of them (looser, cheaper)."""
    n = len(probs)
    upper_bound, lower_bound = (n - 1) * num_times, 0
    if tail_mass_truncation == 0:
        return lower_bound, upper_bound
    stride = max(1, 20 // orders_per_side)
    positive = np.arange(stride, 21, stride)
    orders = np.concatenate((-positive[::-1], positive)) / n
    index = np.arange(n, dtype=np.float64)
    log_2_over_tail = math.log(2 / tail_mass_truncation)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        log_probs = np.log(probs)
        for order in orders:
            z = index * order + log_probs
            peak = z.max()
            if not math.isfinite(peak):
                continue
            log_mgf = math.log(np.exp(z - peak).sum()) + peak
            bound = (num_times * log_mgf + log_2_over_tail) / order
            if not math.isfinite(bound):
                continue
            if order > 0:
                upper_bound = min(upper_bound, math.ceil(bound))
            else:
                lower_bound = max(lower_bound, math.floor(bound))
    return lower_bound, upper_bound
