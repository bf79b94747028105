"""The privacy checks run through Hugging Face's Trainer (``userdp.hf.UserDPTrainer``): the
cohorts its steps train on are the strategy's Poisson samples at the ledger's q, the update its
optimizer receives carries noise of std σ·C/E (E the EXPECTED cohort), and each step is in the
ledger on disk before the optimizer applies it. A tiny GPT-2 and a 40-user dataset built offline
(tests/userdp/hf_fixtures.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from tests.userdp.hf_fixtures import tiny_model, tiny_tokenizer, trainer_args, user_dataset
from userdp.hf import UserDPArguments, UserDPTrainer

from .checks_sampling import assert_poisson_cohorts
from .stats import assert_gaussian_noise

USERS = 40
Q = 0.25
SIGMA = 1.3
CLIP = 0.5
SAMPLER_SEED = 1  # step 0 draws 15 users: 50 % above E = qN = 10
SAMPLING_STEPS = 16


class _Watch(TrainerCallback):
    """At each optimizer step: the gradient handed to it, the step records on disk, the cohort."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.gradients: list[dict[str, torch.Tensor]] = []
        self.charged_on_disk: list[list[int]] = []
        self.cohorts: list[tuple[str, ...]] = []

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = self.trainer.model
        self.gradients.append(
            {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        )
        lines = (Path(args.output_dir) / "ledger.jsonl").read_text().splitlines()
        self.charged_on_disk.append(
            [r["step"] for r in map(json.loads, lines) if r["type"] == "step"]
        )
        self.cohorts.append(self.trainer.private.last.cohort)


def _train(out: Path, steps: int, *, noise: bool = True) -> tuple[UserDPTrainer, _Watch]:
    tokenizer = tiny_tokenizer()
    trainer = UserDPTrainer(
        model=tiny_model(tokenizer, seed=0),
        args=trainer_args(out, steps, logging_steps=10_000),
        train_dataset=user_dataset(USERS),
        processing_class=tokenizer,
        privacy=UserDPArguments(
            sampling_prob=Q,
            group_size=2,
            clip_norm=CLIP,
            noise_multiplier=SIGMA,
            seq_len=16,
            engine="loop",
            strategy_options={"sampler_seed": SAMPLER_SEED},
        ),
    )
    trainer.test_only_disable_noise = not noise
    watch = _Watch(trainer)
    trainer.add_callback(watch)
    trainer.train()
    return trainer, watch


def check_trainer_samples_poisson_cohorts_at_the_ledgers_q(tmp_path: Path) -> None:
    """16 Trainer steps over 40 users: the units each step trained on are Poisson samples at the
    q of the ledger's mechanism (rate, per-user freshness, cohort-size dispersion)."""
    trainer, watch = _train(Path(tmp_path) / "sampling", SAMPLING_STEPS)
    lines = (Path(tmp_path) / "sampling" / "ledger.jsonl").read_text().splitlines()
    q = {r["mechanism"]["sampling_prob"] for r in map(json.loads, lines) if r["type"] == "step"}
    assert len(q) == 1, f"the ledger charges several rates {q}"
    users = sorted(trainer.private.data.train_users)
    assert len(users) == USERS
    assert_poisson_cohorts(watch.cohorts, users, q.pop(), "UserDPTrainer")


def check_trainer_update_carries_the_calibrated_noise(tmp_path: Path) -> None:
    """Step 0 through the Trainer twice, noiseless and noisy (same model, same cohort): their
    difference in the gradient the Trainer's optimizer receives is N(0, (σ·C/E)²) per coordinate,
    E = qN the expected cohort; the step's realized cohort is ≥ 30 % off E."""
    _, clean = _train(Path(tmp_path) / "clean", 1, noise=False)
    _, noisy = _train(Path(tmp_path) / "noisy", 1)
    realized, expected = len(noisy.cohorts[0]), Q * USERS
    assert clean.cohorts == noisy.cohorts, "the two runs trained on different cohorts"
    assert abs(realized - expected) >= 0.3 * expected, (
        f"the check needs a step whose cohort ({realized}) is ≥ 30 % off E = {expected:g}"
    )
    names = sorted(clean.gradients[0])
    assert names == sorted(noisy.gradients[0]), "the two runs updated different tensors"
    noise = np.concatenate(
        [(noisy.gradients[0][n] - clean.gradients[0][n]).double().numpy().ravel() for n in names]
    )
    assert_gaussian_noise(
        noise,
        SIGMA * CLIP / expected,
        f"UserDPTrainer step 0: gradient = (Σclip + σ·C·z)/E with E = {expected:g} expected "
        f"units ({realized} realized)",
    )


def check_trainer_charges_each_step_before_its_optimizer_step(tmp_path: Path) -> None:
    """At every optimizer step of the Trainer, the ledger file on disk already holds that step
    (fsync'd by the append), and no later one."""
    _, watch = _train(Path(tmp_path) / "ledger", 3)
    for step, charged in enumerate(watch.charged_on_disk):
        assert charged == list(range(step + 1)), (
            f"ledger before release: when the Trainer's optimizer applied step {step} the ledger "
            f"on disk charged steps {charged}, not 0..{step}"
        )
