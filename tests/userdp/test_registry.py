"""The strategy registry: built-ins and plugins are found, bound and built by the same code; σ is
calibrated on the mechanism value of the one strategy built."""

from __future__ import annotations

import dataclasses
import functools

import pytest
from userdp.strategies.builtins import UserLevelSampling

from userdp.config import ConfigError, parse_config
from userdp.run import components, registry
from userdp.run.registry import (
    BUILTIN_STRATEGIES,
    CONFIG_ARGUMENTS,
    PluginError,
    build_strategy,
    strategy_class,
)

USERS = 300


def config_of(folder, name: str, **strategy):
    """A config of ``name`` at q = 0.1 with a given sampler seed (comparable cohorts), σ = 1.3, and
    a plugin imported from ``folder``."""
    config = parse_config(
        {
            "strategy": {"name": name, "sampling_prob": 0.1, "sampler_seed": 7, **strategy},
            "privacy": {"noise_multiplier": 1.3},
        }
    )
    if name in BUILTIN_STRATEGIES:
        return config
    strategy_config = config.strategy.model_copy(update={"plugin_path": str(folder)})
    return config.model_copy(update={"strategy": strategy_config})


def described(strategy) -> dict:
    """What a run does with a strategy: its mechanism, sampler, task, normalizer, optimizer and
    cohorts, as plain values."""
    users = [f"u{i:03d}" for i in range(USERS)]
    return {
        "class": type(strategy),
        "mechanism": strategy.mechanism().to_dict(),
        "sampler": strategy.sampler.state_dict(),
        "task": dataclasses.asdict(strategy.configure_task(0, strategy.sample_cohort(0, users))),
        "normalizer": strategy.expected_cohort_size(users),
        "optimizer": (type(strategy.optimizer).__name__, vars(strategy.optimizer)),
        "cohorts": [strategy.sample_cohort(step, users).unit_ids for step in range(4)],
        "facts": strategy.facts(),
    }


def test_a_plugin_and_a_builtin_with_the_same_arguments_are_the_same_strategy(
    tmp_path, monkeypatch
) -> None:
    """A plugin naming the ULS class is built by the code that builds the built-in ``uls``: the
    same binding of config to constructor arguments, and an identical strategy."""
    (tmp_path / "same_uls.py").write_text(
        "from userdp.strategies.builtins import UserLevelSampling as SameUls\n"
    )
    bound = []
    real = registry.strategy_arguments

    def spy(cls, config, num_users, noise_multiplier, delta):
        kwargs = real(cls, config, num_users, noise_multiplier, delta)
        bound.append((cls, {k: v for k, v in kwargs.items() if k != "optimizer"}))
        return kwargs

    monkeypatch.setattr(registry, "strategy_arguments", spy)
    builtin = build_strategy(config_of(tmp_path, "uls", group_size=4), USERS, 1.3)
    plugin = build_strategy(config_of(tmp_path, "same_uls:SameUls", group_size=4), USERS, 1.3)
    assert [cls for cls, _ in bound] == [UserLevelSampling, UserLevelSampling]
    assert bound[0][1] == bound[1][1]
    assert described(plugin) == described(builtin)


def test_every_builtin_is_a_module_class_path_the_plugin_loader_resolves() -> None:
    for name, target in BUILTIN_STRATEGIES.items():
        module, _, cls = target.partition(":")
        assert strategy_class(name) is strategy_class(target)
        assert strategy_class(name).__module__ == module and strategy_class(name).__name__ == cls


def test_calibration_builds_the_strategy_once_and_records_what_it_calibrated(
    monkeypatch, tmp_path
) -> None:
    """With ``privacy.noise_multiplier`` unset, σ is calibrated on the mechanism value of the
    strategy built (σ replaced, nothing rebuilt), and the built strategy reports that mechanism."""
    built = []
    real_init = UserLevelSampling.__init__

    @functools.wraps(real_init)  # the registry reads the constructor's signature
    def counted(self, **kwargs):
        built.append(kwargs["noise_multiplier"])
        real_init(self, **kwargs)

    monkeypatch.setattr(UserLevelSampling, "__init__", counted)
    calibrated = []

    def calibrate(template, target_epsilon, delta, steps, **options):
        calibrated.append(template)
        return 2.5

    monkeypatch.setattr(components.calibration, "calibrate_noise_multiplier", calibrate)
    config = parse_config({"strategy": {"name": "uls", "sampling_prob": 0.1, "steps": 20}})
    strategy, _, _ = components.strategy_from_config(config, USERS)
    assert len(built) == 1, f"the strategy was built {len(built)} times"
    assert len(calibrated) == 1 and calibrated[0].sampling_prob == 0.1
    assert strategy.noise_multiplier == 2.5
    assert strategy.mechanism() == dataclasses.replace(calibrated[0], noise_multiplier=2.5)


def test_a_strategy_whose_mechanism_ignores_its_calibrated_sigma_is_refused(tmp_path) -> None:
    (tmp_path / "stale.py").write_text(
        "from userdp.accounting.mechanisms import UlsMechanism\n"
        "from userdp.strategies import Strategy\n"
        "from userdp.strategies.samplers import PoissonSampler\n\n\n"
        "class Stale(Strategy):\n"
        "    def __init__(self, *, noise_multiplier, clip_norm, sampling_prob):\n"
        "        super().__init__(noise_multiplier=noise_multiplier, clip_norm=clip_norm,\n"
        "                         sampler=PoissonSampler(sampling_prob))\n"
        "        self.frozen = UlsMechanism(noise_multiplier, sampling_prob)\n\n"
        "    def mechanism(self):\n"
        "        return self.frozen\n"
    )
    config = config_of(tmp_path, "stale:Stale")
    with pytest.raises(PluginError, match="does not follow noise_multiplier"):
        build_strategy(config, USERS, lambda template: 2.0)
    assert build_strategy(config, USERS, 2.0).mechanism().noise_multiplier == 2.0


@pytest.mark.parametrize(
    "name, strategy, message",
    [
        (
            "els",
            {"sampling": "balls-in-bins-epoch"},
            "strategy.name = 'els' supports strategy.sampling = 'poisson' only",
        ),
        (
            "blt-dp-ftrl",
            {"sampling": "poisson"},
            "supports strategy.sampling = 'balls-in-bins-fixed' or 'cyclic-poisson' only",
        ),
        (
            "els",
            {"expected_cohort_size": 10.0},
            "strategy.expected_cohort_size is set, but strategy.name = 'els'",
        ),
        (
            "uls",
            {"expected_batch_size": 10.0},
            "strategy.expected_batch_size is set, but strategy.name = 'uls'",
        ),
    ],
)
def test_a_key_the_strategy_cannot_honour_is_refused_not_ignored(name, strategy, message) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config({"strategy": {"name": name, **strategy}})


def test_a_plugin_gets_set_keys_it_takes_and_is_refused_ones_it_does_not(tmp_path) -> None:
    (tmp_path / "normalized.py").write_text(
        "from userdp.strategies.builtins import UserLevelSampling\n\n\n"
        "class Normalized(UserLevelSampling):\n"
        "    pass\n\n\n"
        "class Plain(UserLevelSampling):\n"
        "    def __init__(self, *, noise_multiplier, clip_norm, sampling_prob):\n"
        "        super().__init__(noise_multiplier=noise_multiplier, clip_norm=clip_norm,\n"
        "                         sampling_prob=sampling_prob)\n"
    )
    taken = config_of(tmp_path, "normalized:Normalized", expected_cohort_size=25.0)
    assert build_strategy(taken, USERS, 1.0).expected_cohort_size(["u"] * USERS) == 25.0
    refused = config_of(tmp_path, "normalized:Plain", expected_cohort_size=25.0)
    with pytest.raises(PluginError, match="expected_cohort_size is set, but .* does not take it"):
        build_strategy(refused, USERS, 1.0)


@pytest.mark.parametrize("sampling", ["poisson", "padding", "balls-in-bins-fixed"])
def test_every_documented_argument_is_made_from_a_config(sampling) -> None:
    """Each name in CONFIG_ARGUMENTS is made (or left to the constructor's default) for a config
    of each scheme; the balls-in-bins schemes get bins and epochs instead of q."""
    config = parse_config({"strategy": {"sampling": sampling, "steps": 45}})
    made = registry.strategy_arguments(registry.strategy_class("uls"), config, USERS, 1.0, 1e-6)
    assert set(made) <= set(CONFIG_ARGUMENTS)
    if sampling == "balls-in-bins-fixed":
        assert "sampling_prob" not in made and (made["bins"], made["epochs"]) == (20, 3)
    else:
        assert made["sampling_prob"] == 0.05 and "bins" not in made
    assert ("cohort_cap" in made) == (sampling == "padding")


@pytest.mark.parametrize("users", [1, 174, 356, 10_000, 10**9])
def test_the_default_delta_draws_no_caveat_of_the_report(users) -> None:
    # The report warns when δ > 1/(10·N); the default must not be a value the project warns about
    # (the papers' n^−1.1 would be, for every N below 10^10).
    from userdp.accounting.report import delta_caveat

    assert delta_caveat(registry.default_delta(users), users) is None
    assert delta_caveat(users**-1.1, users) is not None
