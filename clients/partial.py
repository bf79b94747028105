"""The result of one task: a plain sum of clipped unit gradients and its statistics.

Shared by the engines (:mod:`userdp.clients.clipping`, which builds it), the gRPC worker
(:mod:`userdp.clients.grpc_client`, which streams it) and any :class:`TaskCompute`. It imports
no torch at run time, so the transport layer stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class ClippedSum:
    """A task's plain sum of clipped unit gradients and its statistics.

    sums: parameter name -> CPU float32 tensor, trainable parameters only.
    count: finite units (including units without usable examples, norm 0); nonfinite: units that
        contributed zero because their loss or gradient was NaN/Inf; count + nonfinite = units.
    clipped: finite units whose (exact or estimated) norm exceeded C.
    norm_*: over the finite units, of the norm used for clipping (‖g‖, or √n̂ when randomized).
    loss_sum / tokens: summed next-token cross-entropy and predicted tokens of the finite units.
    skipped_examples: examples dropped for having fewer than 2 tokens.
    """

    sums: dict[str, torch.Tensor]
    count: int = 0
    nonfinite: int = 0
    clipped: int = 0
    norm_min: float = 0.0
    norm_max: float = 0.0
    norm_sum: float = 0.0
    norm_sum_sq: float = 0.0
    loss_sum: float = 0.0
    tokens: int = 0
    skipped_examples: int = 0
