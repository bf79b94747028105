"""Input checks shared by the mechanisms, the accountants and the samplers.

Each check returns the value converted (``int`` or ``float``) or raises ``error`` — the calling
module's own exception class — with a one-line message: the parameter, its bad value and what is
allowed. ``bool`` is never a number here, and an integral float (``2.0``) is not an integer.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = [
    "non_negative_float",
    "non_negative_int",
    "positive_float",
    "positive_int",
    "probability",
]


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


def probability(name: str, value: Any, error: type[Exception], *, upper_open: bool) -> float:
    """A real number in (0, 1) (``upper_open``, e.g. δ) or in (0, 1] (e.g. a sampling rate)."""
    ok = not isinstance(value, bool) and isinstance(value, numbers.Real)
    if ok:
        ok = 0.0 < value < 1.0 if upper_open else 0.0 < value <= 1.0
    if not ok:
        allowed = "(0, 1)" if upper_open else "(0, 1]"
        raise error(f"{name}={value!r} is out of range; expected a float in {allowed}")
    return float(value)
