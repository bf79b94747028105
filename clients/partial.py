"""The result of one task: a plain sum of clipped unit gradients and its statistics.

Shared by the engines (:mod:`userdp.clients.clipping`, which builds it), the gRPC worker
(:mod:`userdp.clients.grpc_client`, which streams it) and any :class:`TaskCompute`. It imports
no torch at run time, so the transport layer stays light.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from userdp.strategies.unit_stats import UnitStats

if TYPE_CHECKING:
    import torch


@dataclass
class ClippedSum:
    """A task's plain sum of clipped unit gradients and its statistics.

    sums: parameter name -> CPU float32 tensor, trainable parameters only.
    stats: the units' statistics (:class:`~userdp.strategies.unit_stats.UnitStats`).
    skipped_examples: examples dropped for having fewer than 2 tokens (the worker's own; not on
        the wire).
    """

    sums: dict[str, torch.Tensor]
    stats: UnitStats = field(default_factory=UnitStats)
    skipped_examples: int = 0
