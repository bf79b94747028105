"""Strategy plugins named by config: ``[strategy] name = "package.module:ClassName"``.

The class must subclass :class:`userdp.strategies.Strategy`. It is imported from
``strategy.plugin_path`` (default: the config file's folder) or ``PYTHONPATH``, and built with

- ``noise_multiplier``: σ (``privacy.noise_multiplier``, or calibrated to ``privacy.epsilon``
  from the strategy's own ``mechanism()``) — every plugin must accept it;
- the standard arguments its constructor names, from the config: ``clip_norm``,
  ``sampling_prob``, ``group_size``, ``seed`` (``strategy.sampler_seed``; None = secret),
  ``optimizer`` (from ``server_optimizer``/``server_lr``), ``sampler`` (a
  :class:`~userdp.strategies.samplers.Sampler` for ``strategy.sampling``), ``steps``,
  ``num_users`` (training users N);
- every key of ``[strategy.params]``.

Bad names, a class that is not a Strategy and constructor arguments it does not take are
:class:`PluginError` (a ValueError: the CLI prints one line and exits 2).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from typing import Any

__all__ = ["STANDARD_ARGUMENTS", "PluginError", "build_plugin", "check_plugin", "plugin_class"]

STANDARD_ARGUMENTS = (
    "noise_multiplier",
    "clip_norm",
    "sampling_prob",
    "group_size",
    "seed",
    "optimizer",
    "sampler",
    "steps",
    "num_users",
)


class PluginError(ValueError):
    """A plugin strategy cannot be imported or built; the message says what to change."""


def plugin_class(name: str, plugin_path: str | None = None) -> type:
    """The Strategy subclass ``name`` (``"package.module:ClassName"``) names."""
    from userdp.strategies.base import Strategy

    module_name, _, class_name = name.partition(":")
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


def _standard(config: Any, num_users: int, noise_multiplier: float) -> dict[str, Any]:
    """The standard arguments (module docstring), built lazily: only named ones are made."""
    from userdp.strategies.samplers import bins_for, make_sampler, padding_cap

    s = config.strategy

    def optimizer() -> Any:
        from userdp.run_components import server_optimizer  # imports torch: only when named

        return server_optimizer(config)

    def sampler() -> Any:  # the sampler the built-ins build for this config
        return make_sampler(
            s.sampling,
            sampling_prob=s.sampling_prob,
            bins=bins_for(s.sampling_prob),
            cohort_cap=padding_cap(s.sampling_prob, num_users),
            seed=s.sampler_seed,
        )

    return {
        "noise_multiplier": lambda: noise_multiplier,
        "clip_norm": lambda: s.clip_norm,
        "sampling_prob": lambda: s.sampling_prob,
        "group_size": lambda: s.group_size,
        "seed": lambda: s.sampler_seed,
        "optimizer": optimizer,
        "sampler": sampler,
        "steps": lambda: s.steps,
        "num_users": lambda: num_users,
    }


def _arguments(cls: type, config: Any, num_users: int, noise_multiplier: float) -> dict:
    name = config.strategy.name
    params = dict(config.strategy.params)
    clash = sorted(set(params) & set(STANDARD_ARGUMENTS))
    if clash:
        raise PluginError(
            f"strategy.params.{clash[0]}: set by userdp from the config "
            f"({', '.join(STANDARD_ARGUMENTS)}); use the [strategy] key or privacy section"
        )
    accepted = inspect.signature(cls).parameters
    if "noise_multiplier" not in accepted:
        raise PluginError(
            f"strategy.name = {name!r}: {cls.__name__}.__init__ must accept noise_multiplier "
            "(userdp calibrates it to the privacy target)"
        )
    standard = _standard(config, num_users, noise_multiplier)
    kwargs = {key: make() for key, make in standard.items() if key in accepted}
    kwargs.update(params)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise PluginError(f"strategy.params: {cls.__name__}: {exc}") from None
    return kwargs


def check_plugin(config: Any) -> None:
    """Import the config's plugin and check its constructor takes the arguments userdp would
    pass (without running it)."""
    cls = plugin_class(config.strategy.name, config.strategy.plugin_path)
    _arguments(cls, config, num_users=1000, noise_multiplier=1.0)


def build_plugin(config: Any, num_users: int, noise_multiplier: float) -> Any:
    """The config's plugin strategy with σ = ``noise_multiplier`` for ``num_users`` users."""
    cls = plugin_class(config.strategy.name, config.strategy.plugin_path)
    kwargs = _arguments(cls, config, num_users, noise_multiplier)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise PluginError(
            f"strategy.params: {cls.__name__}({', '.join(sorted(kwargs))}) failed: {exc}"
        ) from None
