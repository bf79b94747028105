"""A commitment to one step's noise draw: SHA-256 of the step's :class:`~userdp.strategies.base.Release`.

The ledger records it with the step's charge and the release journal with the broadcast
(``release_sha256``), so a replayed step (charged, then lost in a crash before its release, then
run again) can be shown to release something other than the draw the crash discarded: equal
commitments mean the same noisy values, different ones that the release changed (fresh noise,
when the replay's sum is the same). It is a function of the noisy release alone, never of the
noise or its key: hashing the noise itself would let anyone holding a released update test a
guess of the clipped sum (noise = release − guess). The discarded draw's commitment is a hash of
values with thousands of bits of Gaussian entropy that never left the coordinator; nothing about
them can be learned from it short of guessing them exactly.

Encoding: a version tag, then for every tensor of ``noisy_sum`` in name order its name, dtype
and shape (JSON) and its bytes (C order, CPU), then every released statistic's name and value
(``float.hex``). Numpy and torch tensors of the same values and dtype give the same digest.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
from userdp.strategies import tensors as T
from userdp.strategies.base import Release

__all__ = ["TAG", "release_sha256"]

TAG = b"userdp-release-sha256-v1\0"


def _tensor_bytes(value: Any) -> tuple[str, tuple[int, ...], Any]:
    """(dtype name, shape, a buffer of the raw bytes) of a numpy array or torch tensor."""
    if T.is_torch(value):
        import torch

        flat = value.detach().to("cpu").contiguous().reshape(-1)
        dtype = str(value.dtype).removeprefix("torch.")
        return dtype, tuple(value.shape), flat.view(torch.uint8).numpy()
    array = np.ascontiguousarray(value)
    return array.dtype.name, array.shape, array.reshape(-1).view(np.uint8)


def release_sha256(release: Release) -> str:
    """Hex SHA-256 of ``release``'s noisy values (the module docstring)."""
    digest = hashlib.sha256(TAG)
    for name in sorted(release.noisy_sum):
        dtype, shape, data = _tensor_bytes(release.noisy_sum[name])
        header = {"name": name, "dtype": dtype, "shape": list(shape)}
        digest.update(json.dumps(header, sort_keys=True).encode() + b"\0")
        digest.update(data)
    for name in sorted(release.statistics):
        value = float(release.statistics[name].value).hex()
        digest.update(json.dumps({"statistic": name, "value": value}).encode() + b"\0")
    return digest.hexdigest()
