"""Built-in strategies: ULS (DP-FedSGD), DP-FedAvg, ELS, group privacy, randomized clipping.

Notation of "Fine-Tuning Large Language Models with User-Level Differential Privacy" (§2): N
users, q user sampling probability, p example sampling probability, G group size, C clip norm,
σ noise multiplier. Adaptive clipping is in :mod:`userdp.strategies.adaptive_clipping`,
BLT-DP-FTRL in :mod:`userdp.strategies.dpftrl`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from userdp.accounting.facts import Sampling
from userdp.accounting.mechanisms import (
    BallsInBinsMechanism,
    ElsMechanism,
    GroupPrivacyMechanism,
    Mechanism,
    RandomizedClippingMechanism,
    UlsMechanism,
)
from userdp.accounting.validation import positive_int
from userdp.strategies.base import (
    Cohort,
    Strategy,
    StrategyError,
    TaskSpec,
    as_population,
    example_unit_id,
)
from userdp.strategies.noise import NoiseMechanism
from userdp.strategies.optimizers import ServerOptimizer
from userdp.strategies.population import EXAMPLE_UNIT_SELECTIONS, RANKED_SELECTIONS
from userdp.strategies.samplers import (
    BallsInBinsSampler,
    ExampleSubset,
    PoissonSampler,
    SamplerError,
    make_sampler,
)

__all__ = [
    "N_CAVEAT",
    "DpFedAvg",
    "ExampleLevelSampling",
    "GroupPrivacyComparison",
    "RandomizedClipping",
    "UserLevelSampling",
]

N_CAVEAT = (
    "the normalizer (expected cohort) is computed from the number of users N, treated as "
    "public; set strategy.expected_cohort_size (expected_cohort_size= in Python) to fix it in "
    "advance"
)


class UserLevelSampling(Strategy):
    """DP-SGD-ULS / DP-FedSGD (Alg. 2 of "Fine-Tuning Large Language Models with User-Level
    Differential Privacy"): users sampled with probability q; each sampled user's gradient is the
    MEAN over at most G of its examples (fresh each step), clipped to C; the server adds
    N(0, σ²C²I) and divides by the expected cohort qN.

    ``sampling`` (:class:`~userdp.accounting.facts.Sampling`): ``"poisson"`` (matches the
    accountant), ``"padding"`` (Poisson, then at most ``cohort_cap`` users, padded: zero-out
    adjacency), ``"shuffle"`` (fixed size round(qN), no accountant matches), or
    ``"balls-in-bins-epoch"`` / ``"balls-in-bins-fixed"`` (``bins`` bins for ``epochs`` epochs;
    Monte Carlo accountant).

    ``expected_cohort_size``: a fixed normalizer (e.g. qN from a public N); by default qN (or N/b,
    or the shuffle size) is computed from the population, and the report says N was treated as
    public (it differs by one user between neighbouring datasets).
    """

    samplings = ("poisson", "padding", "shuffle", "balls-in-bins-epoch", "balls-in-bins-fixed")

    def __init__(
        self,
        *,
        noise_multiplier: float,
        clip_norm: float,
        sampling_prob: float | None = None,
        group_size: int = 1,
        sampling: Sampling | str = Sampling.POISSON,
        cohort_cap: int | None = None,
        bins: int | None = None,
        epochs: int | None = None,
        expected_cohort_size: float | None = None,
        seed: int | None = None,
        noise: NoiseMechanism | None = None,
        optimizer: ServerOptimizer | None = None,
    ) -> None:
        try:
            sampler = make_sampler(
                sampling, sampling_prob=sampling_prob, bins=bins, cohort_cap=cohort_cap, seed=seed
            )
        except SamplerError as exc:
            raise StrategyError(str(exc)) from None
        if sampler.sampling is Sampling.CYCLIC_POISSON:
            raise StrategyError(
                "sampling='cyclic-poisson' is for banded matrix factorization: use BltDpFtrl "
                "with sampling_prob= and bands= (its accountant needs the banded C)"
            )
        if isinstance(sampler, BallsInBinsSampler) and epochs is None:
            raise StrategyError(f"sampling={sampler.sampling.value!r} needs bins= and epochs=")
        super().__init__(
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            sampler=sampler,
            unit="user",
            group_size=group_size,
            noise=noise,
            optimizer=optimizer,
            expected_cohort_size=expected_cohort_size,
        )
        self.sampling_prob = sampling_prob
        self.bins, self.epochs = bins, epochs
        self.cohort_cap = cohort_cap

    @property
    def sampling(self) -> Sampling:
        return self.sampler.sampling

    # -- sampling ------------------------------------------------------------------------------

    def sample_cohort(self, step: int, population: Any) -> Cohort:
        if self.epochs is not None and step >= self.bins * self.epochs:
            raise StrategyError(
                f"step {step} is past bins × epochs = {self.bins * self.epochs}; the balls-in-bins "
                "mechanism was declared for that many steps"
            )
        return super().sample_cohort(step, population)

    # -- privacy description ---------------------------------------------------------------------

    def mechanism(self) -> Mechanism:
        if isinstance(self.sampler, BallsInBinsSampler):
            return BallsInBinsMechanism(
                noise_multiplier=self.noise_multiplier,
                bins=self.bins,
                epochs=self.epochs,
                bin_semantics=self.sampling.bin_semantics,
            )
        return UlsMechanism(
            noise_multiplier=self.noise_multiplier, sampling_prob=self.sampling_prob
        )

    def caveats(self) -> tuple[str, ...]:
        own = (N_CAVEAT,) if self.fixed_cohort_size is None else ()
        return (*super().caveats(), *own)

    def _require_poisson(self) -> None:
        if self.sampling is not Sampling.POISSON:
            raise StrategyError(f"{type(self).__name__} supports sampling='poisson' only")


class DpFedAvg(UserLevelSampling):
    """DP-FedAvg (McMahan et al. 2018, "Learning Differentially Private Recurrent Language
    Models"): like ULS, but each sampled user runs ``local_steps`` SGD steps (learning rate
    ``local_lr``) from the broadcast model and the clipped quantity is the model delta
    θ_broadcast − θ_local. Each user still contributes one vector of norm ≤ C, so the ULS
    accountant applies unchanged. The local loop runs on the worker."""

    def __init__(
        self,
        *,
        local_steps: int,
        local_lr: float,
        local_batch_size: int = 0,
        **uls: Any,
    ) -> None:
        super().__init__(**uls)
        positive_int("local_steps", local_steps, StrategyError)
        self.task_template = TaskSpec(
            clip_norm=self.clip_norm,
            unit="user",
            group_size=self.group_size,
            local_steps=int(local_steps),
            local_lr=float(local_lr),
            local_batch_size=int(local_batch_size),
        )

    def configure_task(self, step: int, cohort: Cohort) -> TaskSpec:
        return replace(self.task_template, clip_norm=self.clip_norm)


class RandomizedClipping(UserLevelSampling):
    """DP-SGD-RC ("Efficient DP-SGD for LLMs with Randomized Clipping"): ULS where each user's
    norm is ESTIMATED with ``probes`` random probes (Hutchinson / Hutch++) and the user's
    gradient is clipped by the estimate; the realized sensitivity can exceed C with small
    probability, which the envelope accountant covers."""

    samplings = ("poisson",)
    estimates_norms = True

    def __init__(self, *, probes: int, estimator: str = "hutchinson", **uls: Any) -> None:
        super().__init__(**uls)
        self._require_poisson()
        self.probes, self.estimator = int(probes), estimator
        self.mechanism()  # validate probes / estimator now

    def configure_task(self, step: int, cohort: Cohort) -> TaskSpec:
        return TaskSpec(
            clip_norm=self.clip_norm,
            unit="user",
            group_size=self.group_size,
            engine="randomized",
            probes=self.probes,
            estimator=self.estimator,
        )

    def mechanism(self) -> Mechanism:
        return RandomizedClippingMechanism(
            noise_multiplier=self.noise_multiplier,
            sampling_prob=self.sampling_prob,
            probes=self.probes,
            estimator=self.estimator,
        )


class ExampleLevelSampling(Strategy):
    """DP-SGD-ELS (Alg. 1 of "Fine-Tuning Large Language Models with User-Level Differential
    Privacy") with the user-level mixture-of-Gaussians accountant.

    D_sub = at most G examples per user, chosen ONCE: uniformly (seeded) with ``selection =
    "random"``, or each user's first G under a ranked selection (``longest``, ``shortest``,
    ``highest_ppl``, ``lowest_ppl``: the record choices of group privacy in Chua et al., "Mind the
    Privacy Unit! User-Level Differential Privacy for Language Model Fine-Tuning", §4.1), which
    the workers resolve on the users' own records. Each step includes every example of D_sub
    independently with probability p, clips per example, adds N(0, σ²C²I) and divides by the
    expected batch B = p|D_sub| (or ``expected_batch_size`` when given, which keeps the
    normalizer independent of the data's example counts). The accountant only needs each user's
    D_sub to hold at most G of its own records, which both choices keep.
    """

    samplings = ("poisson",)
    record_units = True

    def __init__(
        self,
        *,
        noise_multiplier: float,
        clip_norm: float,
        sampling_prob: float,
        group_size: int,
        expected_batch_size: float | None = None,
        selection: str = "random",
        seed: int | None = None,
        noise: NoiseMechanism | None = None,
        optimizer: ServerOptimizer | None = None,
    ) -> None:
        positive_int("group_size", group_size, StrategyError)
        if selection not in EXAMPLE_UNIT_SELECTIONS:
            raise StrategyError(
                f"selection={selection!r} does not choose whole records for D_sub; expected one "
                f"of {', '.join(EXAMPLE_UNIT_SELECTIONS)}"
            )
        try:
            sampler = PoissonSampler(sampling_prob, seed)
        except SamplerError as exc:
            raise StrategyError(str(exc)) from None
        super().__init__(
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            sampler=sampler,
            unit="example",
            group_size=group_size,
            noise=noise,
            optimizer=optimizer,
        )
        self.sampling_prob = float(sampling_prob)
        self.expected_batch_size = expected_batch_size
        self.selection = selection
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
            self._subset = ExampleSubset(
                counts,
                self.group_size,
                self.sampler.seed,
                ranked=self.selection in RANKED_SELECTIONS,
            )
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
        return Cohort(step, unit_ids, self.expected_cohort_size(pop), unit="example")

    def expected_cohort_size(self, population: Any) -> float:
        if self.expected_batch_size is not None:
            return float(self.expected_batch_size)
        return self.sampler.expected_size(len(self.subset(population)))

    def mechanism(self) -> Mechanism:
        return ElsMechanism(
            noise_multiplier=self.noise_multiplier,
            sampling_prob=self.sampling_prob,
            group_size=self.group_size,
        )

    def caveats(self) -> tuple[str, ...]:
        own = ()
        if self.expected_batch_size is None:
            own = (
                "the normalizer p|D_sub| is computed from per-user example counts and treated "
                "as public; set strategy.expected_batch_size (expected_batch_size= in Python) "
                "to fix it in advance",
            )
        return (*super().caveats(), *own)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
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
