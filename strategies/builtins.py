"""Built-in strategies: ULS (DP-FedSGD), DP-FedAvg, ELS, group privacy, randomized clipping.

All stated in seed 000's notation (notes/000.md §2): N users, q user sampling probability, p
example sampling probability, G group size, C clip norm, σ noise multiplier. Adaptive clipping is
in :mod:`userdp.strategies.adaptive_clipping`, BLT-DP-FTRL in :mod:`userdp.strategies.dpftrl`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from userdp.accounting.mechanisms import (
    BallsInBinsMechanism,
    ElsMechanism,
    GroupPrivacyMechanism,
    Mechanism,
    RandomizedClippingMechanism,
    UlsMechanism,
)
from userdp.strategies.base import (
    Cohort,
    PrivacyFacts,
    Strategy,
    StrategyError,
    TaskSpec,
    as_population,
    example_unit_id,
)
from userdp.strategies.noise import NoiseMechanism
from userdp.strategies.optimizers import ServerOptimizer
from userdp.strategies.samplers import (
    BallsInBinsSampler,
    ExampleSubset,
    PoissonSampler,
    ShuffleSampler,
    TruncatedSampler,
)

__all__ = [
    "SAMPLINGS",
    "DpFedAvg",
    "ExampleLevelSampling",
    "GroupPrivacyComparison",
    "RandomizedClipping",
    "UserLevelSampling",
]

log = logging.getLogger(__name__)

SAMPLINGS: tuple[str, ...] = ("poisson", "shuffle", "truncated", "balls-in-bins")

_SEED_CAVEAT = (
    "the sampler seed was given explicitly; amplification by sampling assumes it is secret"
)


_N_CAVEAT = (
    "the normalizer (expected cohort) is computed from the number of users N, treated as "
    "public; pass expected_cohort_size to fix it in advance"
)


class UserLevelSampling(Strategy):
    """DP-SGD-ULS / DP-FedSGD (seed 000 Alg. 2): Poisson users with probability q; each sampled
    user's gradient is the MEAN over at most G of its examples (fresh each step), clipped to C;
    the server adds N(0, σ²C²I) and divides by the expected cohort qN.

    ``sampling``: ``"poisson"`` (matches the accountant), ``"truncated"`` (Poisson, then at most
    ``cohort_cap`` users, padded: zero-out adjacency), ``"shuffle"`` (fixed size round(qN), no
    accountant matches), ``"balls-in-bins"`` (``bins`` per epoch for ``epochs``; Monte Carlo
    accountant; ``bin_semantics`` "per-epoch" or "fixed").

    ``expected_cohort_size``: a fixed normalizer (e.g. qN from a public N); by default qN (or N/b,
    or the shuffle size) is computed from the population, and the report says N was treated as
    public (it differs by one user between neighbouring datasets).
    """

    def __init__(
        self,
        *,
        noise_multiplier: float,
        clip_norm: float,
        sampling_prob: float | None = None,
        group_size: int = 1,
        sampling: str = "poisson",
        cohort_cap: int | None = None,
        bins: int | None = None,
        epochs: int | None = None,
        bin_semantics: str = "per-epoch",
        expected_cohort_size: float | None = None,
        seed: int | None = None,
        noise: NoiseMechanism | None = None,
        optimizer: ServerOptimizer | None = None,
    ) -> None:
        super().__init__(
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            unit="user",
            group_size=group_size,
            noise=noise,
            optimizer=optimizer,
        )
        if sampling not in SAMPLINGS:
            raise StrategyError(
                f"sampling={sampling!r} is not allowed; expected one of {SAMPLINGS}"
            )
        self.sampling = sampling
        self.sampling_prob = sampling_prob
        self.bins, self.epochs, self.bin_semantics = bins, epochs, bin_semantics
        self._population_size: int | None = None
        self._fixed_normalizer = expected_cohort_size
        if sampling == "balls-in-bins":
            if bins is None or epochs is None:
                raise StrategyError("sampling='balls-in-bins' needs bins= and epochs=")
            self.sampler: Any = BallsInBinsSampler(bins, bin_semantics, seed)
        else:
            if sampling_prob is None:
                raise StrategyError(f"sampling={sampling!r} needs sampling_prob= (q)")
            base = PoissonSampler(sampling_prob, seed)
            if sampling == "truncated":
                if cohort_cap is None:
                    raise StrategyError("sampling='truncated' needs cohort_cap=")
                base = TruncatedSampler(base, cohort_cap, seed)
            self.sampler = base
        self.cohort_cap = cohort_cap
        self._seed_given = seed is not None

    # -- sampling ------------------------------------------------------------------------------

    def sample_cohort(self, step: int, population: Any) -> Cohort:
        users = as_population(population).user_ids
        n = len(users)
        self._population_size = n
        if self.sampling == "shuffle" and not isinstance(self.sampler, ShuffleSampler):
            self.sampler = ShuffleSampler(max(1, round(self.sampling_prob * n)), self.sampler.seed)
        if self.sampling == "balls-in-bins" and step >= self.bins * self.epochs:
            raise StrategyError(
                f"step {step} is past bins × epochs = {self.bins * self.epochs}; the balls-in-bins "
                "mechanism was declared for that many steps"
            )
        positions = self.sampler.sample(step, n)
        return Cohort(
            step=step,
            unit_ids=tuple(users[i] for i in positions.tolist()),
            expected_size=self.expected_cohort_size,
            unit="user",
            padded_size=self.cohort_cap if self.sampling == "truncated" else None,
        )

    @property
    def expected_cohort_size(self) -> float:
        if self._fixed_normalizer is not None:
            return float(self._fixed_normalizer)
        if self._population_size is None:
            raise StrategyError("expected_cohort_size is known after the first sample_cohort")
        return self.sampler.expected_size(self._population_size)

    # -- privacy description ---------------------------------------------------------------------

    def mechanism(self) -> Mechanism:
        if self.sampling == "balls-in-bins":
            return BallsInBinsMechanism(
                noise_multiplier=self.noise_multiplier,
                bins=self.bins,
                epochs=self.epochs,
                bin_semantics=self.bin_semantics,
            )
        return UlsMechanism(
            noise_multiplier=self.noise_multiplier, sampling_prob=self.sampling_prob
        )

    def facts(self) -> PrivacyFacts:
        caveats = [_SEED_CAVEAT] if self._seed_given else []
        if self._fixed_normalizer is None:
            caveats.append(_N_CAVEAT)
        matches, adjacency = True, "add-remove"
        if self.sampling == "shuffle":
            matches = False
            caveats.append(
                "ACCOUNTING DOES NOT MATCH SAMPLING: fixed-size shuffled cohorts are accounted as "
                "Poisson sampling; the reported epsilon is not a privacy guarantee"
            )
        if self.sampling == "truncated":
            adjacency = "zero-out"
            caveats.append(
                f"cohorts truncated/padded to {self.cohort_cap} users: the guarantee holds under "
                "zero-out adjacency (a user's update replaced by zero), not add/remove"
            )
        name = {"poisson": "poisson-users", "truncated": "poisson-users-truncated"}.get(
            self.sampling, self.sampling
        )
        return PrivacyFacts("user", name, adjacency, matches, tuple(caveats))

    # -- checkpoint -------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        sampler_state = state["sampler"]
        if self.sampling == "shuffle":  # the ShuffleSampler is rebuilt from q at the next step
            self.sampler = PoissonSampler(self.sampling_prob, int(sampler_state["seed"]))
            self.sampler.seed_was_given = bool(sampler_state["seed_was_given"])
            return
        self.sampler.load_state_dict(sampler_state)


class DpFedAvg(UserLevelSampling):
    """DP-FedAvg (McMahan et al. 2018): like ULS, but each sampled user runs ``local_steps`` SGD
    steps (learning rate ``local_lr``) from the broadcast model and the clipped quantity is the
    model delta θ_broadcast − θ_local. Each user still contributes one vector of norm ≤ C, so the
    ULS accountant applies unchanged (seed 000 §9.1). The local loop runs on the worker."""

    def __init__(
        self,
        *,
        local_steps: int,
        local_lr: float,
        local_batch_size: int = 0,
        **uls: Any,
    ) -> None:
        super().__init__(**uls)
        self.task_template = TaskSpec(
            clip_norm=self.clip_norm,
            unit="user",
            group_size=self.group_size,
            local_steps=int(local_steps),
            local_lr=float(local_lr),
            local_batch_size=int(local_batch_size),
        )
        if local_steps < 1:
            raise StrategyError(f"local_steps={local_steps} is out of range; expected >= 1")

    def configure_task(self, step: int, cohort: Cohort) -> TaskSpec:
        from dataclasses import replace

        return replace(self.task_template, clip_norm=self.clip_norm)


class RandomizedClipping(UserLevelSampling):
    """DP-SGD-RC (notes/001.md): ULS where each user's norm is ESTIMATED with ``probes`` random
    probes (Hutchinson / Hutch++) and the user's gradient is clipped by the estimate; the realized
    sensitivity can exceed C with small probability, which the envelope accountant covers."""

    def __init__(self, *, probes: int, estimator: str = "hutchinson", **uls: Any) -> None:
        super().__init__(**uls)
        if self.sampling != "poisson":
            raise StrategyError("RandomizedClipping supports sampling='poisson' only")
        self.probes, self.estimator = int(probes), estimator
        self.mechanism()  # validate probes / estimator now

    def configure_task(self, step: int, cohort: Cohort) -> TaskSpec:
        return TaskSpec(
            clip_norm=self.clip_norm,
            unit="user",
            group_size=self.group_size,
            engine="randomized",
            probes=self.probes,
        )

    def mechanism(self) -> Mechanism:
        return RandomizedClippingMechanism(
            noise_multiplier=self.noise_multiplier,
            sampling_prob=self.sampling_prob,
            probes=self.probes,
            estimator=self.estimator,
        )


class ExampleLevelSampling(Strategy):
    """DP-SGD-ELS (seed 000 Alg. 1) with the user-level mixture-of-Gaussians accountant.

    D_sub = at most G examples per user, chosen uniformly ONCE (seeded); each step includes every
    example of D_sub independently with probability p, clips per example, adds N(0, σ²C²I) and
    divides by the expected batch B = p|D_sub| (or ``expected_batch_size`` when given, which
    keeps the normalizer independent of the data's example counts).
    """

    def __init__(
        self,
        *,
        noise_multiplier: float,
        clip_norm: float,
        sampling_prob: float,
        group_size: int,
        expected_batch_size: float | None = None,
        seed: int | None = None,
        noise: NoiseMechanism | None = None,
        optimizer: ServerOptimizer | None = None,
    ) -> None:
        super().__init__(
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            unit="example",
            group_size=group_size,
            noise=noise,
            optimizer=optimizer,
        )
        if group_size < 1:
            raise StrategyError(f"group_size={group_size} is out of range; expected >= 1")
        self.sampler = PoissonSampler(sampling_prob, seed)
        self.sampling_prob = float(sampling_prob)
        self.expected_batch_size = expected_batch_size
        self._seed_given = seed is not None
        self._subset: ExampleSubset | None = None
        self._subset_key: tuple[int, int] | None = None

    def subset(self, population: Any) -> ExampleSubset:
        """D_sub for this population (built once; rebuilt identically from the seed on resume)."""
        pop = as_population(population)
        counts = pop.require_examples(type(self).__name__)
        key = (len(pop), int(counts.sum()))
        if self._subset is None or self._subset_key != key:
            if self._subset is not None:
                raise StrategyError(
                    "the population changed during the run; D_sub is chosen once (Alg. 1)"
                )
            self._subset = ExampleSubset(counts, self.group_size, self.sampler.seed)
            self._subset_key = key
        return self._subset

    def sample_cohort(self, step: int, population: Any) -> Cohort:
        pop = as_population(population)
        subset = self.subset(pop)
        positions = self.sampler.sample(step, len(subset))
        users, examples = subset.locate(positions)
        ids = pop.user_ids
        unit_ids = tuple(
            example_unit_id(ids[u], e)
            for u, e in zip(users.tolist(), examples.tolist(), strict=True)
        )
        return Cohort(step, unit_ids, self.expected_cohort_size, unit="example")

    @property
    def expected_cohort_size(self) -> float:
        if self.expected_batch_size is not None:
            return float(self.expected_batch_size)
        if self._subset is None:
            raise StrategyError("expected_cohort_size is known after the first sample_cohort")
        return self.sampling_prob * len(self._subset)

    def mechanism(self) -> Mechanism:
        return ElsMechanism(
            noise_multiplier=self.noise_multiplier,
            sampling_prob=self.sampling_prob,
            group_size=self.group_size,
        )

    def facts(self) -> PrivacyFacts:
        caveats = [_SEED_CAVEAT] if self._seed_given else []
        if self.expected_batch_size is None:
            caveats.append(
                "the normalizer p|D_sub| is computed from per-user example counts and treated "
                "as public (seed 000 §2.1); pass expected_batch_size to avoid this"
            )
        return PrivacyFacts("user", "poisson-examples", "add-remove", True, tuple(caveats))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.sampler.load_state_dict(state["sampler"])
        self._subset, self._subset_key = None, None


class GroupPrivacyComparison(ExampleLevelSampling):
    """COMPARISON ONLY: ELS accounted by black-box group privacy (example-level ε converted to
    groups of G). Same training as :class:`ExampleLevelSampling`; its ε is never tighter."""

    def mechanism(self) -> Mechanism:
        return GroupPrivacyMechanism(
            noise_multiplier=self.noise_multiplier,
            sampling_prob=self.sampling_prob,
            group_size=self.group_size,
        )

    def facts(self) -> PrivacyFacts:
        base = super().facts()
        extra = "group-privacy accounting is a loose comparison baseline, not the run's guarantee"
        return PrivacyFacts(base.unit, base.sampling, base.adjacency, True, (*base.caveats, extra))
