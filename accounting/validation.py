"""Input checks shared by the config, the mechanisms, the accountants, the samplers and the
strategies.

Each check returns the value converted (``int`` or ``float``) or raises ``error`` — the calling
module's own exception class — with a one-line message: the parameter, its bad value and what is
allowed. ``bool`` is never a number here, and an integral float (``2.0``) is not an integer.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = [
    "in_interval",
    "interval_text",
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "probability",
]


def interval_text(lo: float, hi: float, *, lo_open: bool = True, hi_open: bool = True) -> str:
    """``(lo, hi]`` and the like, as error messages state an allowed range."""
    shown_hi = "inf" if math.isinf(hi) else f"{hi:g}"
    return f"{'(' if lo_open else '['}{lo:g}, {shown_hi}{')' if hi_open else ']'}"


def in_interval(
    value: Any, lo: float, hi: float, *, lo_open: bool = True, hi_open: bool = True
) -> bool:
    """``value`` is a real number (never a bool, never NaN) inside the interval."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        return False
    above = value > lo if lo_open else value >= lo
    below = value < hi if hi_open else value <= hi
    return above and below


def positive_int(name: str, value: Any, error: type[Exception]) -> int:
    """An integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise error(f"{name}={value!r} is out of range; expected an integer >= 1")
    return int(value)


def non_negative_int(name: str, value: Any, error: type[Exception]) -> int:
    """An integer >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise error(f"{name}={value!r} is not an integer; expected an integer >= 0")
    if value < 0:
        raise error(f"{name}={value!r} is out of range; expected an integer >= 0")
    return int(value)


def positive_float(name: str, value: Any, error: type[Exception]) -> float:
    """A finite real number > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{name}={value!r} is not a number; expected a float > 0")
    if not (math.isfinite(value) and value > 0):
        raise error(f"{name}={value!r} is out of range; expected a finite float > 0")
    return float(value)


def non_negative_float(name: str, value: Any, error: type[Exception]) -> float:
    """A finite real number >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{name}={value!r} is not a number; expected a float >= 0")
    if not (math.isfinite(value) and value >= 0):
        raise error(f"{name}={value!r} is out of range; expected a finite float >= 0")
    return float(value)


def in_unit_interval(
    name: str, value: Any, error: type[Exception], *, lo_open: bool = True, hi_open: bool = True
) -> float:
    """A real number in the unit interval, open or closed at each end (not a bool)."""
    if isinstance(value, bool) or not in_interval(
        value, 0.0, 1.0, lo_open=lo_open, hi_open=hi_open
    ):
        allowed = interval_text(0.0, 1.0, lo_open=lo_open, hi_open=hi_open)
        raise error(f"{name}={value!r} is out of range; expected a float in {allowed}")
    return float(value)


def probability(name: str, value: Any, error: type[Exception], *, upper_open: bool) -> float:
    """A real number in (0, 1) (``upper_open``, e.g. δ) or in (0, 1] (e.g. a sampling rate)."""
    if not in_interval(value, 0.0, 1.0, hi_open=upper_open):
        allowed = interval_text(0.0, 1.0, hi_open=upper_open)
        raise error(f"{name}={value!r} is out of range; expected a float in {allowed}")
    return float(value)
