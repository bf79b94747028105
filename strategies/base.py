"""The strategy plugin API: one DP training mechanism as one object with a few hooks.

A :class:`Strategy` is the whole mechanism of one step, seen from the coordinator: which units
contribute (its :class:`~userdp.strategies.samplers.Sampler`), what the workers are told (clip
norm, engine, local steps), how partial sums are combined, which noise is added, how the server
applies the noisy release, and the frozen :mod:`userdp.accounting.mechanisms` value that tells
the accountant what was released. The accountant therefore never guesses from flags: what the
strategy samples and what it reports are written next to each other, and :meth:`Strategy.facts`
says when they do not match.

The step itself is written once, in :mod:`userdp.strategies.step`; the coordinator, the
in-process loop and the Flower adapter call it, and it calls the hooks in this order::

    mechanism()                              # checked against the budget before any work
    sample_cohort(step, population) -> Cohort     (unit ids; never rows)
    configure_task(step, cohort)    -> TaskSpec   (what every worker task carries)
    ... workers return task sums of CLIPPED unit updates; the caller sums them over the cohort
    privatize(step, summed, stats, cohort) -> Release   (fresh noise, never replayable)
      or, for a strategy with needs_unit_updates, every unit's own clipped update:
    privatize_units(step, updates, stats, cohort) -> Release
    ... ledger.append(step, mechanism()) BEFORE anything is released ...
    server_update(params, release)                  (÷ EXPECTED cohort size, optimizer step)
    state_dict() / load_state_dict(state)           (checkpoint; noise RNG is not in it)

Tensors: a "tensor dict" maps parameter names to float tensors, either numpy arrays or torch
tensors (the coordinator passes torch). Strategies never import torch at module level; the few
operations that must work on both go through :mod:`userdp.strategies.tensors`.

Units: ``unit="user"`` (ULS family: one clipped update per sampled user) or ``unit="example"``
(ELS family: one clipped gradient per sampled example of the capped subset D_sub; an example unit
id is ``"<user id>/<example index>"``, the form ``userdp.server.population.Population`` parses).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from userdp.accounting.facts import Adjacency, PrivacyFacts, Sampling, Unit
from userdp.accounting.mechanisms import Mechanism
from userdp.accounting.validation import positive_float
from userdp.strategies.errors import StrategyError
from userdp.strategies.noise import (
    DETERMINISTIC_NOISE_CAVEAT,
    FAST_NOISE_CAVEAT,
    GaussianNoise,
    NoiseMechanism,
)
from userdp.strategies.optimizers import ServerOptimizer, Sgd
from userdp.strategies.population import (
    PopulationCounts,
    as_population,
    example_unit_id,
    parse_example_unit_id,
)
from userdp.strategies.samplers import Sampler
from userdp.strategies.unit_stats import UnitStats

__all__ = [
    "UNITS",
    "Adjacency",
    "Cohort",
    "NoisyStatistic",
    "PopulationCounts",
    "PrivacyFacts",
    "Release",
    "Sampling",
    "Strategy",
    "StrategyError",
    "TaskSpec",
    "Unit",
    "UnitStats",
    "as_population",
    "example_unit_id",
    "parse_example_unit_id",
]

UNITS: tuple[str, ...] = tuple(u.value for u in Unit)


def _check_unit(unit: str) -> None:
    if unit not in UNITS:
        raise StrategyError(f"unit={unit!r} is not allowed; expected one of {UNITS}")


# ---------------------------------------------------------------------------------------------
# values passed between the hooks


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


@dataclass(frozen=True)
class TaskSpec:
    """What every worker task of a step carries besides its unit ids (never noise or its seed).

    clip_norm: C; each unit's update is clipped to norm ≤ C before it is summed.
    engine: per-unit gradient engine (``"vectorized"``, ``"loop"``, ``"ghost"``, ``"randomized"``).
    probes: random probes per unit for randomized norm estimation (0 = exact norms).
    estimator: the randomized norm estimator, ``"hutchinson"`` or ``"hutch++"``.
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
    estimator: str = "hutchinson"
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
        positive_float("clip_norm", self.clip_norm, StrategyError)
        _check_unit(self.unit)
        if self.local_steps < 0 or (self.local_steps > 0 and not self.local_lr > 0):
            raise StrategyError(
                f"local_steps={self.local_steps}, local_lr={self.local_lr}: local steps need "
                "local_steps >= 1 and local_lr > 0 (or local_steps = 0 for one gradient)"
            )


@dataclass(frozen=True)
class NoisyStatistic:
    """A scalar released next to the noisy sum (adaptive clipping's clipped fraction).

    ``sensitivity``: how much one unit can move the value before noise; the conformance checks
    (:func:`userdp.testing.check_strategy`) measure the noise on it and require the whole step to
    be a Gaussian mechanism with at least the accounted noise multiplier."""

    value: float
    sensitivity: float


@dataclass(frozen=True)
class Release:
    """What one step releases: the noisy sum of clipped updates and any noisy statistics.

    Everything in it is covered by the step's mechanism; everything computed from it (the server
    update, clip-norm schedules) is post-processing."""

    step: int
    cohort: Cohort
    noisy_sum: dict[str, Any]
    statistics: Mapping[str, NoisyStatistic] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# the plugin API


class Strategy(ABC):
    """Base class of every DP strategy: subclasses pass the attributes to ``__init__`` and fill
    the abstract hooks.

    Attributes (set in ``__init__``): ``sampler`` (a :class:`~userdp.strategies.samplers.Sampler`;
    checkpointed here), ``unit`` ("user" | "example": what the sampler draws), ``group_size``
    (examples per user: per step for ULS, in D_sub for ELS), ``clip_norm`` (C), ``noise`` (a
    :class:`~userdp.strategies.noise.NoiseMechanism`; iid Gaussian by default), ``optimizer``
    (a :class:`~userdp.strategies.optimizers.ServerOptimizer`; SGD with learning rate 1 by
    default, i.e. params −= noisy mean).

    Must implement: :meth:`mechanism`. Usually inherited: :meth:`sample_cohort` (users at the
    sampler's positions), :meth:`expected_cohort_size`, :meth:`configure_task`,
    :meth:`add_noise`, :meth:`privatize`, :meth:`server_update`,
    :meth:`facts` (from the sampler and :meth:`caveats`), :meth:`state_dict`,
    :meth:`load_state_dict`.
    """

    unit: str = "user"
    group_size: int = 0
    clip_norm: float = 1.0
    fixed_cohort_size: float | None = None
    """The normalizer fixed in advance (the constructor's ``expected_cohort_size``), or None."""
    samplings: tuple[str, ...] | None = None
    """The ``strategy.sampling`` schemes (:class:`~userdp.accounting.facts.Sampling` values) the
    strategy's mechanism is accounted for; None: any scheme of the sampler it is given. A config
    naming another scheme is refused before the strategy is built."""
    record_units: bool = False
    """True: the units are whole records of a subset chosen once (ELS, group privacy), so
    ``data.selection`` must choose whole records (not windows across them)."""
    full_participation: bool = False
    """True: every unit takes part in every step (``sampling = "poisson"`` with rate 1)."""
    required_keys: tuple[str, ...] = ()
    """Strategy-only ``[strategy]`` keys (of the config's optional ones) that must be set."""
    banded_samplings: tuple[str, ...] = ()
    """The samplings with which ``strategy.bands`` (a banded C) is accounted; () : bands is not
    taken."""
    estimates_norms: bool = False
    """True: the mechanism is accounted for estimated norms (``strategy.engine = "randomized"``);
    no other strategy may run the randomized engine."""
    needs_unit_updates: bool = False
    """True: the release depends on each unit's own clipped update, not only on their sum (e.g.
    a filter over pairwise distances). The step then gathers one update per unit and calls
    :meth:`privatize_units`; a transport that only gathers sums refuses the strategy."""
    sampler: Sampler
    noise: NoiseMechanism
    optimizer: ServerOptimizer

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "aggregate" in vars(cls):
            raise StrategyError(
                f"{cls.__name__} defines aggregate(), which is not a hook: every transport sums "
                "the workers' clipped partial sums itself, exactly once (the coordinator while "
                "they stream in), so an override would run in some transports and not others; "
                "post-process the sum in privatize() or server_update() instead"
            )

    def __init__(
        self,
        *,
        clip_norm: float,
        noise_multiplier: float,
        sampler: Sampler,
        unit: str = "user",
        group_size: int = 0,
        noise: NoiseMechanism | None = None,
        optimizer: ServerOptimizer | None = None,
        expected_cohort_size: float | None = None,
    ) -> None:
        _check_unit(unit)
        positive_float("clip_norm", clip_norm, StrategyError)
        positive_float("noise_multiplier", noise_multiplier, StrategyError)
        if not isinstance(sampler, Sampler):
            raise StrategyError(
                f"sampler={type(sampler).__name__} is not a userdp.strategies.samplers.Sampler"
            )
        self.sampler = sampler
        self.unit = unit
        self.group_size = int(group_size)
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self.noise = noise if noise is not None else GaussianNoise()
        self.optimizer = optimizer if optimizer is not None else Sgd(learning_rate=1.0)
        self.fixed_cohort_size = expected_cohort_size

    def calibrate(self, noise_multiplier: float) -> None:
        """Set σ to ``noise_multiplier``, calibrated on this strategy's own :meth:`mechanism` value
        (the strategy is built once; its mechanism and noise must read ``self.noise_multiplier``,
        which the caller checks by comparing :meth:`mechanism` with the calibrated value)."""
        positive_float("noise_multiplier", noise_multiplier, StrategyError)
        self.noise_multiplier = float(noise_multiplier)

    # ---- sampling ------------------------------------------------------------------------------

    def sample_cohort(self, step: int, population: Any) -> Cohort:
        """Pick this step's units. ``population``: see :func:`as_population` (ids and counts only).

        Default: the users at the sampler's positions. Returns a :class:`Cohort` whose
        ``expected_size`` is fixed in advance. Deterministic given the sampler seed and ``step``
        (a retried step index gets the same cohort), never dependent on data values.
        """
        users = as_population(population).user_ids
        positions = self.sampler.sample(step, len(users))
        return Cohort(
            step=step,
            unit_ids=tuple(users[i] for i in positions.tolist()),
            expected_size=self.expected_cohort_size(population),
            unit=self.unit,
            padded_size=self.sampler.padded_size,
        )

    def expected_cohort_size(self, population: Any) -> float:
        """The normalizer of :meth:`server_update`: expected units per step (qN, p|D_sub|, N/b)
        for this population. Default: ``expected_cohort_size`` when the constructor was given
        one (fixed in advance, e.g. from a public N), else the sampler's expected size over the
        users (N treated as public)."""
        if self.fixed_cohort_size is not None:
            return float(self.fixed_cohort_size)
        return self.sampler.expected_size(len(as_population(population)))

    # ---- the worker's task ----------------------------------------------------------------------

    def configure_task(self, step: int, cohort: Cohort) -> TaskSpec:
        """What every task of this step tells its worker. Default: clip to ``clip_norm``, this
        strategy's unit and group size, one gradient per unit. Run-level options that do not
        change the mechanism (engine, token budget, ...) are applied by the caller
        (:class:`userdp.strategies.step.ExecutionOptions`)."""
        return TaskSpec(clip_norm=self.clip_norm, unit=self.unit, group_size=self.group_size)

    # ---- combining and privatizing --------------------------------------------------------------

    def add_noise(
        self, step: int, summed: Mapping[str, Any], stats: UnitStats | None = None
    ) -> dict[str, Any]:
        """Return ``summed + σ·C·noise`` (iid: z; BLT: (C⁻¹z)_step), a new dict; ``summed`` is
        not modified. The noise generator is seeded from ``os.urandom``; calling this twice for
        one step (a retry) draws different noise."""
        return self.noise.add(step, summed, std=self.noise_multiplier * self.clip_norm)

    def privatize(
        self, step: int, summed: Mapping[str, Any], stats: UnitStats, cohort: Cohort
    ) -> Release:
        """Everything this step releases, noised; ``stats`` are the cohort's unit statistics, not
        released as such (``count`` units, ``clipped`` of them with norm > C). Default:
        :meth:`add_noise` on the sum and no statistics. A strategy that releases a statistic next to the sum (adaptive clipping's
        clipped count) returns it here, noised, and accounts for it in :meth:`mechanism`."""
        return Release(step, cohort, self.add_noise(step, summed, stats))

    def privatize_units(
        self,
        step: int,
        updates: Mapping[str, Mapping[str, Any]],
        stats: UnitStats,
        cohort: Cohort,
    ) -> Release:
        """Everything this step releases, from every unit's own clipped update (``updates``:
        unit id → tensor dict, one per unit of ``cohort``). Called instead of :meth:`privatize`
        for a strategy with :attr:`needs_unit_updates`; the default refuses."""
        raise StrategyError(
            f"{type(self).__name__} privatizes the clipped sum; set needs_unit_updates = True "
            "and override privatize_units to receive every unit's update"
        )

    def server_update(self, params: Mapping[str, Any], release: Release) -> None:
        """Apply the step in place: ``params ← optimizer(params, noisy_sum / expected_size)``.

        Divides by ``release.cohort.expected_size`` (fixed in advance), never by the realized
        cohort size. Reads only the release, so any optimizer or schedule is post-processing."""
        expected = release.cohort.expected_size
        if not expected > 0:
            raise StrategyError(f"cohort.expected_size={expected!r}; expected > 0")
        scale = 1.0 / expected
        gradient = {name: value * scale for name, value in release.noisy_sum.items()}
        self.optimizer.step(params, gradient)

    # ---- privacy description ------------------------------------------------------------------

    @abstractmethod
    def mechanism(self) -> Mechanism:
        """The frozen description of ONE step for the ledger (:mod:`userdp.accounting.mechanisms`).
        Stable across the run unless the strategy documents why (it is appended per step)."""

    def caveats(self) -> tuple[str, ...]:
        """Report lines about this strategy; default: the sampler's (seed given, shuffle, ...)."""
        return self.sampler.caveats()

    def facts(self) -> PrivacyFacts:
        """Sampling scheme, adjacency and whether an accountant matches it (all stated by the
        sampler), which units are sampled, the noise generator's mode, and :meth:`caveats` (plus
        one when the noise is not secure). The privacy unit is the user."""
        rng = getattr(self.noise, "rng", None)
        secure = getattr(rng, "secure", None)
        caveats = self.caveats()
        if getattr(rng, "deterministic", False):  # a fixed test seed: the noise is known
            secure = False
            caveats += (DETERMINISTIC_NOISE_CAVEAT,)
        elif secure is False:
            caveats += (FAST_NOISE_CAVEAT,)
        return PrivacyFacts(
            unit=Unit.USER,
            sampling=self.sampler.sampling,
            adjacency=self.sampler.adjacency,
            sampling_matches_accounting=self.sampler.accounted,
            caveats=caveats,
            sampled=Unit(self.unit),
            secure_noise=secure,
        )

    def sampling_matches_accounting(self) -> bool:
        return self.facts().sampling_matches_accounting

    # ---- checkpoint -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe values plus numpy/torch arrays; never pickle. Holds the sampler (its secret
        seed), clip norm, optimizer state and correlated-noise buffers; NEVER the noise RNG."""
        return {
            "clip_norm": self.clip_norm,
            "sampler": self.sampler.state_dict(),
            "noise": self.noise.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`. The noise RNG is re-seeded from ``os.urandom``, so a resumed
        run never replays noise."""
        self.clip_norm = float(state["clip_norm"])
        self.sampler.load_state_dict(state["sampler"])
        self.noise.load_state_dict(state["noise"])
        self.optimizer.load_state_dict(state["optimizer"])
