"""Inverse accounting queries: σ for a target (ε, δ) and the largest number of steps in a budget.

Both searches only ever return a point that the forward accountant (``api.epsilon``, at the
reporting discretization) has verified to be within the target: the returned σ gives
ε(σ) ≤ target, the returned T gives ε(T) ≤ target. ε is decreasing in σ and increasing in T
for every mechanism here, so a bracket [private, not private] plus bisection/Brent is enough.

Results are cached on disk (``$USERDP_CACHE_DIR``, default ``~/.cache/userdp``): one JSON file
per query, named by the SHA-256 of the canonical JSON of everything the answer depends on
(operation, mechanism, steps, δ, target, tolerance, discretization, accountant version, userdp
version, a sha256 of this package's source, and the dp_accounting, numpy and scipy versions). A
file is used only if the query stored inside it equals the query asked, so a hash collision, a
stale file or a σ computed by other accountant code can never be returned.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from userdp.accounting import api
from userdp.accounting.durable import atomic_write_json
from userdp.accounting.mechanisms import (
    BallsInBinsMechanism,
    InvalidMechanismError,
    Mechanism,
    mechanism_from_dict,
)
from userdp.accounting.validation import positive_float

__all__ = [
    "CalibrationError",
    "cache_dir",
    "calibrate_noise_multiplier",
    "max_steps",
]

MAX_NOISE_MULTIPLIER = 2.0**30


class CalibrationError(ValueError):
    """No σ (or step count) meets the target within the search range."""


# --------------------------------------------------------------------------------------------
# calibration


def calibrate_noise_multiplier(
    template: Mechanism | Mapping[str, Any],
    target_epsilon: float,
    delta: float,
    steps: int,
    *,
    rtol: float = 1e-4,
    value_discretization_interval: float = api.DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    search_discretization_interval: float | None = 1e-3,
    use_cache: bool = True,
    **monte_carlo: Any,
) -> float:
    """The smallest σ (up to a relative ``rtol``) with ε(σ) ≤ ``target_epsilon`` after ``steps``.

    ``template`` fixes every parameter but σ (its own ``noise_multiplier`` is ignored); it may
    be a mechanism or its dict without ``noise_multiplier``, e.g. ``{"kind": "uls",
    "sampling_prob": 0.01}``. The result is always on the private side: ε(σ) at
    ``value_discretization_interval`` has been evaluated and is ≤ target, and some σ' with
    σ − σ' ≤ rtol·σ has been evaluated above the target. For PLD mechanisms the search first
    runs at the cheaper ``search_discretization_interval``; the bracket is then re-established
    and shrunk at the reporting discretization. ``monte_carlo`` keywords go to the
    balls-in-bins accountant (pass a fixed ``seed`` there: common random numbers keep ε̂(σ)
    monotone).
    """
    if isinstance(template, Mapping):
        template = mechanism_from_dict({"noise_multiplier": 1.0, **template})
    positive_float("target_epsilon", target_epsilon, InvalidMechanismError)
    api._check_delta(delta)
    steps = api._check_steps(steps)
    if not (0.0 < rtol < 0.5):
        raise InvalidMechanismError(f"rtol={rtol!r} is out of range; expected a float in (0, 0.5)")
    query = {
        "op": "calibrate_noise_multiplier",
        "mechanism": {**template.to_dict(), "noise_multiplier": None},
        "steps": steps,
        "delta": float(delta),
        "target_epsilon": float(target_epsilon),
        "rtol": rtol,
        "value_discretization_interval": value_discretization_interval,
        "search_discretization_interval": search_discretization_interval,
        "monte_carlo": monte_carlo,
    }
    return _cached(query, use_cache, lambda: _calibrate(template, query, monte_carlo))


def _calibrate(template: Mechanism, query: dict[str, Any], monte_carlo: dict[str, Any]) -> float:
    target, delta, steps, rtol = (
        query["target_epsilon"],
        query["delta"],
        query["steps"],
        query["rtol"],
    )
    if steps == 0:
        raise CalibrationError("steps=0 releases nothing; any noise_multiplier is private")
    if isinstance(template, BallsInBinsMechanism):
        return _calibrate_balls_in_bins(template, target, delta, steps, rtol, monte_carlo)
    fine = query["value_discretization_interval"]
    coarse = query["search_discretization_interval"]
    is_pld = template.kind in api.PLD_KINDS

    def eps_at(sigma: float, vdi: float) -> float:
        mechanism = dataclasses.replace(template, noise_multiplier=sigma)
        return api.epsilon(
            mechanism, steps, delta, value_discretization_interval=vdi, **monte_carlo
        )

    # Start high: ε is cheap to evaluate at large σ (narrow PLD) and costly at small σ, so the
    # bracket search should approach the answer from above. ELS sensitivity is up to G.
    guess = 4.0 * getattr(template, "group_size", 1)
    slope = None
    if is_pld and coarse is not None and coarse > fine:
        bracket = _bracket(lambda s: eps_at(s, coarse), target, guess)
        c_sigma, slope = _shrink(lambda s: eps_at(s, coarse), target, bracket, rtol)
        # Pessimistic PLDs at the finer grid are usually a little tighter: σ_fine ≲ σ_coarse.
        guess = c_sigma
    bracket = _bracket(
        lambda s: eps_at(s, fine), target, guess, first_factor=1.0 + 2 * rtol, slope=slope
    )
    return _shrink(lambda s: eps_at(s, fine), target, bracket, rtol)[0]


def _calibrate_balls_in_bins(
    template: BallsInBinsMechanism,
    target: float,
    delta: float,
    steps: int,
    rtol: float,
    monte_carlo: dict[str, Any],
) -> float:
    """The smallest σ (to ``rtol``) whose CERTIFIED ε (:mod:`userdp.accounting.
    balls_in_bins_certified`, the value the ledger, the report and every other place state) is
    at most ``target``: a bracket and secant search on that same function, so the calibrated
    run's stated ε is within its budget by construction. Correlated noise starts the search at
    the Monte Carlo estimate's σ (``monte_carlo`` keywords go to that estimate), so that the few
    certified evaluations, each an Estimate-Verify-Release, are spent near the answer (where
    the Monte Carlo method is attempted at all: below its δ the certified bound is
    deterministic and cheap)."""
    guess = 4.0
    certified = api._accountant_module("balls_in_bins_certified", template.kind)
    epochs = api.balls_in_bins_epochs(template, steps)
    feasible = certified.monte_carlo_draws(1, delta) <= certified.MONTE_CARLO_DRAW_LIMIT
    if template.correlation is not None and feasible:
        balls_in_bins = api._accountant_module("balls_in_bins", template.kind)
        guess = float(
            balls_in_bins.calibrate_noise_multiplier(
                target,
                delta,
                template.bins,
                epochs,
                bin_semantics=template.bin_semantics,
                correlation=template.correlation,
                rtol=rtol,
                check=False,
                **monte_carlo,
            )
        )
    elif monte_carlo:
        raise InvalidMechanismError(
            f"{sorted(monte_carlo)} do not apply: this balls-in-bins calibration searches a "
            "deterministic certified bound (C = I, or a δ below the Monte Carlo method's reach)"
        )

    def eps_at(sigma: float) -> float:
        return api.epsilon(dataclasses.replace(template, noise_multiplier=sigma), steps, delta)

    bracket = _bracket(eps_at, target, guess, first_factor=1.0 + 8 * rtol)
    return _shrink(eps_at, target, bracket, rtol)[0]


Bracket = tuple[float, float, float, float]  # (low, ε(low) > target, high, ε(high) ≤ target)


def _bracket(
    eps_of: Callable[[float], float],
    target: float,
    guess: float,
    first_factor: float = 2.0,
    slope: float | None = None,
) -> Bracket:
    """Walk geometrically from ``guess`` to a bracket; the step factor grows from ``first_factor``
    (f → 1 + 4(f − 1)) up to ×2. With a known ``slope`` = d log ε / d log σ, the first step
    jumps to the predicted root and a little past it."""
    factor = first_factor
    sigma, eps = guess, eps_of(guess)
    if slope is not None and slope < 0 and eps > 0 and math.isfinite(eps):
        predicted = abs(math.log(eps / target) / slope)  # |log σ* − log σ|
        factor = max(factor, math.exp(1.5 * predicted) * first_factor)
    if eps <= target:
        while True:
            low = sigma / factor
            if low < 1e-6:
                raise CalibrationError(
                    f"target_epsilon={target} is met even at noise_multiplier={low:g}"
                )
            eps_low = eps_of(low)
            if eps_low > target:
                return low, eps_low, sigma, eps
            sigma, eps = low, eps_low
            factor = min(1.0 + 4.0 * (factor - 1.0), 2.0)
    while True:
        high = sigma * factor
        if high > MAX_NOISE_MULTIPLIER:
            raise CalibrationError(
                f"target_epsilon={target} is not met by any noise_multiplier <= 2^30"
            )
        eps_high = eps_of(high)
        if eps_high <= target:
            return sigma, eps, high, eps_high
        sigma, eps = high, eps_high
        factor = min(1.0 + 4.0 * (factor - 1.0), 2.0)


def _shrink(
    eps_of: Callable[[float], float], target: float, bracket: Bracket, rtol: float
) -> tuple[float, float | None]:
    """Shrink the bracket until (high − low) ≤ rtol·high; return (high, d log ε / d log σ).

    ``high`` is the private end. Each step is a secant guess in (log σ, log ε), nudged by
    rtol/2 past the root toward the end that did not move last time so that two evaluations
    can close the bracket; after two one-sided steps in a row it falls back to geometric
    bisection (logarithmic worst case).
    """
    low, eps_low, high, eps_high = bracket
    last_side, repeats = 0, 0
    while high - low > rtol * high:
        mid = math.sqrt(low * high)
        if repeats < 2 and math.isfinite(eps_low) and eps_high > 0:
            try:
                t = math.log(eps_low / target) / math.log(eps_low / eps_high)
                mid = math.exp(math.log(low) + min(max(t, 0.0), 1.0) * math.log(high / low))
                mid -= 0.5 * rtol * high * last_side  # last moved high (+1): aim below the root
            except (ValueError, ZeroDivisionError, OverflowError):
                mid = math.sqrt(low * high)
        # Never spend an evaluation on a bracket narrower than rtol on either side.
        mid = min(max(mid, low + 0.45 * rtol * high), high - 0.45 * rtol * high)
        eps = eps_of(mid)
        side = 1 if eps <= target else -1
        repeats = repeats + 1 if side == last_side else 0
        last_side = side
        if side == 1:
            high, eps_high = mid, eps
        else:
            low, eps_low = mid, eps
    try:
        slope = math.log(eps_high / eps_low) / math.log(high / low)
    except (ValueError, ZeroDivisionError, OverflowError):
        slope = None
    return high, slope


# --------------------------------------------------------------------------------------------
# max steps


def max_steps(
    mechanism: Mechanism,
    epsilon: float,
    delta: float,
    *,
    limit: int = 10**7,
    value_discretization_interval: float = api.DEFAULT_VALUE_DISCRETIZATION_INTERVAL,
    use_cache: bool = True,
    **monte_carlo: Any,
) -> int:
    """The largest T ≤ ``limit`` with ε(T) ≤ ``epsilon`` (0 if even one step exceeds it).

    For balls-in-bins the count is a whole number of epochs times ``bins`` (a partial epoch
    is accounted as the whole epoch), capped at ``bins × epochs`` of the mechanism.
    """
    positive_float("epsilon", epsilon, InvalidMechanismError)
    api._check_delta(delta)
    query = {
        "op": "max_steps",
        "mechanism": mechanism.to_dict(),
        "delta": float(delta),
        "target_epsilon": float(epsilon),
        "limit": int(limit),
        "value_discretization_interval": value_discretization_interval,
        "monte_carlo": monte_carlo,
    }

    def compute() -> int:
        unit = 1
        if isinstance(mechanism, BallsInBinsMechanism):
            unit = mechanism.bins
            upper = min(limit // unit, mechanism.epochs)
        else:
            upper = limit

        def ok(n: int) -> bool:
            return (
                api.epsilon(
                    mechanism,
                    n * unit,
                    delta,
                    value_discretization_interval=value_discretization_interval,
                    **monte_carlo,
                )
                <= epsilon
            )

        return unit * _largest_true(ok, upper)

    return int(_cached(query, use_cache, compute))


def _largest_true(ok: Callable[[int], bool], upper: int) -> int:
    """Largest n in [0, upper] with ok(n) for a monotone (True…True False…False) predicate."""
    if upper < 1 or not ok(1):
        return 0
    good, bad = 1, None
    while bad is None:  # exponential search
        nxt = min(good * 2, upper)
        if nxt == good:
            return good
        if ok(nxt):
            good = nxt
        else:
            bad = nxt
    while bad - good > 1:
        mid = (good + bad) // 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good


# --------------------------------------------------------------------------------------------
# on-disk cache


def cache_dir() -> Path:
    """``$USERDP_CACHE_DIR`` or ``~/.cache/userdp``."""
    env = os.environ.get("USERDP_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "userdp"


@functools.cache
def accountant_code_sha256() -> str:
    """sha256 over the source of this package's modules (name-sorted): any edit to the code that
    computes σ, ε or steps gives cached results a new key."""
    digest = hashlib.sha256()
    for path in sorted(Path(__file__).resolve().parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def _full_query(query: dict[str, Any]) -> dict[str, Any]:
    import dp_accounting
    import numpy
    import scipy

    from userdp import __version__

    return {
        **query,
        "accountant_version": api.ACCOUNTANT_VERSION,
        "userdp_version": __version__,
        "accountant_code_sha256": accountant_code_sha256(),
        "dp_accounting_version": getattr(dp_accounting, "__version__", "unknown"),
        "numpy_version": numpy.__version__,
        "scipy_version": scipy.__version__,
    }


def _cached(query: dict[str, Any], use_cache: bool, compute: Callable[[], Any]) -> Any:
    if not use_cache:
        return compute()
    full = _full_query(query)
    canonical = json.dumps(full, sort_keys=True, separators=(",", ":"), allow_nan=False)
    key = hashlib.sha256(canonical.encode()).hexdigest()
    path = cache_dir() / "accounting" / f"{key}.json"
    try:
        stored = json.loads(path.read_text())
        if stored.get("query") == json.loads(canonical):
            return stored["result"]
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    result = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {"query": json.loads(canonical), "result": result}, sort_keys=True)
    except OSError:
        pass  # a read-only cache directory only costs speed
    return result
