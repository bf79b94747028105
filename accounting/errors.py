"""The exceptions of the accounting layer's light modules: a bad mechanism parameter (raised by
:mod:`userdp.accounting.mechanisms` and :mod:`userdp.accounting.correlation_spec`) and phases that
do not compose (raised by :mod:`userdp.accounting.api` and the PLD accountant it loads)."""

__all__ = ["InvalidMechanismError", "NotComposableError"]


class InvalidMechanismError(ValueError):
    """A mechanism parameter is out of range; the message names it, its value and what is allowed."""


class NotComposableError(ValueError):
    """The phases mix mechanisms whose accountants cannot be composed (e.g. Monte Carlo with PLD)."""
