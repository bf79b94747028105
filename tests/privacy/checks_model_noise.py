"""Noise must reach EVERY trainable tensor of a real model (full fine-tuning and LoRA).

The model is userdp's own builder (``userdp.clients.model.build_model``, preset ``gpt2-tiny``, a
small vocabulary); its trainable tensors (``split_parameters``) go through the real ULS strategy
in the reference step loop as torch tensors. Half of the tensors receive a known non-zero clipped
sum, the other half exactly zero — as LoRA's A matrices do at initialization (B = 0, so
∂L/∂A = 0) and as layers outside a user's tokens do. Each tensor's released update minus its
known signal must be N(0, (lr·σ·C/E)²) (exact χ² test per tensor, Bonferroni over tensors).
"""

from __future__ import annotations

import functools
import math

import torch
from userdp.clients.model import ModelShape, build_model, split_parameters
from userdp.strategies.local_step import run_local_step
from userdp.strategies.unit_stats import UnitStats

from userdp.config import ModelConfig

from .checks_noise import CLIP, LR, SIGMA, expected_cohort, make_strategy, step_with_cohort_gap
from .checks_noise import user_ids as population
from .stats import ALPHA, assert_gaussian_noise

SHAPE = ModelShape(vocab_size=97, seq_len=16, pad_id=0, eos_id=1)


@functools.lru_cache(maxsize=2)
def trainable_tensors(lora_rank: int) -> tuple[tuple[str, torch.Tensor], ...]:
    model = build_model(ModelConfig(preset="gpt2-tiny", lora_rank=lora_rank), SHAPE, seed=0)
    trainable, frozen = split_parameters(model)
    if lora_rank:
        assert trainable and all("lora_" in name for name in trainable), "LoRA split is wrong"
        assert frozen, "LoRA run without frozen base weights"
    return tuple(trainable.items())


def unit_contribution(params: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per-unit clipped update: a constant on LoRA's B matrices (full model: every other tensor
    in name order), exactly zero on the rest; its norm is C/2 (already clipped)."""
    signal = [n for n in params if "lora_B" in n] or sorted(params)[::2]
    numel = sum(params[n].numel() for n in signal)
    value = 0.5 * CLIP / math.sqrt(numel)
    return {n: (value if n in signal else 0.0) for n in params}


def check_noise_on_every_trainable_tensor(lora_rank: int = 4) -> None:
    """Every trainable tensor — including those whose clipped sum is exactly zero — moves by
    noise of the mechanism's std; with LoRA, every adapter matrix (A and B) does."""
    params = {name: value.clone() for name, value in trainable_tensors(lora_rank)}
    names = list(params)
    per_unit = unit_contribution(params)

    def compute(task, unit_ids, current):
        sums = {n: torch.full_like(current[n], per_unit[n] * len(unit_ids)) for n in current}
        return sums, UnitStats(count=len(unit_ids))

    strategy = make_strategy("uls")
    pop = population()
    step, realized = step_with_cohort_gap(make_strategy("uls"), pop)
    before = {n: p.clone() for n, p in params.items()}
    record = run_local_step(strategy, step, params, pop, compute)
    assert record.units == realized
    expected = expected_cohort("uls")
    std = LR * SIGMA * CLIP / expected
    for name in names:
        update = (before[name] - params[name]).double()
        noise = update - LR * per_unit[name] * realized / expected
        kind = "zero-sum" if per_unit[name] == 0.0 else "non-zero-sum"
        assert_gaussian_noise(
            noise.numpy(),
            std,
            f"trainable tensor {name!r} ({kind}, {noise.numel()} values, lora_rank={lora_rank})",
            ALPHA / len(names),
        )
