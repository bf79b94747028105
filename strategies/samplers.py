"""Cohort samplers: which units contribute to step t, as positions into the population.

Every sampler is a seeded, checkpointable object whose draw for step t depends only on
(seed, t) — plus, for per-epoch schemes, the epoch — never on data values. A retried step index
therefore gets the SAME cohort: an aborted attempt released nothing, and redrawing after a
data-dependent failure would bias the released cohort away from the sampling distribution the
accountant assumes.

The seed is SECRET: amplification by sampling assumes the adversary does not know who was
sampled. By default it is drawn from ``os.urandom`` and lives only in the (protected)
checkpoint. An explicit seed is for tests and reproducibility studies; strategies add a caveat
to the privacy report when one was given.

Every sampler is a :class:`Sampler`: it names its scheme (:class:`~userdp.accounting.facts.Sampling`),
its adjacency and whether an accountant matches it, so strategies and the report take them from
the sampler that ran. Samplers (paper in brackets):

- :class:`PoissonSampler`: each unit independently with probability q (ULS users; ELS examples
  of D_sub) ["Fine-Tuning Large Language Models with User-Level Differential Privacy",
  Alg. 1/2]. Exact Bernoulli(q) inclusion via geometric gaps, O(qN).
- :class:`ExampleSubset`: D_sub, at most G examples per user, uniformly chosen ONCE [same, Alg. 1].
- :class:`BallsInBinsSampler`: each unit in exactly one of b bins; bins fixed for the run
  (``balls-in-bins-fixed``, for matrix mechanisms ["Near Exact Privacy Amplification for Matrix
  Mechanisms"]) or redrawn every epoch (``balls-in-bins-epoch``).
- :class:`CyclicPoissonSampler`: each unit in one of b groups, fixed for the run; step t
  Poisson-samples group t mod b (``cyclic-poisson``, for banded matrix factorization
  ["(Amplified) Banded Matrix Factorization: A unified approach to private training"]).
- :class:`ShuffleSampler`: fixed-size cohorts in shuffled order (what most published
  experiments run); NO accountant matches it — reports say so.
- :class:`TruncatedSampler`: pad/truncate any sampler's cohort to a fixed size (``padding``); the
  guarantee is then under zero-out adjacency.
"""

from __future__ import annotations

import logging
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import numpy as np
from userdp.accounting.facts import Adjacency, Sampling
from userdp.accounting.validation import positive_int, probability
from userdp.strategies.subset_draws import choose_subsets, top_ranks

__all__ = [
    "SEED_CAVEAT",
    "BallsInBinsSampler",
    "CyclicPoissonSampler",
    "ExampleSubset",
    "PoissonSampler",
    "Sampler",
    "SamplerError",
    "ShuffleSampler",
    "TruncatedSampler",
    "bins_for",
    "make_sampler",
    "padding_cap",
    "poisson_positions",
    "secret_seed",
]

log = logging.getLogger(__name__)


class SamplerError(ValueError):
    """A sampler parameter or call is invalid; the message says what is allowed."""


def secret_seed() -> int:
    """A 63-bit seed from ``os.urandom`` (JSON-safe integer)."""
    return int.from_bytes(os.urandom(8), "little") >> 1


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *stream])))


# stream tags, so different uses of one seed never share random numbers
_POISSON, _DSUB, _BINS, _SHUFFLE, _TRUNCATE, _CYCLIC = 1, 2, 3, 4, 5, 6


def poisson_positions(rng: np.random.Generator, n: int, q: float) -> np.ndarray:
    """Sorted positions in [0, n), each included independently with probability q.

    Gaps between included positions are iid Geometric(q), so drawing gaps and cumulating them
    gives exactly iid Bernoulli(q) indicators in O(qN) time (1M units, q=1%: well under 1 ms).
    """
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if q >= 1.0:
        return np.arange(n, dtype=np.int64)
    chunks = []
    last = -1
    while True:
        expected = (n - last - 1) * q
        k = int(expected + 6.0 * math.sqrt(expected) + 16)
        positions = last + np.cumsum(rng.geometric(q, size=k))
        done = positions[-1] >= n
        positions = positions[positions < n]
        chunks.append(positions)
        if done:
            break
        last = int(positions[-1])
    return np.concatenate(chunks).astype(np.int64, copy=False)


SEED_CAVEAT = (
    "the sampler seed was given explicitly; amplification by sampling assumes it is secret"
)


class Sampler(ABC):
    """Which units contribute to step t, as sorted positions into a population of n units.

    A sampler states what it is (:attr:`sampling`, :attr:`adjacency`, :attr:`accounted`: whether
    an accountant matches it), draws from (seed, step, n) only, and is checkpointed through
    :meth:`state_dict` (the base :class:`~userdp.strategies.base.Strategy` does this for its
    ``sampler``). The seed is secret: ``None`` draws one from ``os.urandom``.
    """

    sampling: Sampling
    adjacency: Adjacency = Adjacency.ADD_REMOVE
    accounted: bool = True
    padded_size: int | None = None
    """Fixed-size schemes: the number of slots a cohort is padded to (zero contributions)."""
    _cache: Any = None
    """What a sampler derived from its seed and keeps between steps (an assignment, a
    permutation); :meth:`load_state_dict` drops it with the seed it came from."""

    def __init__(self, seed: int | None) -> None:
        self.seed_was_given = seed is not None
        self.seed = int(seed) if seed is not None else secret_seed()

    @abstractmethod
    def sample(self, step: int, n: int) -> np.ndarray:
        """Sorted positions in [0, n) of step ``step``'s units."""

    @abstractmethod
    def expected_size(self, n: int) -> float:
        """The expected number of units per step out of n (the server's normalizer)."""

    def caveats(self) -> tuple[str, ...]:
        """What the privacy report must say about this sampler."""
        return (SEED_CAVEAT,) if self.seed_was_given else ()

    def state_dict(self) -> dict[str, Any]:
        return {
            "name": self.sampling.value,
            "seed": self.seed,
            "seed_was_given": self.seed_was_given,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("name") != self.sampling.value:
            raise SamplerError(
                f"sampler state is for {state.get('name')!r}; this sampler is "
                f"{self.sampling.value!r}"
            )
        self.seed = int(state["seed"])
        self.seed_was_given = bool(state["seed_was_given"])
        self._cache = None


class PoissonSampler(Sampler):
    """Each of n units independently with probability q, fresh every step."""

    sampling = Sampling.POISSON

    def __init__(self, sampling_prob: float, seed: int | None = None) -> None:
        super().__init__(seed)
        self.sampling_prob = probability(
            "sampling_prob", sampling_prob, SamplerError, upper_open=False
        )

    def sample(self, step: int, n: int) -> np.ndarray:
        return poisson_positions(_rng(self.seed, _POISSON, step), n, self.sampling_prob)

    def expected_size(self, n: int) -> float:
        return self.sampling_prob * n


class ExampleSubset:
    """D_sub of "Fine-Tuning Large Language Models with User-Level Differential Privacy", Alg. 1: for each user, at most G of its examples, chosen uniformly at
    random ONCE, independently of other users. Stored as CSR: ``offsets`` (users + 1) and the
    chosen example indices (sorted within a user); position i of D_sub belongs to user
    ``searchsorted(offsets, i, 'right') − 1``. ``ranked``: each user's ranks 0..min(G, n) − 1
    under a ranked data selection instead (:func:`~userdp.strategies.subset_draws.top_ranks`).
    """

    def __init__(self, examples_per_user: np.ndarray, group_size: int, seed: int, *, ranked=False):
        counts = np.asarray(examples_per_user, dtype=np.int64)
        if counts.ndim != 1 or (counts < 0).any():
            raise SamplerError("examples_per_user must be a 1-D array of non-negative integers")
        self.group_size = positive_int("group_size", group_size, SamplerError)
        self.examples_per_user = counts
        taken = np.minimum(counts, self.group_size)
        self.offsets = np.concatenate([[0], np.cumsum(taken)]).astype(np.int64)
        draw = top_ranks if ranked else lambda c, g: choose_subsets(_rng(seed, _DSUB), c, g)
        self.examples = draw(counts, self.group_size)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(user position, example index) of D_sub positions."""
        users = np.searchsorted(self.offsets, positions, side="right") - 1
        return users, self.examples[positions]


class BallsInBinsSampler(Sampler):
    """Each unit in exactly one of ``bins`` bins; step t uses bin t mod b of epoch ⌊t/b⌋.

    ``sampling=Sampling.BALLS_IN_BINS_FIXED``: one assignment for the whole run (the b-min-sep
    participation structure matrix mechanisms need; "Near Exact Privacy Amplification for Matrix
    Mechanisms", Def. 3.1). ``BALLS_IN_BINS_EPOCH``: a fresh assignment every epoch (random
    allocation; much better for plain DP-SGD). The assignment is a uniform permutation cut by
    Multinomial(N; 1/b, …) counts, which is the same law as iid uniform bins.
    """

    def __init__(
        self,
        bins: int,
        sampling: Sampling | str = Sampling.BALLS_IN_BINS_EPOCH,
        seed: int | None = None,
    ) -> None:
        super().__init__(seed)
        self.bins = positive_int("bins", bins, SamplerError)
        try:
            self.sampling = Sampling(sampling)
        except ValueError:
            self.sampling = None  # type: ignore[assignment]
        if self.sampling not in (Sampling.BALLS_IN_BINS_FIXED, Sampling.BALLS_IN_BINS_EPOCH):
            raise SamplerError(
                f"sampling={sampling!r} is not allowed; expected 'balls-in-bins-fixed' or "
                "'balls-in-bins-epoch'"
            )
        self._cache: tuple[int, int, np.ndarray, np.ndarray] | None = None

    @property
    def fixed(self) -> bool:
        return self.sampling is Sampling.BALLS_IN_BINS_FIXED

    def _assignment(self, epoch: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        key = 0 if self.fixed else epoch
        if self._cache is None or self._cache[:2] != (key, n):
            rng = _rng(self.seed, _BINS, key)
            counts = rng.multinomial(n, np.full(self.bins, 1.0 / self.bins))
            perm = rng.permutation(n)
            bounds = np.concatenate([[0], np.cumsum(counts)])
            self._cache = (key, n, perm, bounds)
        return self._cache[2], self._cache[3]

    def bin_of(self, epoch: int, n: int) -> np.ndarray:
        """Bin of every unit in ``epoch`` (for tests and reports)."""
        perm, bounds = self._assignment(epoch, n)
        bins = np.empty(n, dtype=np.int64)
        for b in range(self.bins):
            bins[perm[bounds[b] : bounds[b + 1]]] = b
        return bins

    def sample(self, step: int, n: int) -> np.ndarray:
        epoch, slot = divmod(step, self.bins)
        perm, bounds = self._assignment(epoch, n)
        return np.sort(perm[bounds[slot] : bounds[slot + 1]])

    def expected_size(self, n: int) -> float:
        return n / self.bins


class CyclicPoissonSampler(Sampler):
    """Cyclic Poisson sampling for banded matrix factorization (Choquette-Choo et al., "(Amplified)
    Banded Matrix Factorization: A unified approach to private training"): every unit is assigned
    ONCE to one of ``bins`` groups (a uniform random assignment, as in
    :class:`BallsInBinsSampler` with fixed bins); step t includes each unit of group t mod b
    independently with probability ``sampling_prob`` (the rate within the group), fresh every
    step. A unit's steps are therefore b apart, which a C with fewer than b diagonals needs."""

    sampling = Sampling.CYCLIC_POISSON

    def __init__(self, bins: int, sampling_prob: float, seed: int | None = None) -> None:
        super().__init__(seed)
        self.groups = BallsInBinsSampler(bins, Sampling.BALLS_IN_BINS_FIXED, self.seed)
        self.bins = self.groups.bins
        self.sampling_prob = probability(
            "sampling_prob", sampling_prob, SamplerError, upper_open=False
        )
        self._population: int | None = None

    def sample(self, step: int, n: int) -> np.ndarray:
        if self._population is not None and n != self._population:
            raise SamplerError(
                f"the population changed from {self._population} to {n} units: cyclic Poisson "
                "groups are assigned once for the run, and a new assignment would give a unit "
                "steps less than bins apart; keep the population fixed for the run"
            )
        self._population = n
        group = self.groups.sample(step % self.bins, n)
        keep = poisson_positions(_rng(self.seed, _CYCLIC, step), len(group), self.sampling_prob)
        return group[keep]

    def expected_size(self, n: int) -> float:
        return self.sampling_prob * n / self.bins

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "groups": self.groups.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.groups.load_state_dict(state["groups"])


SHUFFLE_CAVEAT = (
    "ACCOUNTING DOES NOT MATCH SAMPLING: fixed-size shuffled cohorts are accounted as Poisson "
    "sampling; the reported epsilon is not a privacy guarantee"
)


class ShuffleSampler(Sampler):
    """Fixed-size cohorts of round(q·n) units: shuffle the units each epoch, take consecutive
    blocks (the remainder of an epoch is dropped). ACCOUNTING DOES NOT MATCH THIS SAMPLING: no
    accountant here bounds shuffling; the ε reported for it is a Poisson stand-in, acceptable for
    comparing algorithms, never as a guarantee ("Scalable DP-SGD: Shuffling vs. Poisson
    Subsampling", Chua et al. 2024)."""

    sampling = Sampling.SHUFFLE
    accounted = False

    def __init__(self, sampling_prob: float, seed: int | None = None) -> None:
        super().__init__(seed)
        self.sampling_prob = probability(
            "sampling_prob", sampling_prob, SamplerError, upper_open=False
        )
        log.warning(
            "ShuffleSampler: fixed-size shuffled cohorts; the privacy accounting does NOT match "
            "this sampling and the reported epsilon is not a guarantee"
        )
        self._cache: tuple[int, int, np.ndarray] | None = None

    def cohort_size(self, n: int) -> int:
        return max(1, round(self.sampling_prob * n))

    def steps_per_epoch(self, n: int) -> int:
        size = self.cohort_size(n)
        if n < size:
            raise SamplerError(f"cohort size {size} exceeds the population ({n})")
        return n // size

    def sample(self, step: int, n: int) -> np.ndarray:
        size = self.cohort_size(n)
        epoch, slot = divmod(step, self.steps_per_epoch(n))
        if self._cache is None or self._cache[:2] != (epoch, n):
            self._cache = (epoch, n, _rng(self.seed, _SHUFFLE, epoch).permutation(n))
        return np.sort(self._cache[2][slot * size : (slot + 1) * size])

    def expected_size(self, n: int) -> float:
        return float(self.cohort_size(n))

    def caveats(self) -> tuple[str, ...]:
        return (*super().caveats(), SHUFFLE_CAVEAT)


class TruncatedSampler(Sampler):
    """Fixed-size cohorts from any sampler: keep a uniformly random ``size`` of its units when it
    drew more (the choice depends only on the count, never on data); the caller pads smaller
    cohorts to ``size`` with zero contributions. Valid under ZERO-OUT adjacency (a neighbour
    keeps the user's slot with a zero update); under add/remove, truncation can evict another
    user and the guarantee does not transfer."""

    sampling = Sampling.PADDING
    adjacency = Adjacency.ZERO_OUT

    def __init__(self, base: Sampler, size: int, seed: int | None = None) -> None:
        super().__init__(seed)
        self.base = base
        self.size = positive_int("size", size, SamplerError)
        self.padded_size = self.size

    def sample(self, step: int, n: int) -> np.ndarray:
        drawn = self.base.sample(step, n)
        if drawn.size <= self.size:
            return drawn
        keep = _rng(self.seed, _TRUNCATE, step).choice(drawn.size, self.size, replace=False)
        return np.sort(drawn[keep])

    def expected_size(self, n: int) -> float:
        return self.base.expected_size(n)

    def caveats(self) -> tuple[str, ...]:
        return (
            *super().caveats(),
            f"cohorts truncated/padded to {self.size} units: the guarantee holds under "
            "zero-out adjacency (a unit's update replaced by zero), not add/remove",
        )

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "base": self.base.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.base.load_state_dict(state["base"])


def bins_for(sampling_prob: float) -> int:
    """Bins of balls-in-bins sampling that includes each unit at rate ``sampling_prob``: round(1/q)."""
    return max(1, round(1.0 / sampling_prob))


def padding_cap(sampling_prob: float, num_users: int) -> int:
    """The fixed cohort of ``padding`` sampling: 4 standard deviations above the Poisson mean qN."""
    mean = sampling_prob * num_users
    return max(1, math.ceil(mean + 4 * math.sqrt(mean * (1 - sampling_prob))))


def make_sampler(
    sampling: Sampling | str,
    *,
    sampling_prob: float | None = None,
    bins: int | None = None,
    cohort_cap: int | None = None,
    seed: int | None = None,
) -> Sampler:
    """The sampler of a scheme (:class:`~userdp.accounting.facts.Sampling`): ``poisson`` and
    ``shuffle`` need ``sampling_prob``; ``padding`` needs ``sampling_prob`` and ``cohort_cap``;
    the balls-in-bins schemes need ``bins``; ``cyclic-poisson`` needs ``bins`` and ``sampling_prob``. ``seed=None``: a secret seed."""
    try:
        scheme = Sampling(sampling)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in Sampling)
        raise SamplerError(
            f"sampling={sampling!r} is not allowed; expected one of {allowed}"
        ) from None

    def need(name: str, value: Any) -> Any:
        if value is None:
            raise SamplerError(f"sampling={scheme.value!r} needs {name}=")
        return value

    if scheme in (Sampling.BALLS_IN_BINS_FIXED, Sampling.BALLS_IN_BINS_EPOCH):
        return BallsInBinsSampler(need("bins", bins), scheme, seed)
    q = need("sampling_prob", sampling_prob)
    if scheme is Sampling.CYCLIC_POISSON:
        return CyclicPoissonSampler(need("bins", bins), q, seed)
    if scheme is Sampling.SHUFFLE:
        return ShuffleSampler(q, seed)
    if scheme is Sampling.PADDING:
        return TruncatedSampler(PoissonSampler(q, seed), need("cohort_cap", cohort_cap), seed)
    return PoissonSampler(q, seed)
