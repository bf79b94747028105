"""The error of the strategy API (:mod:`userdp.strategies.base`), in its own module so that the
modules ``base`` builds on (:mod:`userdp.strategies.population`) raise it too."""


class StrategyError(ValueError):
    """A strategy was configured or called wrongly; the message says what to change."""
