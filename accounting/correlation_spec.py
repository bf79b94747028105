"""The ledger's description of a noise-correlation matrix C: a name and JSON parameters.

A frozen value in the spirit of dp_accounting's ``dp_event.py``: the meaning of a name and its
parameters never changes, so a ledger written today re-accounts identically later.
:func:`userdp.accounting.correlation.from_spec` turns it into numbers.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from userdp.accounting.errors import InvalidMechanismError

__all__ = ["CorrelationSpec"]


@dataclass(frozen=True)
class CorrelationSpec:
    """A named noise-correlation matrix C (lower-triangular, non-negative), e.g. ``blt`` or ``banded``.

    ``params`` is a sorted tuple of (name, value) pairs so the value is hashable and its JSON
    form is canonical. ``None`` in place of a CorrelationSpec means the identity (plain DP-SGD).
    """

    name: str
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidMechanismError(
                f"correlation.name={self.name!r} is not allowed; expected a non-empty string"
            )
        raw = self.params if isinstance(self.params, Mapping) else dict(self.params)
        items = raw.items()
        object.__setattr__(
            self, "params", tuple(sorted((str(k), _json_value(v)) for k, v in items))
        )

    @classmethod
    def of(cls, name: str, **params: Any) -> CorrelationSpec:
        return cls(name=name, params=tuple(params.items()))

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "params": {k: _json_out(v) for k, v in self.params}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CorrelationSpec:
        return cls(name=d["name"], params=tuple(dict(d.get("params", {})).items()))


def _json_value(value: Any) -> Any:
    """Freeze a JSON-like parameter value (lists become tuples) so the spec stays hashable."""
    if isinstance(value, bool | str) or value is None:
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, list | tuple):
        return tuple(_json_value(v) for v in value)
    raise InvalidMechanismError(
        f"correlation parameter value {value!r} is not allowed; expected numbers, strings or lists"
    )


def _json_out(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_json_out(v) for v in value]
    return value
