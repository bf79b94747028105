"""The ``sampling`` conformance check: the sampler draws what the strategy's accountant assumes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from userdp.accounting.facts import Sampling
from userdp.strategies.base import parse_example_unit_id
from userdp.testing.stats import (
    binomial_interval,
    chi2_interval,
)

SHAPES = {"w": (400, 256), "b": (512,)}  # 102 912 coordinates: ~±1.7% χ² interval at 1e-7
STATISTIC_DRAWS = 4000
SAMPLING_STEPS = 300


class Skip(Exception):  # noqa: N818 - a control-flow signal, not an error
    """The check does not apply to this strategy (the message says why)."""


class SamplingChecks:
    """Kit's sampling check (:class:`userdp.testing.checks.Kit` mixes it in): the cohorts of a
    fresh strategy over many steps, against exact intervals for the mechanism's scheme."""

    factory: Callable[[], Any]
    population: Any

    def check_sampling(self) -> None:
        strategy = self.factory()
        mechanism, facts = strategy.mechanism(), strategy.facts()
        kind = mechanism.kind
        if kind in ("uls", "randomized-clipping") and facts.sampling == Sampling.POISSON:
            self._poisson_users(strategy, float(mechanism.sampling_prob))
        elif kind in ("els", "group-privacy"):
            self._poisson_examples(strategy, mechanism)
        elif kind == "balls-in-bins":
            self._balls_in_bins(strategy, mechanism)
        elif kind == "banded-poisson":
            self._cyclic_poisson(strategy, mechanism)
        else:
            raise Skip(f"no sampling check for mechanism {kind!r} with {facts.sampling.value!r}")

    def _cohorts(self, strategy: Any, steps: int) -> list[tuple[str, ...]]:
        return [strategy.sample_cohort(t, self.population).unit_ids for t in range(steps)]

    def _poisson_users(self, strategy: Any, q: float) -> None:
        users = self.population.user_ids
        position = {u: i for i, u in enumerate(users)}
        counts = np.zeros(len(users), dtype=np.int64)
        sizes = []
        for cohort in self._cohorts(strategy, SAMPLING_STEPS):
            sizes.append(len(cohort))
            for unit in cohort:
                counts[position[unit]] += 1
        trials = len(users) * SAMPLING_STEPS
        lo, hi = binomial_interval(trials, q)
        total = int(counts.sum())
        assert lo <= total <= hi, (
            f"users were included {total} times in {SAMPLING_STEPS} steps of {len(users)} users "
            f"(rate {total / trials:.5f}) but the mechanism says q = {q:g}: outside the exact "
            f"Binomial interval [{lo}, {hi}]"
        )
        rate = total / trials
        sizes_arr = np.asarray(sizes)
        dispersion = float(
            np.sum((sizes_arr - sizes_arr.mean()) ** 2) / (len(users) * rate * (1 - rate))
        )
        d_lo, d_hi = chi2_interval(SAMPLING_STEPS - 1, slack=0.05)
        assert d_lo <= dispersion <= d_hi, (
            f"cohort sizes (min {sizes_arr.min()}, max {sizes_arr.max()}) do not vary like "
            f"Binomial({len(users)}, {rate:.4f}): dispersion {dispersion:.1f} outside "
            f"[{d_lo:.1f}, {d_hi:.1f}]; the Poisson accountant does not match this sampler"
        )

    def _poisson_examples(self, strategy: Any, mechanism: Any) -> None:
        g, p = int(mechanism.group_size), float(mechanism.sampling_prob)
        counts = self.population.examples_per_user
        d_sub = int(np.minimum(counts, g).sum())
        distinct: dict[str, set[str]] = {}
        total = 0
        for cohort in self._cohorts(strategy, SAMPLING_STEPS):
            total += len(cohort)
            for unit in cohort:
                distinct.setdefault(parse_example_unit_id(unit)[0], set()).add(unit)
        most = max((len(v) for v in distinct.values()), default=0)
        assert most <= g, (
            f"a user contributed {most} distinct examples over the run; the mechanism's "
            f"group size is G = {g} (D_sub must be chosen once)"
        )
        lo, hi = binomial_interval(d_sub * SAMPLING_STEPS, p)
        assert lo <= total <= hi, (
            f"{total} example inclusions in {SAMPLING_STEPS} steps over |D_sub| = {d_sub} but "
            f"the mechanism says p = {p:g}: outside [{lo}, {hi}]"
        )

    def _cyclic_poisson(self, strategy: Any, mechanism: Any) -> None:
        """Cyclic Poisson: a user joins only steps of one residue mod b̂ (its group), and over
        whole cycles the inclusions are Binomial(N·cycles, p) (the groups partition the users)."""
        bands, p = int(mechanism.bands), float(mechanism.sampling_prob)
        cycles = max(1, SAMPLING_STEPS // bands)
        residue: dict[str, int] = {}
        total = 0
        for t, cohort in enumerate(self._cohorts(strategy, cycles * bands)):
            total += len(cohort)
            for unit in cohort:
                seen = residue.setdefault(unit, t % bands)
                assert seen == t % bands, (
                    f"user {unit!r} joined steps {seen} and {t} (mod {bands}); the banded-Poisson "
                    "accountant needs every user's steps to be b̂ apart (one group per user)"
                )
        lo, hi = binomial_interval(len(self.population.user_ids) * cycles, p)
        assert lo <= total <= hi, (
            f"{total} inclusions in {cycles} cycles of {bands} steps over "
            f"{len(self.population.user_ids)} users, but the mechanism says p = {p:g} within "
            f"the group: outside the exact Binomial interval [{lo}, {hi}]"
        )

    def _balls_in_bins(self, strategy: Any, mechanism: Any) -> None:
        bins = int(mechanism.bins)
        epochs = min(int(mechanism.epochs), 3)
        everyone = sorted(self.population.user_ids)
        slots = []
        for epoch in range(epochs):
            cohorts = [
                strategy.sample_cohort(epoch * bins + b, self.population).unit_ids
                for b in range(bins)
            ]
            assert sorted(u for c in cohorts for u in c) == everyone, (
                f"epoch {epoch}: balls-in-bins must include every user exactly once per epoch "
                f"of {bins} steps"
            )
            slots.append({u: b for b, c in enumerate(cohorts) for u in c})
        if mechanism.bin_semantics == "fixed" and epochs > 1:
            assert all(s == slots[0] for s in slots), (
                "bins changed between epochs but the mechanism says bin_semantics='fixed'"
            )
