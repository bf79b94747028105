"""The strategy registry: one way to name, find and build a strategy from a config.

``[strategy] name`` is a registered name (:mod:`userdp.strategies.catalogue`) or a plugin
``"package.module:ClassName"``; a registered name is itself a ``module:Class`` path, so a built-in
and a plugin are imported, checked and built by the same code:

- the class must subclass :class:`userdp.strategies.Strategy`; a plugin module is imported from
  ``strategy.plugin_path`` (default: the config file's folder) or ``PYTHONPATH``;
- its constructor gets, by name, each argument it declares among :data:`CONFIG_ARGUMENTS`
  (``noise_multiplier`` σ, which every strategy must take; ``clip_norm``, ``sampling_prob``,
  ``group_size``, ``steps``, ``num_users``, ``seed`` = ``strategy.sampler_seed``, ``optimizer``,
  ``sampler``, the strategy-only ``[strategy]`` keys, and the values a scheme derives from them:
  ``bins``/``epochs`` for balls-in-bins and cyclic Poisson, ``cohort_cap`` for padding, ...) and,
  for a plugin, every key of ``[strategy.params]``;
- a class that declares :attr:`~userdp.strategies.Strategy.samplings` refuses any other
  ``strategy.sampling``; a strategy-only key that is set but that the constructor does not take
  is refused, never ignored.

Bad names, a class that is not a Strategy and arguments the constructor does not take are
:class:`PluginError` (a ValueError: the CLI prints one line and exits 2).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from userdp.accounting.mechanisms import Mechanism
from userdp.strategies.base import Strategy
from userdp.strategies.catalogue import (
    BUILTIN_STRATEGIES,
    PluginError,
    check_config_rules,
    check_engine,
    check_strategy_keys,
    constructor_parameters,
    strategy_class,
)
from userdp.strategies.noise import NoiseRng
from userdp.strategies.optimizers import ServerOptimizer, make_optimizer
from userdp.strategies.samplers import Sampler, bins_for, make_sampler, padding_cap

if TYPE_CHECKING:
    from userdp.config import Config

__all__ = [
    "BUILTIN_STRATEGIES",
    "CONFIG_ARGUMENTS",
    "PluginError",
    "build_strategy",
    "check_strategy",
    "check_strategy_keys",
    "default_delta",
    "server_optimizer",
    "strategy_arguments",
    "strategy_class",
]

BALLS_IN_BINS = ("balls-in-bins-fixed", "balls-in-bins-epoch")

_OMIT = object()
"""A derived argument that does not apply to the config's sampling (the constructor's default
stands; a required one is reported missing)."""


def default_delta(num_users: int) -> float:
    """δ = 1/(10·N) (N training users). A mechanism that publishes each user's data outright with
    probability δ is (0, δ)-DP and reveals δ·N users in expectation: 0.1 here. The papers' δ =
    n^−1.1 (Ponomareva et al., "How to DP-fy ML", arXiv:2303.00654, §5.3.2) reveals N^−0.1 (0.6
    for 174 users), and the report warns about any δ above 1/(10·N)."""
    return 1.0 / (10 * num_users)


def server_optimizer(config: Config) -> ServerOptimizer:
    """The server optimizer of ``strategy.server_optimizer`` / ``server_lr`` / ``momentum``."""
    s = config.strategy
    if s.server_optimizer == "momentum":
        return make_optimizer("sgd", s.server_lr, momentum=s.momentum)
    return make_optimizer(s.server_optimizer, s.server_lr)


@dataclasses.dataclass(frozen=True)
class _Binding:
    """What a constructor argument is made from: the config, N, σ and δ."""

    config: Config
    num_users: int
    noise_multiplier: float
    delta: float

    @property
    def bins(self) -> Any:
        s = self.config.strategy
        if s.sampling == "cyclic-poisson":
            return s.bands
        return bins_for(s.sampling_prob) if s.sampling in BALLS_IN_BINS else _OMIT

    @property
    def epochs(self) -> Any:
        bins = self.bins
        return _OMIT if bins is _OMIT else max(1, math.ceil(self.config.strategy.steps / bins))

    def sampler(self) -> Sampler:
        """The sampler the built-ins build for this config."""
        s = self.config.strategy
        bins = self.bins
        return make_sampler(
            s.sampling,
            sampling_prob=s.sampling_prob,
            bins=bins_for(s.sampling_prob) if bins is _OMIT else bins,
            cohort_cap=padding_cap(s.sampling_prob, self.num_users),
            seed=s.sampler_seed,
        )

    def count_stddev(self) -> float:
        """σ_b of adaptive clipping's noisy count: Andrew et al. suggest ≈ M/20."""
        s = self.config.strategy
        expected = s.expected_cohort_size or s.sampling_prob * self.num_users
        return max(expected / 20.0, 1e-3)


_ARGUMENTS: dict[str, Callable[[_Binding], Any]] = {
    "noise_multiplier": lambda b: b.noise_multiplier,
    "clip_norm": lambda b: b.config.strategy.clip_norm,
    "sampling_prob": lambda b: (
        _OMIT if b.config.strategy.sampling in BALLS_IN_BINS else b.config.strategy.sampling_prob
    ),
    "sampling": lambda b: b.config.strategy.sampling,
    "group_size": lambda b: b.config.strategy.group_size,
    "steps": lambda b: b.config.strategy.steps,
    "num_users": lambda b: b.num_users,
    "seed": lambda b: b.config.strategy.sampler_seed,  # None: a secret seed, never output.seed
    "optimizer": lambda b: server_optimizer(b.config),  # imports torch: made only when named
    "sampler": _Binding.sampler,
    "bins": lambda b: b.bins,
    "epochs": lambda b: b.epochs,
    "cohort_cap": lambda b: (
        padding_cap(b.config.strategy.sampling_prob, b.num_users)
        if b.config.strategy.sampling == "padding"
        else _OMIT
    ),
    "bands": lambda b: b.config.strategy.bands,
    "expected_cohort_size": lambda b: b.config.strategy.expected_cohort_size,
    "expected_batch_size": lambda b: b.config.strategy.expected_batch_size,
    "selection": lambda b: b.config.data.selection,
    "count_stddev": _Binding.count_stddev,
    "probes": lambda b: b.config.strategy.probes,
    "estimator": lambda b: b.config.strategy.estimator,
    "local_steps": lambda b: b.config.strategy.local_steps,
    "local_lr": lambda b: b.config.strategy.local_lr,
    "concentration_threshold": lambda b: b.config.strategy.concentration_threshold,
    "epsilon": lambda b: b.config.privacy.epsilon,
    "delta": lambda b: b.delta,
}
"""How each argument a constructor may name is made, only when it is named."""

CONFIG_ARGUMENTS: tuple[str, ...] = tuple(_ARGUMENTS)
"""The constructor arguments userdp makes from the config (module docstring)."""


def strategy_arguments(
    cls: type[Strategy],
    config: Config,
    num_users: int,
    noise_multiplier: float,
    delta: float,
) -> dict[str, Any]:
    """The keyword arguments ``cls`` gets from ``config`` (module docstring), checked against its
    signature without calling it."""
    s = config.strategy
    name = s.name
    accepted = constructor_parameters(cls)
    if "noise_multiplier" not in accepted:
        raise PluginError(
            f"strategy.name = {name!r}: {cls.__name__}.__init__ must accept noise_multiplier "
            "(userdp calibrates it to the privacy target)"
        )
    check_strategy_keys(cls, s)
    binding = _Binding(config, num_users, noise_multiplier, delta)
    kwargs = {key: make(binding) for key, make in _ARGUMENTS.items() if key in accepted}
    kwargs = {key: value for key, value in kwargs.items() if value is not _OMIT}
    params: Mapping[str, Any] = s.params
    clash = sorted(set(params) & set(kwargs))
    if clash:
        raise PluginError(
            f"strategy.params.{clash[0]}: set by userdp from the config "
            f"({', '.join(sorted(kwargs))}); use the [strategy] key or privacy section"
        )
    kwargs.update(params)
    try:
        inspect.signature(cls).bind(**kwargs)
    except TypeError as exc:
        raise PluginError(f"strategy.params: {cls.__name__}: {exc}") from None
    return kwargs


def check_strategy(config: Config) -> None:
    """Import the config's strategy, apply the rules its class states
    (:func:`~userdp.strategies.catalogue.check_config_rules`) and check its constructor takes the
    arguments userdp would pass (without building it)."""
    cls = strategy_class(config.strategy.name, config.strategy.plugin_path)
    check_config_rules(cls, config.strategy, config.data.selection)
    check_engine(cls, config.strategy)
    strategy_arguments(cls, config, num_users=1000, noise_multiplier=1.0, delta=1e-6)


def build_strategy(
    config: Config,
    num_users: int,
    noise_multiplier: float | Callable[[Mechanism], float],
    delta: float | None = None,
) -> Strategy:
    """The config's strategy for ``num_users`` training users, built once.

    ``noise_multiplier`` is σ, or a calibration that maps the strategy's mechanism value (built at
    σ = 1) to σ; the strategy then takes that σ (:meth:`~userdp.strategies.Strategy.calibrate`),
    and the mechanism it reports must equal the calibrated value, or the build fails rather than
    record one mechanism and run another. δ (``user-wise-filter`` splits it): ``delta``, else
    ``privacy.delta`` or 1/(10·N)."""
    if delta is None:
        delta = config.privacy.delta or default_delta(num_users)
    calibrate = noise_multiplier if callable(noise_multiplier) else None
    sigma = 1.0 if calibrate is not None else float(noise_multiplier)
    cls = strategy_class(config.strategy.name, config.strategy.plugin_path)
    check_config_rules(cls, config.strategy, config.data.selection)
    check_engine(cls, config.strategy)
    kwargs = strategy_arguments(cls, config, num_users, sigma, delta)
    try:
        strategy = cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise PluginError(
            f"strategy.params: {cls.__name__}({', '.join(sorted(kwargs))}) failed: {exc}"
        ) from None
    if calibrate is not None:
        template = strategy.mechanism()
        sigma = calibrate(template)
        strategy.calibrate(sigma)
        calibrated = dataclasses.replace(template, noise_multiplier=sigma)
        if strategy.mechanism().to_dict() != calibrated.to_dict():
            raise PluginError(
                f"strategy.name = {config.strategy.name!r}: {cls.__name__}.mechanism() does not "
                "follow noise_multiplier after calibration; read self.noise_multiplier where the "
                "mechanism and the noise are made"
            )
    _noise_mode(strategy, config)
    return strategy


def _noise_mode(strategy: Strategy, config: Config) -> None:
    """Give the strategy's noise a fresh generator of the mode ``privacy.secure_noise`` asks for
    (the default generator is secure; a deterministic test generator is left alone)."""
    rng = getattr(getattr(strategy, "noise", None), "rng", None)
    secure = config.privacy.secure_noise
    if isinstance(rng, NoiseRng) and rng.secure != secure and not rng.deterministic:
        strategy.noise.rng = NoiseRng(secure=secure)
