"""``UserDPArguments``: the privacy side of a Hugging Face ``Trainer`` run, as a userdp config.

Every value goes through userdp's config schema (:func:`userdp.config.parse_config`), so a
``UserDPTrainer`` accepts and refuses exactly what ``userdp simulate`` does with the same keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from userdp.config import Config, ConfigError, parse_config

__all__ = ["UserDPArguments"]

UNIT_STRATEGIES = {"user": "uls", "example": "els"}
"""The strategy a privacy unit gets when ``strategy`` is not named: user-level sampling (ULS)
for ``unit = "user"``, example-level sampling (ELS, ε at user level) for ``"example"``."""


@dataclass(frozen=True)
class UserDPArguments:
    """What to protect and how, for :class:`userdp.hf.UserDPTrainer`.

    ``unit``: ``"user"`` (ULS: a step samples users, each contributes the mean gradient of
    ``group_size`` of its examples, clipped to ``clip_norm``) or ``"example"`` (ELS: a step samples
    examples among ``group_size`` records per user; ε is still per user). ``strategy`` names any
    registered strategy instead (``"dp-fedavg"``, ``"randomized-clipping"``, a plugin
    ``"module:Class"`` with ``strategy_params``). ``epsilon`` (at ``delta``, default 1/(10·N))
    calibrates σ before step 1; ``noise_multiplier`` sets σ instead. ``steps`` defaults to the
    ``TrainingArguments``' ``max_steps``. ``engine = "randomized"`` estimates norms with
    ``probes`` random probes (randomized clipping). ``strategy_options`` passes any other
    ``[strategy]`` key of the config (``sampler_seed``, ``expected_cohort_size``, ``bands``...).

    The data is the ``Trainer``'s ``train_dataset`` (``user_column`` and ``text_column``, tokenized
    with its ``processing_class``; chat ``messages`` for TRL's ``SFTTrainer``), or ``shards``, a
    folder written by ``userdp shard``."""

    unit: Literal["user", "example"] = "user"
    strategy: str | None = None
    user_column: str = "user_id"
    text_column: str = "text"
    shards: str | None = None
    sampling: str = "poisson"
    sampling_prob: float = 0.05
    group_size: int = 8
    clip_norm: float = 1.0
    epsilon: float = 8.0
    delta: float | None = None
    noise_multiplier: float | None = None
    steps: int | None = None
    engine: Literal["loop", "vectorized", "randomized"] = "vectorized"
    probes: int = 32
    seq_len: int = 128
    selection: str = "random"
    token_budget: int = 8192
    strategy_params: dict[str, Any] = field(default_factory=dict)
    strategy_options: dict[str, Any] = field(default_factory=dict)

    @property
    def strategy_name(self) -> str:
        if self.strategy is not None:
            return self.strategy
        if self.unit not in UNIT_STRATEGIES:
            raise ConfigError(f"privacy.unit = {self.unit!r} is not 'user' or 'example'")
        return UNIT_STRATEGIES[self.unit]

    def to_config(self, shards: str | Path, steps: int, output_dir: str | Path) -> Config:
        """The userdp config of this run (validated by the config schema)."""
        name = self.strategy_name
        strategy: dict[str, Any] = {
            "name": name,
            "sampling": self.sampling,
            "sampling_prob": self.sampling_prob,
            "group_size": self.group_size,
            "clip_norm": self.clip_norm,
            "steps": steps,
            "engine": self.engine,
            "probes": self.probes,
            # the Trainer's optimizer applies the noisy mean (post-processing); the strategy's
            # own server optimizer is not used
            "server_optimizer": "sgd",
            "server_lr": 1.0,
            **self.strategy_options,
        }
        if self.strategy_params:
            strategy["params"] = dict(self.strategy_params)
        privacy: dict[str, Any] = {"epsilon": self.epsilon}
        if self.delta is not None:
            privacy["delta"] = self.delta
        if self.noise_multiplier is not None:
            privacy["noise_multiplier"] = self.noise_multiplier
        return parse_config(
            {
                "data": {
                    "shards": str(shards),
                    "seq_len": self.seq_len,
                    "selection": self.selection,
                    "eval_fraction": 0.0,  # the Trainer's eval_dataset is the held-out set
                },
                "strategy": strategy,
                "privacy": privacy,
                "workers": {"count": 1, "token_budget": self.token_budget},
                "output": {"dir": str(output_dir), "plots": False, "sample_count": 0},
            }
        )
