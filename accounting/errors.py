"""The exception a mechanism description raises for a bad parameter, shared by
:mod:`userdp.accounting.mechanisms` and :mod:`userdp.accounting.correlation_spec`."""

__all__ = ["InvalidMechanismError"]


class InvalidMechanismError(ValueError):
    """A mechanism parameter is out of range; the message names it, its value and what is allowed."""
