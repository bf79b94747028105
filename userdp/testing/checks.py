"""The conformance checks themselves (:mod:`userdp.testing` runs them): one method of
:class:`Kit` per check, each driving the real step with known contributions and asserting
against the strategy's mechanism. The sampling check is in
:mod:`userdp.testing.sampling_checks`."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from userdp.accounting.correlation import from_spec
from userdp.accounting.facts import Adjacency, PrivacyFacts, Sampling
from userdp.accounting.mechanisms import mechanism_from_dict
from userdp.accounting.report import assumptions
from userdp.proto.results import TaskResult, TaskSum
from userdp.server.aggregation import StepGather, TensorSpec
from userdp.server.planning import plan_groups
from userdp.server.population import Population
from userdp.strategies.base import PopulationCounts, Strategy
from userdp.strategies.step import CohortSum, run_step
from userdp.strategies.unit_stats import UnitStats
from userdp.testing.sampling_checks import SamplingChecks, Skip
from userdp.testing.stats import (
    ALPHA,
    assert_gaussian_noise,
    assert_uncorrelated,
    std_bounds,
)

SHAPES = {"w": (400, 256), "b": (512,)}  # 102 912 coordinates: ~±1.7% χ² interval at 1e-7
STATISTIC_DRAWS = 4000


def _zeros(shapes: dict[str, tuple[int, ...]] = SHAPES) -> dict[str, np.ndarray]:
    return {name: np.zeros(shape) for name, shape in shapes.items()}


def _flat(tensors: dict[str, Any]) -> np.ndarray:
    return np.concatenate([np.asarray(v, dtype=np.float64).ravel() for v in tensors.values()])


class Kit(SamplingChecks):
    def __init__(self, factory: Callable[[], Any], users: int) -> None:
        self.factory = factory
        ids = tuple(f"user-{i:05d}" for i in range(users))
        counts = np.array([1 + (7 * i) % 9 for i in range(users)], dtype=np.int64)
        self.population = PopulationCounts(ids, counts)
        probe = factory()
        assert isinstance(probe, Strategy), (
            f"factory() returned {type(probe).__name__}, not a userdp.strategies.Strategy"
        )
        assert factory() is not probe, "factory() must build a NEW strategy on every call"

    # -- one step with known contributions -------------------------------------------------------

    def step(self, strategy: Any, step: int, params: dict[str, np.ndarray]) -> Any:
        """Run ``step`` with zero contributions from every unit; return (planned, release)."""
        seen: list[Any] = []

        def gather(planned: Any) -> CohortSum:
            return CohortSum(
                _zeros({k: v.shape for k, v in params.items()}),
                UnitStats(count=len(planned.cohort)),
            )

        planned, _, _ = run_step(
            strategy, step, params, self.population, gather, on_release=seen.append
        )
        return planned, seen[0]

    def innovation(self, mechanism: Any, step: int) -> tuple[float, float]:
        """(std factor of step ``step``'s noise, of its fresh part) per unit of σ·C: 1 and 1 for
        iid noise; ‖row_step(C⁻¹)‖ and |(C⁻¹)_00| for a correlation matrix C."""
        correlation = getattr(mechanism, "correlation", None)
        if correlation is None:
            return 1.0, 1.0
        inverse = from_spec(correlation).inverse_coefs(step + 1)
        return float(np.sqrt(np.sum(inverse**2))), abs(float(inverse[0]))

    # -- checks -----------------------------------------------------------------------------------

    def check_noise(self) -> None:
        strategy = self.factory()
        mechanism = strategy.mechanism()
        sigma = float(mechanism.noise_multiplier)
        released = []
        for step in range(3 if getattr(mechanism, "correlation", None) is not None else 1):
            planned, release = self.step(strategy, step, _zeros())
            clip = planned.task.clip_norm
            factor, _ = self.innovation(mechanism, step)
            values = _flat(release.noisy_sum)
            released.append((values, sigma * clip))
            what = (
                f"step {step}: release with zero contributions (σ = {sigma:g} from the "
                f"mechanism, C = {clip:g} from the task)"
            )
            if not release.statistics:
                assert_gaussian_noise(values, sigma * clip * factor, what)
                continue
            self._check_combined(strategy, planned, values, sigma, clip * factor, what)
        if strategy.facts().secure_noise:
            for step, (values, std) in enumerate(released):
                self._check_on_grid(values, std, step)

    @staticmethod
    def _check_on_grid(values: np.ndarray, std: float, step: int) -> None:
        """Secure noise: a release goes through the generator, which rounds it onto the power-of-
        two grid of its std (:func:`userdp.strategies.secure_random.grid_step`). Checked on the
        grid 2^16 times finer than σ·C's, so any std down to σ·C/256 passes; noise added by hand
        (x + std·z) lands on it with probability ~2⁻³⁰ per value."""
        gamma = 2.0 ** (math.floor(math.log2(std)) - 16)
        cells = values / gamma
        off = int(np.count_nonzero(cells != np.round(cells)))
        assert off == 0, (
            f"step {step}: {off} of {values.size} released values are off the noise grid although "
            "the facts say the noise is secure: release noise only through the generator "
            "(self.noise.add, rng.release, rng.noisy_scalar), never as x + std * z"
        )

    def _check_combined(self, strategy, planned, values, sigma, scale, what) -> None:
        """Sum and statistics together: one Gaussian mechanism of multiplier σ."""
        n = values.size
        parts = [(math.sqrt(float(values @ values) / n), scale, std_bounds(n))]
        small = {"b": np.zeros(4)}
        cohort = planned.cohort
        draws: dict[str, list[float]] = {}
        sensitivity: dict[str, float] = {}
        for _ in range(STATISTIC_DRAWS):
            release = strategy.privatize(planned.step, small, UnitStats(count=len(cohort)), cohort)
            for name, statistic in release.statistics.items():
                draws.setdefault(name, []).append(statistic.value)
                sensitivity[name] = statistic.sensitivity
        for name, values_of in draws.items():
            x = np.asarray(values_of)
            measured = float(x.std(ddof=1))
            parts.append((measured, sensitivity[name], std_bounds(x.size - 1)))
        ratios = [(s / d) for s, d, _ in parts]
        if min(ratios) == 0:
            names = ["sum", *draws]
            exact = [names[i] for i, r in enumerate(ratios) if r == 0]
            raise AssertionError(f"{what}: {exact} released WITHOUT noise")
        effective = sum(r**-2 for r in ratios) ** -0.5
        lo = sigma * min(b[0] for *_, b in parts)
        hi = sigma * max(b[1] for *_, b in parts)
        assert lo <= effective <= hi, (
            f"{what}: the sum and statistics {sorted(draws)} together are a Gaussian mechanism "
            f"of multiplier {effective:.4g} (sum std/C = {ratios[0]:.4g}; "
            + ", ".join(
                f"{k} std/sensitivity = {r:.4g}" for k, r in zip(draws, ratios[1:], strict=True)
            )
            + f"), but the ledger records σ = {sigma:g} (acceptance [{lo:.4g}, {hi:.4g}])"
        )

    def check_normalization(self) -> None:
        strategy = self.factory()
        expected = strategy.expected_cohort_size(self.population)
        sizes = {}
        for step in range(20):
            cohort = strategy.sample_cohort(step, self.population)
            sizes[step] = (len(cohort), cohort.expected_size)
            assert cohort.expected_size == expected, (
                f"step {step}: cohort.expected_size = {cohort.expected_size:g} but "
                f"expected_cohort_size(population) = {expected:g}: the normalizer must be fixed "
                "before the step, not follow the realized cohort"
            )
        assert expected > 0, f"expected_cohort_size = {expected!r}; expected > 0"
        first, release = self.step(strategy, 0, _zeros())
        small_cohort = replace(first.cohort, unit_ids=first.cohort.unit_ids[:1])
        large_cohort = replace(first.cohort, unit_ids=tuple(self.population.user_ids))
        after = []
        for cohort in (small_cohort, large_cohort):
            twin = self.factory()
            twin.load_state_dict(strategy.state_dict())
            params = _zeros()
            twin.server_update(params, replace(release, cohort=cohort))
            after.append(_flat(params))
        assert np.allclose(after[0], after[1], rtol=1e-12, atol=0), (
            f"the server update of one release differs between a realized cohort of "
            f"{len(small_cohort)} and of {len(large_cohort)} units (expected size "
            f"{expected:g} in both): it must divide by cohort.expected_size, never the realized "
            "size, which is private"
        )

    def check_exactly_once(self) -> None:
        strategy = self.factory()
        users = self.population.user_ids
        shards = [f"shard-{i}" for i in range(4)]
        population = Population(
            shard_of_user={u: shards[i % 4] for i, u in enumerate(users)},
            shard_sha256={s: "0" * 64 for s in shards},
            examples_of_user=dict(
                zip(users, self.population.examples_per_user.tolist(), strict=True)
            ),
        )
        step = 0
        cohort = strategy.sample_cohort(step, population)
        while len(cohort) < 2 and step < 50:
            step += 1
            cohort = strategy.sample_cohort(step, population)
        units = list(cohort.unit_ids)
        assert len(set(units)) == len(units), (
            f"step {step}: the cohort holds a unit more than once "
            f"({len(units) - len(set(units))} duplicates): its contribution would count twice"
        )
        if len(units) < 2:
            raise Skip(f"no step in 0..{step} sampled two or more units")
        task = strategy.configure_task(step, cohort)
        index = {u: i for i, u in enumerate(units)}
        dim = 8

        def contribution(unit: str) -> torch.Tensor:
            vector = torch.zeros(dim)
            vector[index[unit] % dim] = task.clip_norm / (2 + index[unit] % 5)
            return vector

        groups = plan_groups(step, units, population.shard_of_unit)
        probes = task.probes if task.engine == "randomized" else 0
        gather = StepGather(
            step,
            1,
            groups,
            {"w": TensorSpec((dim,), "float32")},
            task.clip_norm,
            estimate_probes=probes,
        )

        def partial(task_id: str, attempt: int, worker: str) -> TaskResult:
            members = gather.task_units(task_id)
            total = sum((contribution(u) for u in members), torch.zeros(dim))
            stats = UnitStats(count=len(members))
            return TaskResult(
                task_id, attempt, step, 1, worker, members, TaskSum({"w": total}, stats)
            )

        for i, group in enumerate(groups):
            task_id, attempt = gather.issue(f"worker-{i}", [group.group_id], 0.0)
            if i == 0:  # timed out and re-issued: the late first result still arrives
                gather.fail(task_id, attempt, "timeout")
                late = partial(task_id, attempt, f"worker-{i}")
                task_id, attempt = gather.issue("worker-spare", [group.group_id], 1.0)
                gather.offer(partial(task_id, attempt, "worker-spare"))
                gather.offer(late)
                continue
            result = partial(task_id, attempt, f"worker-{i}")
            gather.offer(result)
            gather.offer(result)  # delivered twice
        assert gather.complete(), "the gather did not complete with every task answered"
        got = gather.result()
        want = sum((contribution(u) for u in units), torch.zeros(dim)).double()
        assert got.stats.count == len(units) and torch.allclose(
            got.sums["w"].double(), want, rtol=0, atol=1e-6
        ), (
            f"a duplicated delivery and a late re-issued result gave count {got.stats.count} for "
            f"{len(units)} units: each unit must count exactly once"
        )

    def check_fresh_noise(self) -> None:
        strategy = self.factory()
        mechanism = strategy.mechanism()
        stateful = bool(strategy.noise.state_dict())
        if not stateful:
            _, first = self.step(strategy, 5, _zeros())
            _, retry = self.step(strategy, 5, _zeros())
            assert_uncorrelated(
                _flat(first.noisy_sum), _flat(retry.noisy_sum), "step 5 and its retry"
            )
        original = self.factory()
        before = [_flat(self.step(original, step, _zeros())[1].noisy_sum) for step in range(2)]
        restored = self.factory()
        restored.load_state_dict(original.state_dict())
        for step in (7, 2):
            same = original.sample_cohort(step, self.population).unit_ids
            assert restored.sample_cohort(step, self.population).unit_ids == same, (
                f"step {step}: a strategy restored from state_dict() samples a different "
                "cohort (the sampler's state is not checkpointed)"
            )
        planned, a = self.step(original, 2, _zeros())
        _, b = self.step(restored, 2, _zeros())
        difference = _flat(a.noisy_sum) - _flat(b.noisy_sum)
        what = "step 2 released by a run and by its restored copy"
        if not stateful:
            for step, earlier in enumerate(before):
                assert_uncorrelated(
                    _flat(b.noisy_sum),
                    earlier,
                    f"the restored copy's step 2 vs the original's step {step} (noise replayed)",
                    ALPHA / 2,
                )
        assert np.any(difference != 0), f"{what}: identical noise (noise replayed after resume)"
        if stateful:
            _, fresh = self.innovation(mechanism, 2)
            scale = float(mechanism.noise_multiplier) * planned.task.clip_norm * fresh
        else:
            values = _flat(a.noisy_sum)
            scale = math.sqrt(float(values @ values) / values.size)
        assert_gaussian_noise(
            difference,
            math.sqrt(2) * scale,
            f"{what}: their difference must be two independent fresh draws (the correlated "
            "part, from the restored buffers, cancels)",
        )

    def check_facts(self) -> None:
        strategy = self.factory()
        mechanism, facts = strategy.mechanism(), strategy.facts()
        assert isinstance(facts, PrivacyFacts), (
            f"facts() returned {type(facts).__name__}, not a PrivacyFacts"
        )
        assert mechanism_from_dict(mechanism.to_dict()) == mechanism, (
            "the mechanism does not round-trip through the ledger's JSON"
        )
        kind = mechanism.kind
        semantics = getattr(mechanism, "bin_semantics", None)
        if kind == "balls-in-bins":
            assert facts.sampling.bin_semantics == semantics, (
                f"facts say sampling {facts.sampling.value!r} but the ledger's balls-in-bins "
                f"accountant has bin_semantics={semantics!r}"
            )
        else:
            assert facts.sampling.bin_semantics is None, (
                f"facts say {facts.sampling.value!r} but the mechanism is {kind!r}, which is "
                "not a balls-in-bins accountant"
            )
        zero_out = facts.sampling is Sampling.PADDING
        assert (facts.adjacency is Adjacency.ZERO_OUT) == zero_out, (
            f"sampling {facts.sampling.value!r} with adjacency {facts.adjacency.value!r}: "
            "padded/truncated cohorts hold under zero-out adjacency only (and only they do)"
        )
        if not facts.sampling_matches_accounting:
            assert any("NOT MATCH" in c.upper() for c in facts.caveats), (
                "the facts say no accountant matches the sampler but no caveat says so"
            )
        _, expected_match, _ = assumptions(facts.unit, facts.sampling, [kind])
        assert facts.sampling_matches_accounting == expected_match, (
            f"facts claim sampling_matches_accounting = {facts.sampling_matches_accounting} for "
            f"{facts.sampling.value!r}; the report's table says {expected_match}"
        )
