"""``UserDPSFTTrainer``: TRL's ``SFTTrainer`` with userdp's user-level DP (the same mixin as
:class:`userdp.hf.UserDPTrainer`). Chat data (a ``messages`` column) is turned into text with
the tokenizer's chat template before userdp shards it; packing is refused."""

from __future__ import annotations

from trl import SFTTrainer

from userdp.hf.trainer import UserDPTrainerMixin

__all__ = ["UserDPSFTTrainer"]


class UserDPSFTTrainer(UserDPTrainerMixin, SFTTrainer):
    """``trl.SFTTrainer`` with user-level DP; takes ``privacy=UserDPArguments(...)``."""
