"""One task as the clipping engine computes it: the units, the clip norm C and the task's engine
options, in one frozen value from the decoded wire task (:class:`userdp.proto.codec.WorkerTask`)
to :meth:`userdp.clients.engine.ClippingEngine.run`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from userdp.clients.batching import Unit
from userdp.proto.codec import WorkerTask


@dataclass(frozen=True)
class EngineRequest:
    """Σ_u clip(g_u, C) over ``units`` (the module docstring of :mod:`userdp.clients.engine`).

    engine/token_budget: per-task overrides (None, "" or 0 = the engine's defaults).
    probes: probes k for ``randomized`` (None = the default; 0 = exact norms).
    estimator: ``"hutchinson"`` or ``"hutch++"`` for ``randomized`` (None = the default).
    local_steps ≥ 1: DP-FedAvg (:mod:`userdp.clients.fedavg`): the clipped quantity is each
        unit's model delta after ``local_steps`` SGD steps (``local_lr``, batches of
        ``local_batch_size`` examples, 0 = all); norms are exact whatever ``engine`` says.
    probe_seed: TESTS ONLY — seeds the randomized engine's probes; production draws them from
        an ``os.urandom``-seeded generator on every call."""

    units: tuple[Unit, ...]
    clip_norm: float
    engine: str | None = None
    probes: int | None = None
    estimator: str | None = None
    token_budget: int | None = None
    local_steps: int = 0
    local_lr: float = 0.0
    local_batch_size: int = 0
    probe_seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "units", tuple(self.units))  # a value: its own sequence

    @classmethod
    def of_task(cls, task: WorkerTask, units: Sequence[Unit]) -> EngineRequest:
        """The request of a decoded wire task whose unit ids resolved to ``units``."""
        return cls(
            units=tuple(units),
            clip_norm=task.clip_norm,
            engine=task.engine,
            probes=task.probes,
            estimator=task.estimator,
            token_budget=task.token_budget,
            local_steps=task.local_steps,
            local_lr=task.local_lr,
            local_batch_size=task.local_batch_size,
        )
