"""What ``UserDPTrainer`` refuses, each in one line naming what to change: a ``Trainer`` setting
that would break the guarantee or make its ε mean something else."""

from __future__ import annotations

from typing import Any

__all__ = ["TrainerSettingError", "refusals"]


class TrainerSettingError(ValueError):
    """A ``TrainingArguments`` value or ``Trainer`` component userdp cannot run under."""


def refusals(args: Any, data_collator: Any) -> list[str]:
    """One line per refused setting of ``args`` (``TrainingArguments`` or TRL's ``SFTConfig``)
    and ``data_collator``; empty when there is none."""
    problems = []
    if args.max_grad_norm not in (None, 0, 0.0):
        problems.append(
            f"max_grad_norm = {args.max_grad_norm:g} would clip the noisy mean again after userdp "
            "clipped each unit at privacy.clip_norm (the bound the noise is calibrated to); set "
            "max_grad_norm=0 in the TrainingArguments"
        )
    if args.gradient_accumulation_steps != 1:
        problems.append(
            f"gradient_accumulation_steps = {args.gradient_accumulation_steps} would mix the "
            "releases of several steps into one update while the ledger charges each; set "
            "gradient_accumulation_steps=1 (raise privacy.sampling_prob for larger cohorts)"
        )
    if getattr(args, "group_by_length", False) or str(
        getattr(args, "train_sampling_strategy", "")
    ).endswith("group_by_length"):
        problems.append(
            "group_by_length orders examples by length, but userdp's sampler draws each step's "
            "cohort (the accountant assumes its sampling); remove group_by_length"
        )
    if args.world_size > 1:
        problems.append(
            f"{args.world_size} processes (Accelerate/DDP): each would release its own noisy "
            "update without userdp's reduce; run the Trainer in one process (several GPUs: "
            "`userdp simulate` with workers.ranks, or a deployment)"
        )
    if getattr(args, "packing", False) or getattr(args, "padding_free", False):
        problems.append(
            "packing puts several users' examples into one sequence, so one unit's gradient "
            "would carry other users' data; set packing=False and padding_free=False"
        )
    collator = type(data_collator).__name__ if data_collator is not None else ""
    if collator == "DataCollatorWithFlattening":
        problems.append(
            "DataCollatorWithFlattening packs several users' examples into one sequence; "
            "leave data_collator unset (userdp batches each unit's examples itself)"
        )
    return problems
