"""``UserDPTrainer``: a Hugging Face ``Trainer`` that trains with userdp's user-level DP.

The Trainer keeps what it is good at (the loop, the optimizer and its schedule, logging to every
``report_to`` backend, the progress bar, checkpoints, ``save_model``); userdp takes over what the
guarantee rests on (:mod:`userdp.hf.private_run`): which units a step uses (the strategy's
sampler; the Trainer's shuffling sampler never sees the data), their clipped gradients, the
noise, the ledger before the optimizer step, the expected-cohort normalizer, ε and the report.
What would break the guarantee is refused at construction (:mod:`userdp.hf.guards`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from userdp.hf.arguments import UserDPArguments
from userdp.hf.data import check_columns, dataset_shards
from userdp.hf.guards import TrainerSettingError, refusals
from userdp.hf.private_run import PrivateRun

__all__ = ["UserDPTrainer", "UserDPTrainerMixin"]

log = logging.getLogger(__name__)


class _EpsilonOnProgressBar(TrainerCallback):
    """The ε spent so far beside the Trainer's progress bar (its logs carry it to the trackers)."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        epsilon = (logs or {}).get("epsilon")
        for callback in self.trainer.callback_handler.callbacks:
            bar = getattr(callback, "training_bar", None)
            if bar is not None and epsilon is not None:
                bar.set_postfix(epsilon=f"{epsilon:.3g}", refresh=False)


class UserDPTrainerMixin:
    """The userdp half of :class:`UserDPTrainer` (and of TRL's ``SFTTrainer`` in
    :mod:`userdp.hf.trl`): put it before the Trainer class in the bases."""

    def __init__(self, *args: Any, privacy: UserDPArguments | None = None, **kwargs: Any) -> None:
        if not isinstance(privacy, UserDPArguments):
            raise TrainerSettingError(
                "UserDPTrainer needs privacy=UserDPArguments(...) (the unit, clip norm, ε...)"
            )
        self.privacy = privacy
        self._raw_train_dataset = kwargs.get("train_dataset")
        super().__init__(*args, **kwargs)
        problems = refusals(self.args, self.data_collator)
        if problems:
            raise TrainerSettingError("; ".join(problems))
        if privacy.shards is None:
            check_columns(self._raw_train_dataset, privacy.user_column, privacy.text_column)
        self.private: PrivateRun | None = None
        self.test_only_disable_noise = False
        """NOT PRIVATE, tests only: compare with ``simulate``'s noiseless mode."""
        self.add_callback(_EpsilonOnProgressBar(self))

    # -- the run ---------------------------------------------------------------------------------

    def _steps(self) -> int:
        steps = self.privacy.steps or self.args.max_steps
        if not steps or steps < 0:
            raise TrainerSettingError(
                "set the number of private steps: privacy.steps or TrainingArguments.max_steps "
                "(each step samples its own cohort, so epochs do not fix it)"
            )
        return int(steps)

    def _open_private_run(self) -> PrivateRun:
        out = Path(self.args.output_dir)
        shards = self.privacy.shards
        if shards is None:
            shards = dataset_shards(
                self._raw_train_dataset,
                self.privacy.user_column,
                self.privacy.text_column,
                self.processing_class,
                out,
            )
        steps = self._steps()
        self.args.max_steps = steps
        config = self.privacy.to_config(shards, steps, out)
        private = PrivateRun(config, self.model, out)
        private.test_only_disable_noise = self.test_only_disable_noise
        return private

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """The Trainer's ``train`` with userdp's steps; ``resume_from_checkpoint`` also restores
        the strategy's state saved with that checkpoint (no step is released twice). Ends with
        the run folder's ledger, ``privacy_report.{json,md}`` and ``model/``."""
        self.private = self._open_private_run()
        try:
            if resume_from_checkpoint:
                if resume_from_checkpoint is True:
                    resume_from_checkpoint = get_last_checkpoint(self.args.output_dir)
                    if resume_from_checkpoint is None:
                        raise TrainerSettingError(
                            f"no checkpoint in {self.args.output_dir} to resume from"
                        )
                self.private.resume(Path(resume_from_checkpoint))
            result = super().train(resume_from_checkpoint=resume_from_checkpoint, **kwargs)
            self.privacy_report = self.private.finish(self.save_model)
            return result
        finally:
            self.private.close()

    def get_train_dataloader(self) -> DataLoader:
        """One item per step: the data of a step is the cohort userdp's sampler draws."""
        steps = list(range(self._steps()))
        return DataLoader(steps, batch_size=1, shuffle=False, collate_fn=_step_batch)

    def training_step(
        self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None
    ) -> torch.Tensor:
        """One private step at ``state.global_step``: the trainable parameters' ``.grad`` hold
        the noisy mean when it returns (none when the step was skipped or the budget is spent)."""
        assert self.private is not None
        model.zero_grad(set_to_none=True)
        outcome = self.private.step(self.state.global_step)
        if outcome.stop is not None:
            self.control.should_training_stop = True
        loss = outcome.loss if outcome.loss == outcome.loss else 0.0  # NaN: no token, no loss
        return torch.tensor(loss, device=self.args.device)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's logs plus ``epsilon``, the ε spent so far (from the ledger)."""
        if self.private is not None and "loss" in logs:
            epsilon = self.private.epsilon()
            if epsilon is not None:
                logs = {**logs, "epsilon": epsilon}
        super().log(logs, *args, **kwargs)

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.private is not None:
            folder = Path(self._get_output_dir(trial)) / f"checkpoint-{self.state.global_step}"
            self.private.save_state(folder, self.state.global_step)


def _step_batch(items: list[int]) -> dict[str, torch.Tensor]:
    return {"userdp_step": torch.tensor(items)}


class UserDPTrainer(UserDPTrainerMixin, Trainer):
    """``transformers.Trainer`` with user-level DP: ``UserDPTrainer(model, args,
    train_dataset=..., processing_class=tokenizer, privacy=UserDPArguments(...))``
    (module docstring)."""
