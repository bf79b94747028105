"""The components of one run, built from its config: data, user split, strategy, ledger, model.

``userdp coordinator``, ``userdp simulate`` and ``userdp train`` all call :func:`prepare_run`, so
a deployment and a simulation of the same config run the same mechanism:

- **data**: ``data.shards``, or the embedded demo corpus (written once into the cache directory).
- **user-level split**: a fixed fraction of USERS (``data.eval_fraction``, by a stable hash of the
  user id) is held out for evaluation and never trained on; the coordinator's population is the
  training users only, so N (and δ = 1/(10·N) by default) counts training users.
- **strategy**: the config's mechanism; with ``privacy.noise_multiplier`` unset, σ is calibrated
  to (``privacy.epsilon``, δ) for ``strategy.steps`` steps BEFORE step 1 (guaranteed on the
  private side by :func:`userdp.accounting.calibration.calibrate_noise_multiplier`).
- **ledger**: ``<output.dir>/ledger.jsonl`` with the budget ``privacy.epsilon`` at δ; a step that
  would exceed it is refused before release.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from userdp.accounting import calibration
from userdp.accounting.durable import publish_directory
from userdp.accounting.ledger import Ledger
from userdp.accounting.mechanisms import Mechanism
from userdp.clients.model import build_model, model_shape, split_parameters
from userdp.clients.shard_format import Manifest, file_sha256
from userdp.clients.shard_store import ShardStore
from userdp.config import Config
from userdp.run.registry import build_strategy, default_delta
from userdp.server.population import Population
from userdp.shards.demo import DEMO_NUM_SHARDS, demo_corpus
from userdp.shards.input import InputSource
from userdp.shards.writer import ShardOptions, write_shards
from userdp.strategies.base import Strategy
from userdp.strategies.step import ExecutionOptions

log = logging.getLogger(__name__)

DEMO_VERSION = 1  # bump when the demo corpus or its sharding changes


class NoTargetTokensError(ValueError):
    """The run's data gives a step no target token to train on (the CLI exits 2)."""


@dataclass
class RunSetup:
    """Everything the coordinator side of a run needs (no rows: ids and counts only)."""

    config: Config
    shard_dir: Path
    manifest: Manifest
    train_users: list[str]
    eval_users: list[str]
    population: Population
    delta: float
    strategy: Strategy
    options: ExecutionOptions
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

    target = cache_root() / f"demo-v{DEMO_VERSION}-{num_users}users"
    if (target / "manifest.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    name = f"userdp-demo-{num_users}users"
    source = InputSource.from_table(demo_corpus(num_users), "user_id", "text", name)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    write_shards(
        source, tmp, ShardOptions(num_shards=DEMO_NUM_SHARDS, tokenizer="byte", progress=not quiet)
    )
    try:
        publish_directory(tmp, target)
    except OSError:  # another process won the race: use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def shard_directory(config: Config, quiet: bool = True) -> Path:
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


def execution_options(config: Config) -> ExecutionOptions:
    """The task options of the config that do not change the mechanism."""
    return ExecutionOptions(
        engine=None if config.strategy.engine == "randomized" else config.strategy.engine,
        token_budget=config.workers.token_budget,
        selection=config.data.selection,
        seq_len=config.data.seq_len,
    )


def calibrator(config: Config, delta: float) -> Callable[[Mechanism], float]:
    """σ of a mechanism value calibrated to (``privacy.epsilon``, δ) over ``strategy.steps``
    steps: the mechanism's σ is replaced, nothing else is rebuilt."""

    def calibrate(template: Mechanism) -> float:
        log.info(
            "calibrating sigma for epsilon=%g, delta=%.3g, %d steps (%s)",
            config.privacy.epsilon,
            delta,
            config.strategy.steps,
            template.to_dict().get("kind"),
        )
        return calibration.calibrate_noise_multiplier(
            template, config.privacy.epsilon, delta, config.strategy.steps
        )

    return calibrate


# ---- setup -------------------------------------------------------------------------------------


def strategy_from_config(
    config: Config, num_users: int
) -> tuple[Strategy, ExecutionOptions, float]:
    """(strategy, execution options, δ) of ``config`` for ``num_users`` training users: δ =
    ``privacy.delta`` or 1/(10·N), σ = ``privacy.noise_multiplier`` or calibrated to ε on the
    strategy's mechanism value (the strategy is built once)."""
    delta = config.privacy.delta or default_delta(num_users)
    sigma = config.privacy.noise_multiplier
    strategy = build_strategy(
        config, num_users, calibrator(config, delta) if sigma is None else sigma, delta
    )
    return strategy, execution_options(config), delta


@dataclass(frozen=True)
class TrainingData:
    """A run's shards split into training and held-out users, and the training population."""

    shard_dir: Path
    manifest: Manifest
    train_users: list[str]
    eval_users: list[str]
    population: Population


def training_data(config: Config, quiet: bool = True) -> TrainingData:
    """The shards of ``config``, the user split and the population the sampler draws from;
    refused when no training user has a target token."""
    shard_dir = shard_directory(config, quiet=quiet)
    with ShardStore(shard_dir) as store:
        counts = store.user_counts()
        manifest = store.manifest
    train, held = split_users(list(counts), config.data.eval_fraction)
    if not train:
        raise ValueError(f"no training users in {shard_dir} (eval_fraction takes them all)")
    if not any(counts[u].n_tokens > counts[u].n_examples for u in train):
        raise NoTargetTokensError(
            f"no training user in {shard_dir} has an example of 2 or more tokens: every step "
            "would spend budget and train on no token (a causal LM's first token is never a "
            "target); shard examples of 2 or more tokens"
        )
    train_set = set(train)
    full = Population.from_manifest(manifest)
    population = Population(
        shard_of_user={u: s for u, s in full.shard_of_user.items() if u in train_set},
        shard_sha256=full.shard_sha256,
        examples_of_user={u: counts[u].n_examples for u in train},
        manifest_sha256=file_sha256(shard_dir / "manifest.json"),
    )
    return TrainingData(shard_dir, manifest, train, held, population)


def prepare_run(config: Config, quiet: bool = True) -> RunSetup:
    """Data, user split, population, δ, calibrated strategy and initial model of ``config``."""
    data = training_data(config, quiet=quiet)
    strategy, options, delta = strategy_from_config(config, len(data.train_users))
    model = build_model(
        config.model, model_shape(data.manifest, config.data.seq_len), config.output.seed
    )
    trainable, frozen = split_parameters(model)
    return RunSetup(
        config=config,
        shard_dir=data.shard_dir,
        manifest=data.manifest,
        train_users=data.train_users,
        eval_users=data.eval_users,
        population=data.population,
        delta=delta,
        strategy=strategy,
        options=options,
        trainable=trainable,
        frozen=frozen,
    )


def open_ledger(setup: RunSetup, out: Path) -> Ledger:
    """``<out>/ledger.jsonl`` with the budget ``privacy.epsilon`` at the run's δ (resumes an
    existing ledger; its header must agree)."""

    return Ledger.open(
        out / "ledger.jsonl",
        create=True,
        budget_epsilon=setup.config.privacy.epsilon,
        delta=setup.delta,
    )
