"""The strategy plugin API: one DP training mechanism as one object with a few hooks.

A :class:`Strategy` is the whole mechanism of one step, seen from the coordinator: which units
contribute (the sampler), what the workers are told (clip norm, engine, local steps), how partial
sums are combined, which noise is added, how the server applies the noisy sum, and the frozen
:mod:`userdp.accounting.mechanisms` value that tells the accountant what was released. The
accountant therefore never guesses from flags: what the strategy samples and what it reports are
written next to each other, and :meth:`Strategy.facts` says when they do not match.

The coordinator (or :func:`userdp.strategies.inprocess.run_steps`, or the Flower adapter) calls
the hooks in this order, once per step::

    mechanism()                          # checked against the budget before any work
    sample_cohort(step, population)  -> Cohort        (unit ids; never rows)
    configure_task(step, cohort)     -> TaskSpec      (what every worker task carries; callers
                                                       use task_for, which adds run options)
    ... workers return partial sums of CLIPPED unit updates ...
    aggregate(partials)              -> summed tensors   (only when the caller does not sum itself)
    add_noise(step, summed, stats)   -> noisy sum        (fresh noise, never replayable)
    ... ledger.append(step, mechanism()) BEFORE anything is released ...
    server_update(params, noisy, cohort)                 (÷ EXPECTED cohort size, optimizer step)
    state_dict() / load_state_dict(state)                (checkpoint; noise RNG is not in it)

Tensors: a "tensor dict" maps parameter names to float tensors, either numpy arrays or torch
tensors (the coordinator passes torch). Strategies never import torch at module level; the few
operations that must work on both go through :mod:`userdp.strategies.tensors`.

Units: ``unit="user"`` (ULS family: one clipped update per sampled user) or ``unit="example"``
(ELS family: one clipped gradient per sampled example of the capped subset D_sub; an example unit
id is ``"<user id>/<example index>"``, the form ``userdp.server.coordinator.Population`` parses).
"""

from __future__ import annotations

import math
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
from userdp.accounting.mechanisms import Mechanism
from userdp.strategies import tensors as T
from userdp.strategies.noise import GaussianNoise, NoiseMechanism
from userdp.strategies.optimizers import ServerOptimizer, Sgd

__all__ = [
    "ADJACENCIES",
    "UNITS",
    "ClipStatistics",
    "Cohort",
    "PopulationCounts",
    "PrivacyFacts",
    "Strategy",
    "StrategyError",
    "TaskSpec",
    "as_population",
    "example_unit_id",
    "parse_example_unit_id",
]

Unit = Literal["user", "example"]
UNITS: tuple[str, ...] = ("user", "example")
ADJACENCIES: tuple[str, ...] = ("add-remove", "zero-out")


class StrategyError(ValueError):
    """A strategy was configured or called wrongly; the message says what to change."""


# ---------------------------------------------------------------------------------------------
# values passed between the hooks


@dataclass(frozen=True)
class PopulationCounts:
    """What the coordinator knows about the data: user ids and, for example units, counts.

    ``user_ids`` is the manifest order (a sampler's randomness is drawn over positions in it, so
    the order must be stable across a run and a resume). ``examples_per_user`` is needed only by
    example-level strategies (ELS, Alg. 1's D_sub); it is an int array aligned with ``user_ids``.
    """

    user_ids: Sequence[str]
    examples_per_user: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.user_ids)

    def require_examples(self, who: str) -> np.ndarray:
        if self.examples_per_user is None:
            raise StrategyError(
                f"{who} needs the number of examples per user; pass a population with "
                "examples_of_user (user id -> n_examples), not just user ids"
            )
        return self.examples_per_user


_POPULATION_CACHE: dict[int, tuple[Any, PopulationCounts]] = {}


def as_population(population: Any) -> PopulationCounts:
    """Accept what callers have: a PopulationCounts, a sequence of user ids, a mapping
    ``user id -> n_examples``, or an object with ``users`` and ``examples_of_user``
    (``userdp.server.coordinator.Population``)."""
    if isinstance(population, PopulationCounts):
        return population
    if isinstance(population, Mapping):
        users = tuple(population)
        counts = np.fromiter((int(population[u]) for u in users), dtype=np.int64, count=len(users))
        return PopulationCounts(users, counts)
    if hasattr(population, "users"):
        cached = _POPULATION_CACHE.get(id(population))
        if cached is not None and cached[0]() is population:
            return cached[1]
        users = population.users
        examples = getattr(population, "examples_of_user", None) or None
        counts = None
        if examples:
            counts = np.fromiter((int(examples[u]) for u in users), np.int64, count=len(users))
        result = PopulationCounts(users, counts)
        try:  # the coordinator's Population is immutable: convert it once, not every step
            _POPULATION_CACHE[id(population)] = (weakref.ref(population), result)
        except TypeError:
            pass
        return result
    if isinstance(population, Sequence) and not isinstance(population, str | bytes):
        return PopulationCounts(population)
    raise StrategyError(
        f"population={type(population).__name__} is not allowed; expected user ids, a mapping "
        "user id -> n_examples, or an object with .users and .examples_of_user"
    )


def example_unit_id(user_id: str, example_index: int) -> str:
    """The unit id of one example of D_sub: ``"<user id>/<example index>"``."""
    return f"{user_id}/{int(example_index)}"


def parse_example_unit_id(unit_id: str) -> tuple[str, int]:
    """Inverse of :func:`example_unit_id` (user ids may themselves contain ``/``)."""
    user, sep, index = unit_id.rpartition("/")
    if not sep or not index.isdigit():
        raise StrategyError(f"unit id {unit_id!r} is not an example unit '<user id>/<index>'")
    return user, int(index)


@dataclass(frozen=True)
class Cohort:
    """The units of one step and the normalizer the server divides by.

    ``expected_size`` is the EXPECTED number of units (qN users, p|D_sub| examples, N/b for
    balls-in-bins), fixed before the step: dividing by the realized size would leak it.
    ``padded_size`` is set only by fixed-size (padding/truncation) sampling: workers pad the task
    to that many slots with zero contributions.
    """

    step: int
    unit_ids: tuple[str, ...]
    expected_size: float
    unit: str = "user"
    padded_size: int | None = None

    def __len__(self) -> int:
        return len(self.unit_ids)


EXACT_ENGINES = ("loop", "vectorized", "ghost")
"""Engines that compute every unit's exact norm: interchangeable without changing the mechanism."""
EXECUTION_OPTIONS = ("engine", "token_budget", "selection", "seq_len")


@dataclass(frozen=True)
class TaskSpec:
    """What every worker task of a step carries besides its unit ids (never noise or its seed).

    clip_norm: C; each unit's update is clipped to norm ≤ C before it is summed.
    engine: per-unit gradient engine (``"vectorized"``, ``"loop"``, ``"ghost"``, ``"randomized"``).
    probes: random probes per unit for randomized norm estimation (0 = exact norms).
    unit: ``"user"`` (ULS: mean of the user's selected examples' gradients, then clip) or
        ``"example"`` (ELS: clip each example's gradient).
    selection / group_size / selection_seed: which of a user's examples are used (ULS: at most
        ``group_size`` per user per step, fresh each step; ELS: the unit id names the example).
    local_steps: 0 = one gradient at the broadcast model (DP-FedSGD). k ≥ 1 = DP-FedAvg: the
        worker runs k local SGD steps with ``local_lr`` on the user's examples, batches of
        ``local_batch_size`` (0 = all selected examples), and the clipped quantity is the model
        delta (θ_broadcast − θ_local), in gradient orientation so the server can treat it like a
        gradient.
    """

    clip_norm: float
    engine: str = "vectorized"
    probes: int = 0
    token_budget: int = 8192
    unit: str = "user"
    selection: str = "random"
    group_size: int = 0
    seq_len: int = 128
    selection_seed: int = 0
    local_steps: int = 0
    local_lr: float = 0.0
    local_batch_size: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip_norm) and self.clip_norm > 0):
            raise StrategyError(f"clip_norm={self.clip_norm!r} is out of range; expected > 0")
        if self.unit not in UNITS:
            raise StrategyError(f"unit={self.unit!r} is not allowed; expected one of {UNITS}")
        if self.local_steps < 0 or (self.local_steps > 0 and not self.local_lr > 0):
            raise StrategyError(
                f"local_steps={self.local_steps}, local_lr={self.local_lr}: local steps need "
                "local_steps >= 1 and local_lr > 0 (or local_steps = 0 for one gradient)"
            )


@dataclass(frozen=True)
class ClipStatistics:
    """Per-step counts the workers report next to the clipped sum (not released as such).

    ``units``: units that contributed; ``clipped``: units whose update norm was > C (so
    ``units − clipped`` had norm ≤ C). Adaptive clipping releases a NOISY version of the latter.
    """

    units: int
    clipped: int


@dataclass(frozen=True)
class PrivacyFacts:
    """What the privacy report must state about a strategy besides its mechanism.

    sampling: the sampler's name (``poisson-users``, ``poisson-examples``, ``balls-in-bins``,
        ``shuffle``, ...). adjacency: ``add-remove`` one user, or ``zero-out`` (padding and
        truncation). sampling_matches_accounting: False when the accountant's assumption does not
        hold for the sampler (fixed-size shuffle): the reported ε is then NOT a guarantee.
    caveats: one line each, printed verbatim in the report.
    """

    unit: str
    sampling: str
    adjacency: str
    sampling_matches_accounting: bool
    caveats: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "unit": self.unit,
            "sampling": self.sampling,
            "adjacency": self.adjacency,
            "sampling_matches_accounting": self.sampling_matches_accounting,
            "caveats": list(self.caveats),
        }


# ---------------------------------------------------------------------------------------------
# the plugin API


class Strategy(ABC):
    """Base class of every DP strategy: subclasses pass the attributes to ``__init__`` and fill
    the abstract hooks.

    Attributes (set in ``__init__``): ``unit`` ("user" | "example"), ``group_size`` (examples
    per user: per step for ULS, in D_sub for ELS), ``clip_norm`` (C), ``noise`` (a
    :class:`~userdp.strategies.noise.NoiseMechanism`; iid Gaussian by default), ``optimizer``
    (a :class:`~userdp.strategies.optimizers.ServerOptimizer`; SGD with learning rate 1 by
    default, i.e. params −= noisy mean).

    Must implement: :meth:`sample_cohort`, :attr:`expected_cohort_size`, :meth:`mechanism`,
    :meth:`facts`.
    Usually inherited: :meth:`configure_task`, :meth:`aggregate`, :meth:`add_noise`,
    :meth:`server_update`, :meth:`state_dict`, :meth:`load_state_dict`.
    """

    unit: str = "user"
    group_size: int = 0
    clip_norm: float = 1.0
    noise: NoiseMechanism
    optimizer: ServerOptimizer

    def __init__(
        self,
        *,
        clip_norm: float,
        noise_multiplier: float,
        unit: str = "user",
        group_size: int = 0,
        noise: NoiseMechanism | None = None,
        optimizer: ServerOptimizer | None = None,
    ) -> None:
        if unit not in UNITS:
            raise StrategyError(f"unit={unit!r} is not allowed; expected one of {UNITS}")
        if not (math.isfinite(clip_norm) and clip_norm > 0):
            raise StrategyError(f"clip_norm={clip_norm!r} is out of range; expected > 0")
        if not (math.isfinite(noise_multiplier) and noise_multiplier > 0):
            raise StrategyError(
                f"noise_multiplier={noise_multiplier!r} is out of range; expected > 0"
            )
        self.unit = unit
        self.group_size = int(group_size)
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.noise = noise if noise is not None else GaussianNoise()
        self.optimizer = optimizer if optimizer is not None else Sgd(learning_rate=1.0)
        self._execution_options: dict[str, Any] = {}

    # ---- sampling ------------------------------------------------------------------------------

    @abstractmethod
    def sample_cohort(self, step: int, population: Any) -> Cohort:
        """Pick this step's units. ``population``: see :func:`as_population` (ids and counts only).

        Returns a :class:`Cohort` whose ``expected_size`` is fixed in advance. Deterministic given
        the strategy's sampler seed and ``step`` (a retried step index gets the same cohort), never
        dependent on data values.
        """

    @property
    @abstractmethod
    def expected_cohort_size(self) -> float:
        """The normalizer of :meth:`server_update`: expected units per step (qN, p|D_sub|, N/b).

        Raises StrategyError before the first :meth:`sample_cohort` if it depends on N."""

    # ---- the worker's task ----------------------------------------------------------------------

    def configure_task(self, step: int, cohort: Cohort) -> TaskSpec:
        """What every task of this step tells its worker. Default: clip to ``clip_norm``, this
        strategy's unit and group size, one gradient per unit."""
        return TaskSpec(clip_norm=self.clip_norm, unit=self.unit, group_size=self.group_size)

    def set_execution_options(self, **options: Any) -> None:
        """Run-level options of every task that do not change the mechanism: ``engine`` (an
        EXACT engine, ``"loop"`` or ``"vectorized"``), ``token_budget``, ``selection``,
        ``seq_len``. Callers use :meth:`task_for`, which applies them."""
        unknown = set(options) - set(EXECUTION_OPTIONS)
        if unknown:
            raise StrategyError(
                f"not execution options: {sorted(unknown)}; allowed: {list(EXECUTION_OPTIONS)}"
            )
        engine = options.get("engine")
        if engine is not None and engine not in EXACT_ENGINES:
            raise StrategyError(
                f"engine={engine!r} changes the mechanism (estimated norms need their own "
                "accountant): use the randomized-clipping strategy instead of a run option"
            )
        self._execution_options = dict(options)

    def task_for(self, step: int, cohort: Cohort) -> TaskSpec:
        """:meth:`configure_task` with the run's execution options applied: what callers send.

        The engine option replaces only an exact engine; a strategy that chose a randomized
        engine keeps it, since its accountant depends on it."""
        spec = self.configure_task(step, cohort)
        options = dict(self._execution_options)
        if spec.engine not in EXACT_ENGINES:
            options.pop("engine", None)
        return replace(spec, **options) if options else spec

    # ---- combining and privatizing --------------------------------------------------------------

    def aggregate(self, partials: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
        """Sum partial sums of clipped updates (tensor dicts) into one tensor dict (float64 for
        numpy). Rejects a partial whose names, shapes or dtypes differ from the first one, or
        that holds a non-finite value (raises ``tensors.TensorDictError``; the caller re-issues
        the task).
        Exactly-once delivery is the caller's job."""
        return T.sum_tensor_dicts(partials)

    def add_noise(
        self, step: int, summed: Mapping[str, Any], stats: ClipStatistics | None = None
    ) -> dict[str, Any]:
        """Return ``summed + σ·C·noise`` (iid: z; BLT: (C⁻¹z)_step), a new dict; ``summed`` is
        not modified. The noise generator is seeded from ``os.urandom``; calling this twice for
        one step (a retry) draws different noise. ``stats`` is used only by strategies that
        release a statistic with the sum (adaptive clipping)."""
        return self.noise.add(step, summed, std=self.noise_multiplier * self.clip_norm)

    def server_update(
        self, params: Mapping[str, Any], noisy_sum: Mapping[str, Any], cohort: Cohort
    ):
        """Apply the step in place: ``params ← optimizer(params, noisy_sum / expected_size)``.

        Divides by ``cohort.expected_size`` (fixed in advance), never by ``len(cohort)``. The
        optimizer is post-processing of the noisy sum, so any optimizer is allowed."""
        if not cohort.expected_size > 0:
            raise StrategyError(f"cohort.expected_size={cohort.expected_size!r}; expected > 0")
        scale = 1.0 / cohort.expected_size
        gradient = {name: value * scale for name, value in noisy_sum.items()}
        self.optimizer.step(params, gradient)

    # ---- privacy description ------------------------------------------------------------------

    @abstractmethod
    def mechanism(self) -> Mechanism:
        """The frozen description of ONE step for the ledger (:mod:`userdp.accounting.mechanisms`).
        Stable across the run unless the strategy documents why (it is appended per step)."""

    @abstractmethod
    def facts(self) -> PrivacyFacts:
        """Sampling name, adjacency, whether sampling matches the accountant, and caveats."""

    def sampling_matches_accounting(self) -> bool:
        return self.facts().sampling_matches_accounting

    # ---- checkpoint -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe values plus numpy/torch arrays; never pickle. Contains sampler state (seeds,
        fixed bins), optimizer state, correlated-noise buffers; NEVER the noise RNG."""
        return {
            "clip_norm": self.clip_norm,
            "noise": self.noise.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`. The noise RNG is re-seeded from ``os.urandom``, so a resumed
        run never replays noise."""
        self.clip_norm = float(state["clip_norm"])
        self.noise.load_state_dict(state["noise"])
        self.optimizer.load_state_dict(state["optimizer"])
