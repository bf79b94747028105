"""The few tensor operations strategies need on both numpy arrays and torch tensors.

Strategies are written against numpy; the coordinator hands them torch tensors. Rather than
import torch everywhere, the operations that differ between the two live here, and torch is
imported only when a torch tensor is actually seen.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

__all__ = [
    "TensorDictError",
    "clone",
    "is_torch",
    "is_finite",
    "match",
    "norm",
    "sum_tensor_dicts",
    "to_numpy",
    "zeros_like",
]


class TensorDictError(ValueError):
    """A tensor dict does not match the expected names, shapes or dtypes, or is not finite."""


def is_torch(x: Any) -> bool:
    return type(x).__module__.split(".", 1)[0] == "torch"


def to_numpy(x: Any) -> np.ndarray:
    if is_torch(x):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def zeros_like(x: Any) -> Any:
    if is_torch(x):
        import torch

        return torch.zeros_like(x)
    return np.zeros_like(x)


def clone(x: Any) -> Any:
    if is_torch(x):
        return x.detach().clone()
    return np.array(x, copy=True)


def match(stored: Any, like: Any) -> Any:
    """``stored`` (numpy or torch, e.g. restored from a checkpoint) as ``like``'s kind, device
    and dtype; a private copy is made whenever it is not already exactly that."""
    if is_torch(like):
        import torch

        if is_torch(stored) and stored.device == like.device and stored.dtype == like.dtype:
            return stored
        tensor = stored if is_torch(stored) else torch.from_numpy(np.array(stored))
        return tensor.to(device=like.device, dtype=like.dtype, copy=True)
    if isinstance(stored, np.ndarray) and stored.dtype == like.dtype:
        return stored
    return np.array(to_numpy(stored), dtype=like.dtype)


def is_finite(x: Any) -> bool:
    if is_torch(x):
        import torch

        return bool(torch.isfinite(x).all())
    return bool(np.isfinite(x).all())


def norm(tensors: Mapping[str, Any]) -> float:
    """Global L2 norm of a tensor dict (float64 accumulation)."""
    total = 0.0
    for value in tensors.values():
        a = to_numpy(value).astype(np.float64, copy=False)
        total += float(np.dot(a.ravel(), a.ravel()))
    return float(np.sqrt(total))


def _signature(x: Any) -> tuple[tuple[int, ...], str]:
    return tuple(x.shape), str(x.dtype).replace("torch.", "")


def sum_tensor_dicts(partials: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """Sum tensor dicts name by name; numpy sums accumulate in float64, torch in float64 too.

    Every partial must have the first one's names, shapes and dtypes and only finite values;
    otherwise TensorDictError names the offending partial and tensor.
    """
    total: dict[str, Any] | None = None
    reference: dict[str, tuple[tuple[int, ...], str]] = {}
    for index, partial in enumerate(partials):
        if total is None:
            reference = {name: _signature(value) for name, value in partial.items()}
            total = {}
            for name, value in partial.items():
                _check_finite(index, name, value)
                total[name] = _as_float64(value)
            continue
        if set(partial) != set(reference):
            raise TensorDictError(
                f"partial {index}: tensor names {sorted(partial)} differ from {sorted(reference)}"
            )
        for name, value in partial.items():
            if _signature(value) != reference[name]:
                raise TensorDictError(
                    f"partial {index}: tensor {name!r} is {_signature(value)}, expected "
                    f"{reference[name]} (shape, dtype)"
                )
            _check_finite(index, name, value)
            total[name] = total[name] + _as_float64(value)
    if total is None:
        raise TensorDictError("no partial sums to aggregate")
    return total


def _as_float64(value: Any) -> Any:
    if is_torch(value):
        import torch

        return value.detach().to(torch.float64)
    return np.asarray(value, dtype=np.float64)


def _check_finite(index: int, name: str, value: Any) -> None:
    if not is_finite(value):
        raise TensorDictError(f"partial {index}: tensor {name!r} holds a non-finite value")
