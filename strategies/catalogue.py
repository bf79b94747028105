"""The strategy catalogue: the registered names, finding a strategy class (built-in or plugin),
and the config rules each class states about itself.

``[strategy] name`` is a registered name or a plugin ``"package.module:ClassName"``; a registered
name is itself a ``module:Class`` path, so a built-in and a plugin are found and checked by the
same code. A class states what a config must satisfy to run it as class attributes of
:class:`~userdp.strategies.base.Strategy` (``samplings``, ``record_units``,
``full_participation``, ``required_keys``, ``banded_samplings``, ``estimates_norms``), and
:func:`check_config_rules` applies them: no strategy name is special-cased by the config.

The config layer imports this module (downward); the run layer builds strategies with it
(:mod:`userdp.run.registry`).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

from userdp.strategies.base import Strategy
from userdp.strategies.population import EXAMPLE_UNIT_SELECTIONS

__all__ = [
    "BUILTIN_STRATEGIES",
    "OPTIONAL_KEYS",
    "PluginError",
    "check_config_rules",
    "check_engine",
    "check_strategy_keys",
    "constructor_parameters",
    "strategy_class",
]

BUILTIN_STRATEGIES: dict[str, str] = {
    "uls": "userdp.strategies.builtins:UserLevelSampling",
    "els": "userdp.strategies.builtins:ExampleLevelSampling",
    "group-privacy": "userdp.strategies.builtins:GroupPrivacyComparison",
    "dp-fedavg": "userdp.strategies.builtins:DpFedAvg",
    "adaptive-clipping": "userdp.strategies.adaptive_clipping:AdaptiveClipping",
    "randomized-clipping": "userdp.strategies.builtins:RandomizedClipping",
    "blt-dp-ftrl": "userdp.strategies.dpftrl:BltDpFtrl",
    "user-wise-filter": "userdp.strategies.user_filter:UserWiseFilter",
}
"""The registered names and the ``module:Class`` each stands for."""

OPTIONAL_KEYS = ("bands", "expected_cohort_size", "expected_batch_size", "concentration_threshold")
"""Strategy-only ``[strategy]`` keys that default to unset: set, they must reach the constructor."""


class PluginError(ValueError):
    """A strategy cannot be imported or built from the config; the message says what to change."""


def strategy_class(name: str, plugin_path: str | None = None) -> type[Strategy]:
    """The Strategy subclass a registered name or a plugin ``"package.module:ClassName"`` names."""
    target = BUILTIN_STRATEGIES.get(name, name)
    module_name, _, class_name = target.partition(":")
    where = f"{plugin_path} or PYTHONPATH" if plugin_path else "PYTHONPATH"
    if plugin_path:
        folder = str(Path(plugin_path).expanduser())
        if folder not in sys.path:
            sys.path.insert(0, folder)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if module_name == missing or module_name.startswith(missing + "."):
            raise PluginError(
                f"strategy.name = {name!r}: no module {module_name!r} in {where}; put "
                f"{module_name.replace('.', '/')}.py next to the config or set "
                "strategy.plugin_path"
            ) from None
        raise PluginError(
            f"strategy.name = {name!r}: importing {module_name!r} failed: {exc}"
        ) from None
    except Exception as exc:  # the plugin's own code failed while importing
        raise PluginError(
            f"strategy.name = {name!r}: importing {module_name!r} failed: "
            f"{type(exc).__name__}: {exc}"
        ) from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise PluginError(
            f"strategy.name = {name!r}: module {module_name!r} ({module.__file__}) has no "
            f"{class_name!r}"
        )
    if not (inspect.isclass(cls) and issubclass(cls, Strategy)):
        raise PluginError(
            f"strategy.name = {name!r}: {class_name} is not a subclass of "
            "userdp.strategies.Strategy"
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise PluginError(f"strategy.name = {name!r}: {class_name} does not implement {missing}")
    return cls


def constructor_parameters(cls: type[Strategy]) -> set[str]:
    """The keyword arguments ``cls(...)`` takes, following ``**kwargs`` up its base classes (a
    built-in such as DP-FedAvg passes the ULS arguments through)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        parameters = list(inspect.signature(init).parameters.values())[1:]  # without self
        names |= {p.name for p in parameters if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return names


def check_strategy_keys(cls: type[Strategy], strategy: Any) -> None:
    """The ``[strategy]`` keys ``cls`` cannot honour: a sampling scheme outside its
    :attr:`~userdp.strategies.Strategy.samplings`, or a strategy-only key that is set but that its
    constructor does not take (:class:`PluginError`). ``strategy`` is the config's section."""
    name = strategy.name
    if cls.samplings is not None and strategy.sampling not in cls.samplings:
        allowed = " or ".join(repr(x) for x in cls.samplings)
        raise PluginError(
            f"strategy.name = {name!r} supports strategy.sampling = {allowed} only, got "
            f"{strategy.sampling!r}"
        )
    accepted = constructor_parameters(cls)
    unused = [k for k in OPTIONAL_KEYS if getattr(strategy, k) is not None and k not in accepted]
    if unused:
        raise PluginError(
            f"strategy.{unused[0]} is set, but strategy.name = {name!r} ({cls.__name__}) does not "
            "take it; remove it"
            + (
                ""
                if name in BUILTIN_STRATEGIES
                else " (a plugin takes its own arguments in [strategy.params])"
            )
        )


def check_config_rules(cls: type[Strategy], strategy: Any, selection: str) -> None:
    """The rules ``cls`` states as class attributes (module docstring) against the config's
    ``[strategy]`` section and ``data.selection``; :class:`PluginError` naming the key."""
    name = strategy.name
    for key in cls.required_keys:
        if getattr(strategy, key) is None:
            raise PluginError(f"strategy.name = {name!r} needs strategy.{key}; set it")
    if cls.full_participation and (strategy.sampling != "poisson" or strategy.sampling_prob != 1):
        raise PluginError(
            f"strategy.name = {name!r} uses every user in every step: set strategy.sampling = "
            f"'poisson' and strategy.sampling_prob = 1.0, got {strategy.sampling!r} with "
            f"{strategy.sampling_prob:g}"
        )
    if cls.record_units and selection not in EXAMPLE_UNIT_SELECTIONS:
        raise PluginError(
            f"data.selection = {selection!r} cuts windows across a user's records, but "
            f"strategy.name = {name!r} trains on records of a subset chosen once; use "
            f"data.selection = one of {', '.join(EXAMPLE_UNIT_SELECTIONS)}, or a user-level "
            "strategy (uls, dp-fedavg, ...)"
        )
    if strategy.bands is not None and strategy.sampling not in cls.banded_samplings:
        if not cls.banded_samplings:
            raise PluginError(
                f"strategy.bands is set, but strategy.name = {name!r} has no banded C; remove it"
            )
        allowed = " or ".join(map(repr, cls.banded_samplings))
        raise PluginError(
            f"strategy.bands (a banded C) goes with strategy.sampling = {allowed} for "
            f"strategy.name = {name!r}, got {strategy.sampling!r}"
        )


def check_engine(cls: type[Strategy], strategy: Any) -> None:
    """``strategy.engine = "randomized"`` needs a class accounted for estimated norms
    (``estimates_norms``); checked when a run builds its strategy (a worker's engine may be
    configured alone)."""
    if strategy.engine == "randomized" and not cls.estimates_norms:
        raise PluginError(
            "strategy.engine = 'randomized' estimates norms, which needs its own accountant: "
            "set strategy.name = 'randomized-clipping' (or use engine 'vectorized' / 'loop'; a "
            "plugin that estimates norms sets engine='randomized' in its configure_task)"
        )
