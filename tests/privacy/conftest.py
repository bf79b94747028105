"""The mutation fixtures (one per injected DP bug) for the privacy bug-catching suite."""

from .mutations import *  # noqa: F403  (pytest discovers fixtures by name in this namespace)
