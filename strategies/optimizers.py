"""Server optimizers: what the coordinator does with the noisy averaged gradient.

Any first-order optimizer applied to the noisy mean is post-processing, so it costs no privacy
(Charles et al., "Fine-Tuning Large Language Models with User-Level Differential Privacy", §2,
remark on Algorithms 1 and 2). Each optimizer updates a tensor dict of parameters IN PLACE (numpy
arrays or torch tensors) from a tensor dict of gradients ("gradient orientation": params move
against it) and keeps its slots in a checkpointable ``state_dict`` (arrays, no pickle).

SGD (optionally with heavy-ball momentum), Adam (Kingma & Ba 2015) and Adafactor (Shazeer & Stern
2018, factored second moments for matrices, update clipping, fixed learning rate).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np
from userdp.accounting.validation import in_unit_interval, positive_float
from userdp.strategies import tensors as T

__all__ = ["Adafactor", "Adam", "OPTIMIZERS", "ServerOptimizer", "Sgd", "make_optimizer"]


def _sqrt(x: Any) -> Any:
    return x.sqrt() if T.is_torch(x) else np.sqrt(x)


def _mean(x: Any, axis: int) -> Any:
    if T.is_torch(x):
        return x.mean(dim=axis, keepdim=True)
    return x.mean(axis=axis, keepdims=True)


def _rms(x: Any) -> float:
    return float((x * x).mean()) ** 0.5


def _apply(param: Any, delta: Any) -> None:
    """param -= delta, in place, in the parameter's own dtype."""
    if T.is_torch(param):
        param.sub_(delta.to(param.dtype))
    else:
        param -= np.asarray(delta, dtype=param.dtype)


def _like(value: Any, param: Any) -> Any:
    """A restored slot (numpy or torch from a checkpoint) as the parameter's kind, float32+."""
    if T.is_torch(param):
        import torch

        tensor = value if T.is_torch(value) else torch.from_numpy(np.asarray(value))
        dtype = torch.float64 if param.dtype == torch.float64 else torch.float32
        return tensor.to(device=param.device, dtype=dtype)
    dtype = np.float64 if param.dtype == np.float64 else np.float32
    return np.asarray(T.to_numpy(value), dtype=dtype)


class ServerOptimizer(ABC):
    """Updates parameters in place from the (noisy, averaged) gradient."""

    name: str = ""

    def __init__(self, learning_rate: float) -> None:
        self.learning_rate = positive_float("learning_rate", learning_rate, ValueError)
        self.steps = 0
        self.slots: dict[str, dict[str, Any]] = {}

    def step(self, params: Mapping[str, Any], gradient: Mapping[str, Any]) -> None:
        missing = sorted(set(params) - set(gradient))
        if missing:
            raise ValueError(f"gradient is missing parameter(s) {missing[:3]}")
        self.steps += 1
        if any(T.is_torch(p) for p in params.values()):
            import torch

            with torch.no_grad():
                self._step_all(params, gradient)
        else:
            self._step_all(params, gradient)

    def _step_all(self, params: Mapping[str, Any], gradient: Mapping[str, Any]) -> None:
        for name, param in params.items():
            grad = _like(gradient[name], param)
            slots = {k: _like(v, param) for k, v in self.slots.get(name, {}).items()}
            self.slots[name] = slots
            _apply(param, self._delta(grad, slots))

    @abstractmethod
    def _delta(self, grad: Any, slots: dict[str, Any]) -> Any:
        """The amount to subtract from the parameter; updates ``slots`` in place."""

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "steps": self.steps, "slots": self.slots}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("name") != self.name:
            raise ValueError(
                f"optimizer state is for {state.get('name')!r}; this optimizer is {self.name!r}"
            )
        self.steps = int(state["steps"])
        self.slots = {n: dict(s) for n, s in state["slots"].items()}


class Sgd(ServerOptimizer):
    """θ ← θ − η·m,  m ← β·m + g (β = momentum; β = 0 is plain SGD)."""

    name = "sgd"

    def __init__(self, learning_rate: float, momentum: float = 0.0) -> None:
        super().__init__(learning_rate)
        self.momentum = in_unit_interval("momentum", momentum, ValueError, lo_open=False)

    def _delta(self, grad: Any, slots: dict[str, Any]) -> Any:
        if self.momentum == 0.0:
            return self.learning_rate * grad
        m = slots.get("m")
        m = grad if m is None else self.momentum * m + grad
        slots["m"] = m
        return self.learning_rate * m


class Adam(ServerOptimizer):
    """Adam with bias correction: θ ← θ − η·m̂/(√v̂ + ε)."""

    name = "adam"

    def __init__(
        self, learning_rate: float, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8
    ) -> None:
        super().__init__(learning_rate)
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)

    def _delta(self, grad: Any, slots: dict[str, Any]) -> Any:
        m = slots.get("m", T.zeros_like(grad))
        v = slots.get("v", T.zeros_like(grad))
        m = self.beta1 * m + (1 - self.beta1) * grad
        v = self.beta2 * v + (1 - self.beta2) * grad * grad
        slots["m"], slots["v"] = m, v
        m_hat = m / (1 - self.beta1**self.steps)
        v_hat = v / (1 - self.beta2**self.steps)
        return self.learning_rate * m_hat / (_sqrt(v_hat) + self.eps)


class Adafactor(ServerOptimizer):
    """Adafactor without momentum, fixed learning rate (the fine-tuning optimizer of "Fine-Tuning
    Large Language Models with User-Level Differential Privacy", §5).

    Matrices (ndim ≥ 2, last two axes factored): row/column running means R, S of g² + ε₁;
    V̂ = R Sᵀ / mean(R). Vectors: V̂ = running mean of g² + ε₁. Update u = g/√V̂, scaled down so
    RMS(u) ≤ ``clip_threshold``; θ ← θ − η·u.
    """

    name = "adafactor"

    def __init__(
        self,
        learning_rate: float,
        beta2: float = 0.999,
        eps1: float = 1e-30,
        clip_threshold: float = 1.0,
    ) -> None:
        super().__init__(learning_rate)
        self.beta2, self.eps1, self.clip_threshold = float(beta2), float(eps1), clip_threshold

    def _delta(self, grad: Any, slots: dict[str, Any]) -> Any:
        g2 = grad * grad + self.eps1
        b = self.beta2
        correction = 1 - b**self.steps
        if grad.ndim >= 2:
            row = _mean(g2, -1)
            col = _mean(g2, -2)
            r = slots["r"] * b + (1 - b) * row if "r" in slots else (1 - b) * row
            c = slots["c"] * b + (1 - b) * col if "c" in slots else (1 - b) * col
            slots["r"], slots["c"] = r, c
            v_hat = (r * c) / _mean(r, -2) / correction
        else:
            v = slots["v"] * b + (1 - b) * g2 if "v" in slots else (1 - b) * g2
            slots["v"] = v
            v_hat = v / correction
        update = grad / _sqrt(v_hat)
        scale = max(1.0, _rms(update) / self.clip_threshold)
        return (self.learning_rate / scale) * update


OPTIMIZERS: dict[str, type[ServerOptimizer]] = {
    "sgd": Sgd,
    "adam": Adam,
    "adafactor": Adafactor,
}


def make_optimizer(name: str, learning_rate: float, **options: Any) -> ServerOptimizer:
    """Build a server optimizer by name (``sgd`` with ``momentum=``, ``adam``, ``adafactor``)."""
    cls = OPTIMIZERS.get(name)
    if cls is None:
        raise ValueError(f"optimizer={name!r} is not allowed; expected one of {tuple(OPTIMIZERS)}")
    return cls(learning_rate, **options)
