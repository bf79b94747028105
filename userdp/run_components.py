"""The components of one run, built from its config: data, user split, strategy, ledger, model.

``userdp coordinator``, ``userdp simulate`` and ``userdp train`` all call :func:`prepare_run`, so
a deployment and a simulation of the same config run the same mechanism:

- **data**: ``data.shards``, or the embedded demo corpus (written once into the cache directory).
- **user-level split**: a fixed fraction of USERS (``data.eval_fraction``, by a stable hash of the
  user id) is held out for evaluation and never trained on; the coordinator's population is the
  training users only, so N (and δ = 1/N^1.1 by default) counts training users.
- **strategy**: the config's mechanism; with ``privacy.noise_multiplier`` unset, σ is calibrated
  to (``privacy.epsilon``, δ) for ``strategy.steps`` steps BEFORE step 1 (guaranteed on the
  private side by :func:`userdp.accounting.calibration.calibrate_noise_multiplier`).
- **ledger**: ``<output.dir>/ledger.jsonl`` with the budget ``privacy.epsilon`` at δ; a step that
  would exceed it is refused before release.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

DEMO_VERSION = 1  # bump when the demo corpus or its sharding changes


@dataclass
class RunSetup:
    """Everything the coordinator side of a run needs (no rows: ids and counts only)."""

    config: Any
    shard_dir: Path
    manifest: Any
    train_users: list[str]
    eval_users: list[str]
    population: Any
    delta: float
    strategy: Any
    options: Any
    """The run's :class:`~userdp.strategies.step.ExecutionOptions` (engine, token budget, ...)."""
    trainable: dict[str, torch.Tensor]
    frozen: dict[str, torch.Tensor]

    @property
    def noise_multiplier(self) -> float:
        return float(self.strategy.noise_multiplier)


# ---- data --------------------------------------------------------------------------------------


def cache_root() -> Path:
    return Path(os.environ.get("USERDP_CACHE_DIR") or Path.home() / ".cache" / "userdp")


def demo_shards(num_users: int, quiet: bool = True) -> Path:
    """Shards of the embedded demo corpus with ``num_users`` users (written once, then reused;
    the directory is written to a temporary name and renamed, so a crash leaves nothing half
    written)."""
    from userdp.demo_data import demo_corpus
    from userdp.shard_input import InputSource
    from userdp.shard_writer import ShardOptions, write_shards

    target = cache_root() / f"demo-v{DEMO_VERSION}-{num_users}users"
    if (target / "manifest.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    name = f"userdp-demo-{num_users}users"
    source = InputSource.from_table(demo_corpus(num_users), "user_id", "text", name)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    write_shards(source, tmp, ShardOptions(num_shards=4, tokenizer="byte", progress=not quiet))
    try:
        tmp.rename(target)
    except OSError:  # another process won the race: use its copy
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


def shard_directory(config: Any, quiet: bool = True) -> Path:
    if config.data.shards:
        path = Path(config.data.shards)
        if not (path / "manifest.json").is_file():
            raise ValueError(f"data.shards = {str(path)!r} has no manifest.json (see userdp shard)")
        return path
    return demo_shards(config.data.demo_users, quiet=quiet)


def split_users(users: list[str], eval_fraction: float) -> tuple[list[str], list[str]]:
    """(train, eval) by a stable hash of each user id: the same users are held out in every run
    and on every machine. At least one user is held out when ``eval_fraction`` > 0 and there
    are two or more users."""
    if eval_fraction <= 0:
        return list(users), []

    def position(user: str) -> float:
        digest = hashlib.sha256(b"userdp-eval-split\0" + user.encode("utf-8")).digest()
        return int.from_bytes(digest[:8], "big") / 2**64

    ranked = sorted(users, key=position)
    held = [u for u in ranked if position(u) < eval_fraction]
    if not held and len(users) >= 2:
        held = ranked[:1]
    held_set = set(held)
    return [u for u in users if u not in held_set], held


# ---- strategy ----------------------------------------------------------------------------------


def server_optimizer(config: Any) -> Any:
    """The server optimizer of ``strategy.server_optimizer`` / ``server_lr`` / ``momentum``."""
    from userdp.strategies.optimizers import make_optimizer

    s = config.strategy
    if s.server_optimizer == "momentum":
        return make_optimizer("sgd", s.server_lr, momentum=s.momentum)
    return make_optimizer(s.server_optimizer, s.server_lr)


def _bins(q: float, steps: int) -> tuple[int, int]:
    from userdp.strategies.samplers import bins_for

    bins = bins_for(q)
    return bins, max(1, math.ceil(steps / bins))


def execution_options(config: Any) -> Any:
    """The task options of the config that do not change the mechanism."""
    from userdp.strategies.step import ExecutionOptions

    return ExecutionOptions(
        engine=None if config.strategy.engine == "randomized" else config.strategy.engine,
        token_budget=config.workers.token_budget,
        selection=config.data.selection,
        seq_len=config.data.seq_len,
    )


def make_strategy(config: Any, num_users: int, noise_multiplier: float) -> Any:
    """The strategy of ``config.strategy`` with noise multiplier σ (see the module docstring):
    a built-in, or a plugin named ``"package.module:ClassName"`` (:mod:`userdp.plugins`)."""
    from userdp.config import BUILTIN_STRATEGIES
    from userdp.strategies import builtins
    from userdp.strategies.adaptive_clipping import AdaptiveClipping
    from userdp.strategies.dpftrl import BltDpFtrl

    s = config.strategy
    if s.engine == "randomized" and s.name != "randomized-clipping":
        raise ValueError(
            "strategy.engine = 'randomized' estimates norms, which needs its own accountant: "
            "set strategy.name = 'randomized-clipping' (or use engine 'vectorized' / 'loop'; a "
            "plugin that estimates norms sets engine='randomized' in its configure_task)"
        )
    if s.name not in BUILTIN_STRATEGIES:
        from userdp.plugins import build_plugin

        return _noise_mode(build_plugin(config, num_users, noise_multiplier), config)
    common: dict[str, Any] = {
        "noise_multiplier": noise_multiplier,
        "clip_norm": s.clip_norm,
        "seed": s.sampler_seed,  # None: a secret seed (os.urandom), never output.seed
        "optimizer": server_optimizer(config),
    }
    uls: dict[str, Any] = dict(common, group_size=s.group_size, sampling=s.sampling)
    if s.expected_cohort_size is not None:
        uls.update(expected_cohort_size=s.expected_cohort_size)
    if s.sampling in ("balls-in-bins-fixed", "balls-in-bins-epoch"):
        bins, epochs = _bins(s.sampling_prob, s.steps)
        uls.update(bins=bins, epochs=epochs)
    else:
        uls.update(sampling_prob=s.sampling_prob)
    if s.sampling == "padding":  # Poisson, truncated/padded to a cap 4 std above qN
        from userdp.strategies.samplers import padding_cap

        uls.update(cohort_cap=padding_cap(s.sampling_prob, num_users))

    def poisson_only(name: str) -> None:
        if s.sampling != "poisson":
            raise ValueError(
                f"strategy.name = {name!r} supports strategy.sampling = 'poisson' only, "
                f"got {s.sampling!r}"
            )

    if s.name == "uls":
        strategy = builtins.UserLevelSampling(**uls)
    elif s.name in ("els", "group-privacy"):
        poisson_only(s.name)
        cls = builtins.ExampleLevelSampling if s.name == "els" else builtins.GroupPrivacyComparison
        strategy = cls(
            sampling_prob=s.sampling_prob,
            group_size=s.group_size,
            expected_batch_size=s.expected_batch_size,
            **common,
        )
    elif s.name == "dp-fedavg":
        strategy = builtins.DpFedAvg(local_steps=s.local_steps, local_lr=s.local_lr, **uls)
    elif s.name == "adaptive-clipping":
        poisson_only(s.name)
        uls.pop("clip_norm")
        expected = s.expected_cohort_size or s.sampling_prob * num_users
        strategy = AdaptiveClipping(
            initial_clip_norm=s.clip_norm, count_stddev=max(expected / 20.0, 1e-3), **uls
        )
    elif s.name == "randomized-clipping":
        poisson_only(s.name)
        strategy = builtins.RandomizedClipping(probes=s.probes, estimator=s.estimator, **uls)
    elif s.name == "blt-dp-ftrl" and s.sampling == "cyclic-poisson":
        if s.bands is None:
            raise ValueError(
                "strategy.sampling = 'cyclic-poisson' needs strategy.bands (b̂: user groups "
                "and bands of C)"
            )
        strategy = BltDpFtrl(
            bins=s.bands,
            epochs=max(1, math.ceil(s.steps / s.bands)),
            bands=s.bands,
            sampling_prob=s.sampling_prob,
            expected_cohort_size=s.expected_cohort_size,
            **common,
        )
    elif s.name == "blt-dp-ftrl":
        if s.sampling != "balls-in-bins-fixed":
            raise ValueError(
                "strategy.name = 'blt-dp-ftrl' needs strategy.sampling = 'balls-in-bins-fixed' "
                "(bins fixed for the run, as its Monte Carlo accountant assumes) or "
                "'cyclic-poisson' with strategy.bands (banded C)"
            )
        bins, epochs = _bins(s.sampling_prob, s.steps)
        strategy = BltDpFtrl(
            bins=bins, epochs=epochs, expected_cohort_size=s.expected_cohort_size, **common
        )
    elif s.name == "user-wise-filter":
        from userdp.strategies.user_filter import UserWiseFilter

        common.pop("seed")  # every user in every step: no sampler randomness
        strategy = UserWiseFilter(
            concentration_threshold=s.concentration_threshold,
            epsilon=config.privacy.epsilon,
            delta=config.privacy.delta or default_delta(num_users),
            steps=s.steps,
            group_size=s.group_size,
            **common,
        )
    else:  # the config schema admits only the names above
        raise ValueError(f"unknown strategy.name {s.name!r}")
    return _noise_mode(strategy, config)


def _noise_mode(strategy: Any, config: Any) -> Any:
    """Give the strategy's noise a fresh generator of the mode ``privacy.secure_noise`` asks for
    (the default generator is secure; a deterministic test generator is left alone)."""
    from userdp.strategies.noise import NoiseRng

    rng = getattr(getattr(strategy, "noise", None), "rng", None)
    secure = config.privacy.secure_noise
    if isinstance(rng, NoiseRng) and rng.secure != secure and not rng.deterministic:
        strategy.noise.rng = NoiseRng(secure=secure)
    return strategy


def resolve_noise_multiplier(config: Any, num_users: int, delta: float) -> float:
    """``privacy.noise_multiplier``, or σ calibrated to (ε, δ) over ``strategy.steps`` steps."""
    if config.privacy.noise_multiplier is not None:
        return float(config.privacy.noise_multiplier)
    from userdp.accounting.calibration import calibrate_noise_multiplier

    template = make_strategy(config, num_users, 1.0).mechanism()  # σ is the only free field
    log.info(
        "calibrating sigma for epsilon=%g, delta=%.3g, %d steps (%s)",
        config.privacy.epsilon,
        delta,
        config.strategy.steps,
        template.to_dict().get("kind"),
    )
    return calibrate_noise_multiplier(
        template, config.privacy.epsilon, delta, config.strategy.steps
    )


# ---- setup -------------------------------------------------------------------------------------


def strategy_from_config(config: Any, num_users: int) -> tuple[Any, Any, float]:
    """(strategy, execution options, δ) of ``config`` for ``num_users`` training users: δ =
    ``privacy.delta`` or 1/N^1.1, σ = ``privacy.noise_multiplier`` or calibrated to ε."""
    delta = config.privacy.delta or default_delta(num_users)
    sigma = resolve_noise_multiplier(config, num_users, delta)
    return make_strategy(config, num_users, sigma), execution_options(config), delta


def default_delta(num_users: int) -> float:
    """δ = 1/N^1.1 (N training users): below 1/N, so no single user can be revealed outright."""
    return 1.0 / num_users**1.1


def prepare_run(config: Any, quiet: bool = True) -> RunSetup:
    """Data, user split, population, δ, calibrated strategy and initial model of ``config``."""
    from userdp.clients.model import build_model, model_shape, split_parameters
    from userdp.clients.shard_format import file_sha256
    from userdp.clients.shard_store import ShardStore
    from userdp.server.population import Population

    shard_dir = shard_directory(config, quiet=quiet)
    with ShardStore(shard_dir) as store:
        counts = store.user_counts()
        manifest = store.manifest
    train, held = split_users(list(counts), config.data.eval_fraction)
    if not train:
        raise ValueError(f"no training users in {shard_dir} (eval_fraction takes them all)")
    train_set = set(train)
    full = Population.from_manifest(manifest)
    population = Population(
        shard_of_user={u: s for u, s in full.shard_of_user.items() if u in train_set},
        shard_sha256=full.shard_sha256,
        examples_of_user={u: counts[u].n_examples for u in train},
        manifest_sha256=file_sha256(shard_dir / "manifest.json"),
    )
    strategy, options, delta = strategy_from_config(config, len(train))
    model = build_model(
        config.model, model_shape(manifest, config.data.seq_len), config.output.seed
    )
    trainable, frozen = split_parameters(model)
    return RunSetup(
        config=config,
        shard_dir=shard_dir,
        manifest=manifest,
        train_users=train,
        eval_users=held,
        population=population,
        delta=delta,
        strategy=strategy,
        options=options,
        trainable=trainable,
        frozen=frozen,
    )


def open_ledger(setup: RunSetup, out: Path) -> Any:
    """``<out>/ledger.jsonl`` with the budget ``privacy.epsilon`` at the run's δ (resumes an
    existing ledger; its header must agree)."""
    from userdp.accounting.ledger import Ledger

    return Ledger.open(
        out / "ledger.jsonl",
        create=True,
        budget_epsilon=setup.config.privacy.epsilon,
        delta=setup.delta,
    )
