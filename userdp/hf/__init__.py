"""User-level DP inside Hugging Face ``Trainer`` and TRL's ``SFTTrainer``.

    from userdp.hf import UserDPArguments, UserDPTrainer

    trainer = UserDPTrainer(model, args, train_dataset=dataset, processing_class=tokenizer,
                            privacy=UserDPArguments(user_column="author", epsilon=8.0))
    trainer.train()  # output_dir: ledger.jsonl, privacy_report.{json,md}, model/

``UserDPSFTTrainer`` (TRL) is in :mod:`userdp.hf.trl`. Guarantees and refusals: docs/hf.md.
"""

from __future__ import annotations

from userdp.hf.arguments import UserDPArguments
from userdp.hf.data import DatasetError
from userdp.hf.guards import TrainerSettingError
from userdp.hf.trainer import UserDPTrainer, UserDPTrainerMixin

__all__ = [
    "DatasetError",
    "TrainerSettingError",
    "UserDPArguments",
    "UserDPTrainer",
    "UserDPTrainerMixin",
]
