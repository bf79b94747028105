"""Deliberately broken variants of userdp: one pytest fixture per classic DP bug.

Each fixture injects ONE bug into the real code path with ``monkeypatch`` (undone after the test)
by replacing a real method or constant with the buggy version an engineer could plausibly write.
``test_bugs.py`` runs every check under the mutations it must catch and requires an
AssertionError from the check itself (its message is matched), so the suite is tested too.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import pytest
import torch
from userdp.accounting import api as accounting_api
from userdp.accounting.ledger import Ledger
from userdp.server import aggregation
from userdp.server.aggregation import StepGather, Verdict
from userdp.strategies import noise as noise_module
from userdp.strategies import samplers
from userdp.strategies import tensors as T
from userdp.strategies.base import NoisyStatistic, Release, Strategy, as_population
from userdp.strategies.blt import BandedNoise
from userdp.strategies.builtins import ExampleLevelSampling, RandomizedClipping, UserLevelSampling
from userdp.strategies.noise import GaussianNoise, NoiseMechanism, NoiseRng

# ---------------------------------------------------------------------------------------------
# noise scale and normalization


def _add_noise_with_std(std_of):
    def add_noise(self, step, summed, stats=None):
        return self.noise.add(step, summed, std=std_of(self))

    return add_noise


@pytest.fixture
def mutation_noise_not_scaled_by_clip(monkeypatch):
    """std = σ instead of σ·C (the uncalibrated-noise bug of "Finding Private Bugs: Debugging
    Implementations of Differentially Private Stochastic Gradient Descent", §3.2)."""
    monkeypatch.setattr(Strategy, "add_noise", _add_noise_with_std(lambda s: s.noise_multiplier))


@pytest.fixture
def mutation_noise_std_sigma_squared(monkeypatch):
    """std = σ²·C (σ² mistaken for the std)."""
    monkeypatch.setattr(
        Strategy, "add_noise", _add_noise_with_std(lambda s: s.noise_multiplier**2 * s.clip_norm)
    )


def _privatize_with_std(std_of):
    """``privatize`` whose sum noise has std ``std_of(strategy, cohort)``."""

    def privatize(self, step, summed, stats, cohort):
        noisy = self.noise.add(step, summed, std=std_of(self, cohort))
        return Release(step, cohort, noisy)

    return privatize


@pytest.fixture
def mutation_noise_std_times_sqrt_cohort(monkeypatch):
    """std = σ·C·√B: noise added per unit and summed (per-example noise, √B too large)."""
    monkeypatch.setattr(
        Strategy,
        "privatize",
        _privatize_with_std(
            lambda s, cohort: s.noise_multiplier * s.clip_norm * math.sqrt(cohort.expected_size)
        ),
    )


@pytest.fixture
def mutation_noise_std_over_cohort(monkeypatch):
    """std = σ·C/B on the SUM: the noise is divided by B twice (1/B too small)."""
    monkeypatch.setattr(
        Strategy,
        "privatize",
        _privatize_with_std(
            lambda s, cohort: s.noise_multiplier * s.clip_norm / cohort.expected_size
        ),
    )


@pytest.fixture
def mutation_no_noise(monkeypatch):
    """The noise is never added (e.g. a debug flag left on)."""
    monkeypatch.setattr(Strategy, "add_noise", lambda self, step, summed, stats=None: dict(summed))


@pytest.fixture
def mutation_normalize_by_realized_cohort(monkeypatch):
    """The server divides the noisy sum by the REALIZED cohort size instead of the expected one."""

    def server_update(self, params, release):
        scale = 1.0 / max(len(release.cohort), 1)
        noisy_sum = release.noisy_sum
        self.optimizer.step(params, {name: value * scale for name, value in noisy_sum.items()})

    monkeypatch.setattr(Strategy, "server_update", server_update)


@pytest.fixture
def mutation_blt_noise_not_correlated(monkeypatch):
    """BLT/banded noise drawn iid: C⁻¹ is never applied, but the ledger records the correlation."""

    def sample(self, step, like):
        self._advance(step)
        return {name: self.rng.normal_like(value) for name, value in like.items()}

    monkeypatch.setattr(BandedNoise, "sample", sample)


# ---------------------------------------------------------------------------------------------
# noise on every parameter


def _noise_only_where(keep):
    original = NoiseMechanism.add

    def add(self, step, summed, *, std):
        noisy = original(self, step, summed, std=std)
        return {
            name: noisy[name] if keep(value) else summed[name] for name, value in summed.items()
        }

    return add


@pytest.fixture
def mutation_noise_skips_zero_sum_tensors(monkeypatch):
    """Tensors whose clipped sum is exactly zero get no noise (a "sparse update" shortcut: LoRA's
    A matrices at initialization, layers no sampled user touched)."""
    monkeypatch.setattr(
        NoiseMechanism, "add", _noise_only_where(lambda v: bool(np.any(T.to_numpy(v) != 0)))
    )


@pytest.fixture
def mutation_noise_only_on_matrices(monkeypatch):
    """Noise only on ≥ 2-D tensors: biases, LayerNorm gains and 1-D adapters are released raw."""
    monkeypatch.setattr(NoiseMechanism, "add", _noise_only_where(lambda v: np.ndim(v) >= 2))


# ---------------------------------------------------------------------------------------------
# secure noise


@pytest.fixture
def mutation_noise_off_grid(monkeypatch):
    """The secure generator's draws are added in plain floating point (no rounding onto the grid):
    the release's low-order bits depend on the input."""

    def release(self, value, std, z):
        return np.asarray(value) + std * np.asarray(z)

    monkeypatch.setattr(NoiseRng, "release", release)


@pytest.fixture
def mutation_noisy_scalar_off_grid(monkeypatch):
    """A scalar release (adaptive clipping's count) adds the draw in plain floating point."""

    def noisy_scalar(self, value, std):
        return float(value) + std * self.standard_normal()

    monkeypatch.setattr(NoiseRng, "noisy_scalar", noisy_scalar)


@pytest.fixture
def mutation_fast_noise_by_default(monkeypatch):
    """A generator built without arguments is the fast floating-point one."""
    original = NoiseRng.__init__

    def init(self, *, secure=False, _test_seed=None):
        original(self, secure=secure, _test_seed=_test_seed)

    monkeypatch.setattr(NoiseRng, "__init__", init)


@pytest.fixture
def mutation_facts_claim_secure_noise(monkeypatch):
    """The strategy's privacy facts always say the noise was secure, without the caveat."""
    from userdp.strategies.base import Strategy
    from userdp.strategies.noise import FAST_NOISE_CAVEAT

    original = Strategy.facts

    def facts(self):
        stated = original(self)
        caveats = tuple(c for c in stated.caveats if c != FAST_NOISE_CAVEAT)
        return dataclasses.replace(stated, secure_noise=True, caveats=caveats)

    monkeypatch.setattr(Strategy, "facts", facts)


# ---------------------------------------------------------------------------------------------
# noise reuse


@pytest.fixture
def mutation_noise_generator_reseeded_identically(monkeypatch):
    """The noise generator is reset to its initial seed before every draw (every step, every
    tensor gets the same stream)."""
    original_seed, original = NoiseRng._seed, NoiseRng.normal_like

    def seed(self, entropy):
        if not hasattr(self, "_mutation_entropy"):
            self._mutation_entropy = entropy
        original_seed(self, entropy)

    def normal_like(self, x):
        original_seed(self, self._mutation_entropy)
        return original(self, x)

    monkeypatch.setattr(NoiseRng, "_seed", seed)
    monkeypatch.setattr(NoiseRng, "normal_like", normal_like)


@pytest.fixture
def mutation_noise_seeded_by_step(monkeypatch):
    """Noise derived from (fixed seed, step): fresh across steps, REPLAYED on a retry or resume."""

    def sample(self, step, like):
        rng = NoiseRng(_test_seed=1000 + int(step))
        return {name: rng.normal_like(value) for name, value in like.items()}

    monkeypatch.setattr(GaussianNoise, "sample", sample)


@pytest.fixture
def mutation_replay_reuses_discarded_noise(monkeypatch):
    """Each step index's noise is drawn once and kept: a step retried, or replayed after a crash
    that discarded its release, gets the draw it had before instead of fresh noise."""
    drawn: dict[int, dict] = {}
    original = GaussianNoise.sample

    def sample(self, step, like):
        if step not in drawn:
            drawn[step] = original(self, step, like)
        return drawn[step]

    monkeypatch.setattr(GaussianNoise, "sample", sample)


@pytest.fixture
def mutation_noise_seed_from_config(monkeypatch):
    """The noise generator is seeded from the config seed instead of os.urandom: every new
    process (a resumed coordinator) starts the same stream."""
    monkeypatch.setattr(noise_module, "_urandom_seed", lambda: 1234)


# ---------------------------------------------------------------------------------------------
# exactly once and clipping at the coordinator


@pytest.fixture
def mutation_duplicate_discard_disabled(monkeypatch):
    """A naive aggregator: any well-formed partial of the current step for a known task is added
    (no live-task check, no per-unit guard), so late results of re-issued tasks count twice."""

    def offer(self, partial):
        if partial.step != self.step:
            return Verdict(False, False, "other step")
        task = self._tasks.get(partial.task_id)
        if task is None:
            return Verdict(False, False, "unknown task")
        problem = self._check(partial, task.unit_ids)
        if problem is not None:
            self.fail(task.task_id, task.attempt, problem)
            return Verdict(False, True, problem)
        self._contributed.update(task.unit_ids)
        for name, value in partial.task_sum.sums.items():
            self._sums[name].add_(aggregation._as_torch(value).to(torch.float64))
        task.live = False
        for group_id in task.groups:
            self._groups[group_id].done = True
        self.units_counted += len(task.unit_ids)
        self.stats += partial.task_sum.stats
        return Verdict(True, False, "accepted")

    monkeypatch.setattr(StepGather, "offer", offer)


@pytest.fixture
def mutation_reduce_takes_every_held_sum(monkeypatch):
    """Collective data plane: a worker reduces every sum it holds for the step instead of the
    ones the coordinator accepted, so a late result of a re-issued task counts twice. (The
    coordinator's check of each member's share is off too: it refuses the scenario's member,
    accepted for no units, but a member accepted for units whose bound leaves slack for the
    extra sum passes it, and only the exactly-once check sees that.)"""
    from userdp.clients.task_runner import TaskRunner

    monkeypatch.setattr(StepGather, "_check_members", lambda self, member_norms: None)

    def take_held(self, step, gather, keys):
        with self._held_lock:
            found = [key for key, ((held_step, _), _) in self._held.items() if held_step == step]
            return [self._held.pop(key)[1] for key in found]

    monkeypatch.setattr(TaskRunner, "take_held", take_held)


@pytest.fixture
def mutation_noise_added_twice(monkeypatch):
    """The sum is noised and the noisy sum noised again (a transport that privatizes in its
    gather and then runs the step's own privatization): noise std √2·σ·C."""
    original = Strategy.add_noise

    def add_noise(self, step, summed, stats=None):
        return original(self, step, original(self, step, summed, stats), stats)

    monkeypatch.setattr(Strategy, "add_noise", add_noise)


@pytest.fixture
def mutation_closed_task_results_accepted(monkeypatch):
    """Results of closed (timed-out, failed) tasks are treated as live; only the last-resort
    per-unit guard remains."""
    original = StepGather.offer

    def offer(self, partial):
        task = self._tasks.get(partial.task_id)
        if task is not None and partial.step == self.step:
            task.live = True
        return original(self, partial)

    monkeypatch.setattr(StepGather, "offer", offer)


@pytest.fixture
def mutation_collective_checks_only_the_total(monkeypatch):
    """The collective plane checks only the reduced total against the step's count·C, not each
    member's share of it."""
    monkeypatch.setattr(StepGather, "_check_members", lambda self, member_norms: None)


@pytest.fixture
def mutation_unclipped_partial_accepted(monkeypatch):
    """The coordinator's ‖partial‖ ≤ count·C check is disabled (tolerance ∞)."""
    monkeypatch.setattr(aggregation, "NORM_TOLERANCE", math.inf)


# ---------------------------------------------------------------------------------------------
# sampling and accounting


@pytest.fixture
def mutation_sampler_q_differs(monkeypatch):
    """The Poisson sampler includes units with 1.3·q while the mechanism reports q."""

    def sample(self, step, n):
        rng = samplers._rng(self.seed, samplers._POISSON, step)
        return samplers.poisson_positions(rng, n, min(1.0, 1.3 * self.sampling_prob))

    monkeypatch.setattr(samplers.PoissonSampler, "sample", sample)


@pytest.fixture
def mutation_sampler_frozen_cohort(monkeypatch):
    """The sampler's randomness ignores the step: the same cohort every step (rate still q)."""

    def sample(self, step, n):
        rng = samplers._rng(self.seed, samplers._POISSON, 0)
        return samplers.poisson_positions(rng, n, self.sampling_prob)

    monkeypatch.setattr(samplers.PoissonSampler, "sample", sample)


@pytest.fixture
def mutation_sampler_fixed_size(monkeypatch):
    """Fixed-size cohorts of round(qN) uniformly chosen units, still accounted as Poisson."""

    def sample(self, step, n):
        rng = samplers._rng(self.seed, samplers._POISSON, step)
        return np.sort(rng.choice(n, round(self.sampling_prob * n), replace=False))

    monkeypatch.setattr(samplers.PoissonSampler, "sample", sample)


@pytest.fixture
def mutation_mechanism_reports_wrong_q(monkeypatch):
    """ULS tells the ledger q·0.7 (e.g. q computed from a different N, train + eval users)."""
    original = UserLevelSampling.mechanism

    def mechanism(self):
        m = original(self)
        return dataclasses.replace(m, sampling_prob=m.sampling_prob * 0.7)

    monkeypatch.setattr(UserLevelSampling, "mechanism", mechanism)


@pytest.fixture
def mutation_els_dsub_redrawn_each_step(monkeypatch):
    """ELS draws a fresh ≤ G subset per user every step: over the run a user contributes more
    than G examples, but the accountant assumes D_sub (G per user) was chosen once."""

    def subset(self, population):
        counts = as_population(population).require_examples("ELS")
        self._subset = samplers.ExampleSubset(counts, self.group_size, samplers.secret_seed())
        return self._subset

    monkeypatch.setattr(ExampleLevelSampling, "subset", subset)


@pytest.fixture
def mutation_els_ranked_dsub_takes_every_record(monkeypatch):
    """Under a ranked selection (longest, ...) D_sub is not capped at G: every rank of a user is
    in it, so a user with more than G records contributes all of them."""

    def subset(self, population):
        counts = as_population(population).require_examples("ELS")
        self._subset = samplers.ExampleSubset(counts, int(counts.max()), 0, ranked=True)
        return self._subset

    monkeypatch.setattr(ExampleLevelSampling, "subset", subset)


@pytest.fixture
def mutation_els_accounted_as_example_level(monkeypatch):
    """ELS reports group size 1 to the accountant (example-level ε reported as user-level)."""
    original = ExampleLevelSampling.mechanism

    def mechanism(self):
        return dataclasses.replace(original(self), group_size=1)

    monkeypatch.setattr(ExampleLevelSampling, "mechanism", mechanism)


@pytest.fixture
def mutation_accountant_drops_a_step(monkeypatch):
    """The accountant composes one step fewer than it is given (off by one)."""
    original = accounting_api._normalize_phases

    def normalize(phases):
        out = original(phases)
        if out:
            mechanism, count = out[-1]
            out[-1] = (mechanism, max(count - 1, 1))
        return out

    monkeypatch.setattr(accounting_api, "_normalize_phases", normalize)


@pytest.fixture
def mutation_blt_mechanism_without_correlation(monkeypatch):
    """BLT-DP-FTRL records its balls-in-bins mechanism without the correlation matrix (the
    accountant then amplifies as if the noise were independent across steps)."""
    from userdp.strategies.dpftrl import BltDpFtrl

    original = BltDpFtrl.mechanism

    def mechanism(self):
        return dataclasses.replace(original(self), correlation=None)

    monkeypatch.setattr(BltDpFtrl, "mechanism", mechanism)


@pytest.fixture
def mutation_ledger_skips_first_step(monkeypatch):
    """The first released step is never charged (an ``if step:`` guard in the append path)."""
    original = Ledger.append

    def append(self, step, mechanism, **kwargs):
        if step == 0:
            return {}
        return original(self, step, mechanism, **kwargs)

    monkeypatch.setattr(Ledger, "append", append)


@pytest.fixture
def mutation_shuffle_claims_poisson_accounting(monkeypatch):
    """Fixed-size shuffling reports that the Poisson accountant matches it (no caveat)."""
    original = UserLevelSampling.facts

    def facts(self):
        f = original(self)
        kept = tuple(c for c in f.caveats if "NOT MATCH" not in c.upper())
        return dataclasses.replace(f, sampling_matches_accounting=True, caveats=kept)

    monkeypatch.setattr(UserLevelSampling, "facts", facts)


# ---------------------------------------------------------------------------------------------
# per-unit clipping in the worker's engine


@pytest.fixture
def mutation_engine_does_not_clip(monkeypatch):
    """The clip factor is always 1: unit gradients are summed unclipped (missing clipping)."""
    from userdp.clients import clipping

    monkeypatch.setattr(clipping, "clip_factor", lambda norm, clip_norm: 1.0)


@pytest.fixture
def mutation_engine_clips_after_summing(monkeypatch):
    """Batch-level clipping: the units' gradients are summed first, then the SUM is clipped to C
    ("mini-batch clipping" in "Finding Private Bugs: Debugging Implementations of Differentially
    Private Stochastic Gradient Descent", §3.1)."""
    from userdp.clients.engine import ClippingEngine

    original = ClippingEngine.run

    def run(self, request):
        result = original(self, dataclasses.replace(request, clip_norm=1e30))  # Σ_u g_u
        norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in result.sums.values()))
        factor = min(1.0, request.clip_norm / norm) if norm > 0 else 1.0
        result.sums = {name: t * factor for name, t in result.sums.items()}
        return result

    monkeypatch.setattr(ClippingEngine, "run", run)


def _per_example_units(unit):
    from userdp.clients.engine import Unit

    return [Unit(f"{unit.unit_id}/{i}", [e]) for i, e in enumerate(unit.examples)]


@pytest.fixture
def mutation_engine_clips_per_example(monkeypatch):
    """ULS treated like ELS: every example of a user is clipped and summed (sensitivity m·C)."""
    from userdp.clients.engine import ClippingEngine

    original = ClippingEngine.run

    def run(self, request):
        expanded = [u for unit in request.units for u in _per_example_units(unit)]
        return original(self, dataclasses.replace(request, units=expanded))

    monkeypatch.setattr(ClippingEngine, "run", run)


@pytest.fixture
def mutation_engine_averages_clipped_examples(monkeypatch):
    """ULS user gradient = mean of the per-example CLIPPED gradients (norm ≤ C, wrong vector)."""
    from userdp.clients.engine import ClippingEngine

    original = ClippingEngine.run

    def run(self, request):
        total = None
        for unit in request.units:
            part = original(self, dataclasses.replace(request, units=_per_example_units(unit)))
            scale = 1.0 / max(len(unit.examples), 1)
            if total is None:
                total = part
                total.sums = {n: t * scale for n, t in part.sums.items()}
            else:
                total.sums = {n: total.sums[n] + t * scale for n, t in part.sums.items()}
        total.stats = dataclasses.replace(total.stats, count=len(request.units))
        return total

    monkeypatch.setattr(ClippingEngine, "run", run)


@pytest.fixture
def mutation_calibration_for_fewer_steps(monkeypatch):
    """σ is calibrated for T − 1 steps while the run takes T (an off-by-one in the step count
    handed to the calibration)."""
    from userdp.accounting import calibration

    original = calibration.calibrate_noise_multiplier

    def calibrate(template, target_epsilon, delta, steps, **kwargs):
        return original(template, target_epsilon, delta, max(steps - 1, 1), **kwargs)

    monkeypatch.setattr(calibration, "calibrate_noise_multiplier", calibrate)


# ---------------------------------------------------------------------------------------------
# adaptive clipping (Andrew et al. 2021) and resume


@pytest.fixture
def mutation_adaptive_sum_noise_uses_z(monkeypatch):
    """The sum gets the accounted z instead of σ_Δ = (z⁻² − (2σ_b)⁻²)^(−1/2) (the count's share
    of the budget forgotten)."""
    from userdp.strategies import adaptive_clipping

    monkeypatch.setattr(adaptive_clipping, "update_noise_multiplier", lambda z, count_stddev: z)


@pytest.fixture
def mutation_adaptive_count_without_noise(monkeypatch):
    """The clipped count is released exactly (no N(0, σ_b²))."""
    from userdp.strategies.adaptive_clipping import AdaptiveClipping

    def privatize(self, step, summed, stats, cohort):
        centered = (stats.count - stats.clipped) - 0.5 * stats.count
        exact = NoisyStatistic(centered / cohort.expected_size + 0.5, 0.5 / cohort.expected_size)
        return Release(
            step, cohort, self.add_noise(step, summed, stats), {"unclipped_fraction": exact}
        )

    monkeypatch.setattr(AdaptiveClipping, "privatize", privatize)


@pytest.fixture
def mutation_resume_replays_released_step(monkeypatch):
    """Resume ignores the release journal: a charged step after the checkpoint is replayed even
    though its update was already broadcast (two releases of one step, charged once)."""
    from userdp.server import coordinator

    monkeypatch.setattr(coordinator, "read_release_records", lambda directory: [])


@pytest.fixture
def mutation_sampler_seeded_by_output_seed(monkeypatch):
    """One key seeds both model init and the secret sampler: output.seed becomes the sampler's
    seed (a reproducible init then gives away the cohorts)."""
    from userdp.run import components

    original = components.build_strategy

    def build_strategy(config, num_users, noise_multiplier, delta=None):
        update = {"sampler_seed": config.output.seed}
        config = config.model_copy(update={"strategy": config.strategy.model_copy(update=update)})
        return original(config, num_users, noise_multiplier, delta)

    monkeypatch.setattr(components, "build_strategy", build_strategy)


@pytest.fixture
def mutation_estimated_norms_unchecked(monkeypatch):
    """With estimated norms (randomized clipping) the coordinator skips the norm bound."""
    original = aggregation.contribution_bound

    def contribution_bound(count, clip_norm, probes=0):
        return math.inf if probes else original(count, clip_norm, probes)

    monkeypatch.setattr(aggregation, "contribution_bound", contribution_bound)


@pytest.fixture
def mutation_per_epoch_composes_one_epoch_fewer(monkeypatch):
    """The balls-in-bins accountant composes E − 1 of its E random-allocation epochs (off by
    one)."""
    from userdp.accounting import random_allocation

    original = random_allocation.allocation_epsilon_bounds

    def bounds(sigma, num_steps, num_epochs, delta):
        return original(sigma, num_steps, max(num_epochs - 1, 1), delta)

    monkeypatch.setattr(random_allocation, "allocation_epsilon_bounds", bounds)


# ---------------------------------------------------------------------------------------------
# user-wise DP-SGD with filter


@pytest.fixture
def mutation_user_filter_noise_without_log_factor(monkeypatch):
    """The filter's sensitivity bound taken as τ/N, without √(8 log(e^ε T/δ)) (the noise then
    covers the filtered mean only when nothing fails, not at the stated δ)."""
    from userdp.accounting import user_filter

    def sensitivity(concentration_threshold, num_users, epsilon, delta, steps):
        return concentration_threshold / num_users

    monkeypatch.setattr(user_filter, "filter_sensitivity", sensitivity)


@pytest.fixture
def mutation_above_threshold_noise_halved(monkeypatch):
    """AboveThreshold's Laplace scales Δ/ε and 2Δ/ε instead of 2Δ/ε and 4Δ/ε."""
    from userdp.strategies.above_threshold import AboveThreshold

    monkeypatch.setattr(
        AboveThreshold, "threshold_scale", property(lambda self: self.sensitivity / self.epsilon)
    )
    monkeypatch.setattr(
        AboveThreshold, "query_scale", property(lambda self: 2 * self.sensitivity / self.epsilon)
    )


@pytest.fixture
def mutation_concentration_sensitivity_over_n(monkeypatch):
    """The concentration score's sensitivity taken as 2/N (the score is divided by N), so
    AboveThreshold's noise is N times too small."""
    from userdp.accounting import user_filter

    monkeypatch.setattr(user_filter, "CONCENTRATION_SCORE_SENSITIVITY", 2.0 / 100)


@pytest.fixture
def mutation_user_filter_accountant_drops_above_threshold(monkeypatch):
    """The accountant charges only the Gaussian steps, not AboveThreshold's ε/2."""
    import dataclasses as dc

    from userdp.accounting import user_filter

    original = user_filter.epsilon

    def epsilon(mechanism, steps, delta, **kwargs):
        free = dc.replace(mechanism, above_threshold_epsilon=1e-300)
        return original(free, steps, delta, **kwargs)

    monkeypatch.setattr(user_filter, "epsilon", epsilon)


@pytest.fixture
def mutation_banded_poisson_ignores_column_norm(monkeypatch):
    """The banded-Poisson accountant treats C as if its columns had norm 1 (σ, not σ/‖c‖)."""
    from userdp.accounting import banded_poisson

    monkeypatch.setattr(banded_poisson, "column_norm", lambda correlation, bands, steps: 1.0)


# ---------------------------------------------------------------------------------------------
# randomized clipping, the budget check, the tensor-core margin


@pytest.fixture
def mutation_hutchpp_total_probes_to_accountant(monkeypatch):
    """Hutch++ tells the accountant all of its probes, the head sketch S's k plus the tail P's
    k, instead of the k tail probes its envelope is for (ε too small for the σ run)."""
    original = RandomizedClipping.mechanism

    def mechanism(self):
        told = original(self)
        if self.estimator != "hutch++":
            return told
        return dataclasses.replace(told, probes=2 * self.probes)

    monkeypatch.setattr(RandomizedClipping, "mechanism", mechanism)


@pytest.fixture
def mutation_task_halves_probes(monkeypatch):
    """The task asks the engine for half of the probes the accountant is told (a speed-up that
    forgot the accountant)."""
    original = RandomizedClipping.configure_task

    def configure_task(self, step, cohort):
        spec = original(self, step, cohort)
        return dataclasses.replace(spec, probes=max(1, spec.probes // 2))

    monkeypatch.setattr(RandomizedClipping, "configure_task", configure_task)


@pytest.fixture
def mutation_budget_checked_only_at_append(monkeypatch):
    """``begin_step`` without its budget check: the ledger's append still refuses a step over
    budget, but only after its cohort was sampled and its units computed."""
    from userdp.strategies import step as step_module

    original = step_module.begin_step

    def begin_step(strategy, step, population, ledger=None, **options):
        return original(strategy, step, population, None, **options)

    monkeypatch.setattr(step_module, "begin_step", begin_step)


@pytest.fixture
def mutation_tensor_core_margin_dropped(monkeypatch):
    """The vectorized engine clips by the tensor cores' norms as they come: the rounding bound
    that covers their non-IEEE accumulation is dropped (γ(n) = 0 for every GEMM)."""
    from userdp.clients import tensor_core_bound

    monkeypatch.setattr(tensor_core_bound, "dot_error", lambda n, align_bits=None: 0.0)


@pytest.fixture
def mutation_report_states_point_estimate(monkeypatch):
    """The balls-in-bins accountant takes the Monte Carlo point estimate (below the true ε about
    half of the time) for the ε that Estimate-Verify-Release certifies."""
    from userdp.accounting import balls_in_bins

    def certified_epsilon(sigma, bins, epochs, delta, *, bin_semantics, correlation, seed):
        return balls_in_bins.epsilon(
            sigma,
            bins,
            epochs,
            delta,
            bin_semantics=bin_semantics,
            correlation=correlation,
            seed=seed,
        )

    monkeypatch.setattr(balls_in_bins, "certified_epsilon", certified_epsilon)


# ---------------------------------------------------------------------------------------------
# calibration: noise and δ


@pytest.fixture
def mutation_adaptive_sigma_delta_fixed_at_construction(monkeypatch):
    """Adaptive clipping derives σ_Δ from σ once, in its constructor (where the registry builds it
    at σ = 1, before calibration): the sum's noise keeps the template's σ_Δ."""
    from userdp.strategies import adaptive_clipping
    from userdp.strategies.adaptive_clipping import AdaptiveClipping

    original = AdaptiveClipping.__init__

    @functools.wraps(original)  # the registry reads the constructor's signature
    def init(self, **kwargs):
        original(self, **kwargs)
        self._mutation_sigma_delta = adaptive_clipping.update_noise_multiplier(
            self.noise_multiplier, self.count_stddev
        )

    monkeypatch.setattr(AdaptiveClipping, "__init__", init)
    monkeypatch.setattr(
        AdaptiveClipping,
        "update_noise_multiplier",
        property(lambda self: self._mutation_sigma_delta),
    )


@pytest.fixture
def mutation_noise_std_fixed_at_construction(monkeypatch):
    """The base strategy caches its noise std σ·C in its constructor (at the template's σ = 1):
    the ledger records the calibrated σ, the noise keeps σ = 1."""
    original = Strategy.__init__

    @functools.wraps(original)
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._mutation_std = self.noise_multiplier * self.clip_norm

    monkeypatch.setattr(Strategy, "__init__", init)
    monkeypatch.setattr(
        Strategy,
        "add_noise",
        lambda self, step, summed, stats=None: self.noise.add(step, summed, std=self._mutation_std),
    )


@pytest.fixture
def mutation_user_filter_sigma_fixed_at_construction(monkeypatch):
    """The user-wise filter keeps the σ it was constructed with (σ = 1 there) for its noise."""
    from userdp.accounting import user_filter as accounting
    from userdp.strategies.user_filter import UserWiseFilter

    original = UserWiseFilter.__init__

    @functools.wraps(original)
    def init(self, **kwargs):
        original(self, **kwargs)
        self._mutation_sigma = self.noise_multiplier

    def noise_std(self, num_users):
        return accounting.filter_noise_std(
            self._mutation_sigma,
            self.concentration_threshold,
            num_users,
            self.epsilon,
            self.delta,
            self.steps,
        )

    monkeypatch.setattr(UserWiseFilter, "__init__", init)
    monkeypatch.setattr(UserWiseFilter, "noise_std", noise_std)


@pytest.fixture
def mutation_calibration_at_default_delta(monkeypatch):
    """With ``privacy.delta`` unset, σ is calibrated at a library default δ = 10⁻⁶ instead of the
    run's 1/(10·N), which the ledger and the report state."""
    from userdp.run import components

    original = components.calibrator

    def calibrator(config, delta):
        return original(config, config.privacy.delta or 1e-6)

    monkeypatch.setattr(components, "calibrator", calibrator)


# ---------------------------------------------------------------------------------------------
# slack and rounding margins


@pytest.fixture
def mutation_clip_factor_slack(monkeypatch):
    """The clip factor lets norms up to (1 + 10⁻³)·C through unclipped ("within tolerance")."""
    from userdp.clients import clipping

    def clip_factor(norm, clip_norm):
        return 1.0 if norm <= clip_norm * (1 + 1e-3) else clip_norm / norm

    monkeypatch.setattr(clipping, "clip_factor", clip_factor)


@pytest.fixture
def mutation_clip_factor_rounding_flipped(monkeypatch):
    """The tensor-core bound's clip-factor rounding margin applied downward: 1 − 2⁻²³."""
    from userdp.clients import tensor_core_bound

    monkeypatch.setattr(tensor_core_bound, "CLIP_FACTOR_ROUNDING", 1 - 2.0**-23)


@pytest.fixture
def mutation_pld_repair_lowers_delta(monkeypatch):
    """The fast PLD builder makes δ(ε) non-increasing by a forward running minimum: values that
    rise are lowered to the earlier ones instead of the earlier ones raised."""
    from userdp.accounting import fast_pld

    monkeypatch.setattr(fast_pld, "non_increasing_cover", lambda d: np.minimum.accumulate(d))


@pytest.fixture
def mutation_renyi_add_as_remove(monkeypatch):
    """The balls-in-bins Rényi accountant takes the add direction's moment with the remove
    direction's sign (as if D_α(Q‖P) were the remove moment one order down)."""
    from userdp.accounting import balls_in_bins_renyi

    real = balls_in_bins_renyi.log_moments
    monkeypatch.setattr(
        balls_in_bins_renyi, "log_moments", lambda bound, sigma, k, sign: real(bound, sigma, k, -1)
    )


@pytest.fixture
def mutation_renyi_drops_far_entries(monkeypatch):
    """The balls-in-bins Rényi accountant ignores the Gram entries beyond its two off-diagonals
    instead of bounding them (at every spread)."""
    from userdp.accounting import balls_in_bins_renyi

    real = balls_in_bins_renyi.banded_bound

    def banded_bound(gram, spread=0.0, cyclic=False):
        kept = real(gram, 0.0, cyclic)
        return dataclasses.replace(kept, quad=kept.diag.copy())

    monkeypatch.setattr(balls_in_bins_renyi, "banded_bound", banded_bound)


@pytest.fixture
def mutation_renyi_spread_not_charged(monkeypatch):
    """The balls-in-bins Rényi accountant lowers the near entries by the spread r but never
    adds r·u², the far pairs' share."""
    from userdp.accounting import balls_in_bins_renyi

    real = balls_in_bins_renyi.banded_bound
    monkeypatch.setattr(
        balls_in_bins_renyi,
        "banded_bound",
        lambda gram, spread=0.0, cyclic=False: dataclasses.replace(
            real(gram, spread, cyclic), spread=0.0
        ),
    )


@pytest.fixture
def mutation_renyi_wrap_not_charged(monkeypatch):
    """The balls-in-bins Rényi accountant's cyclic program leaves out the wrap-around entries
    (last bins to first) that it took out of the far ones."""
    from userdp.accounting import balls_in_bins_renyi

    real = balls_in_bins_renyi.banded_bound

    def banded_bound(gram, spread=0.0, cyclic=False):
        kept = real(gram, spread, cyclic)
        return kept if kept.wrap is None else dataclasses.replace(kept, wrap=(0.0, 0.0, 0.0))

    monkeypatch.setattr(balls_in_bins_renyi, "banded_bound", banded_bound)


@pytest.fixture
def mutation_renyi_geometric_add_drops_norm_term(monkeypatch):
    """The balls-in-bins Rényi accountant's closed-form add bound loses its ḡ/(2σ²) term."""
    from userdp.accounting import balls_in_bins_renyi

    def geometric(gram, sigma, orders):
        b = gram.shape[0]
        return (orders - 1) * float(gram.sum()) / b**2 / (2 * sigma**2)

    monkeypatch.setattr(balls_in_bins_renyi, "geometric_add_divergences", geometric)


@pytest.fixture
def mutation_split_product_drops_remainder(monkeypatch):
    """The tensor-core book-keeping splits R·c into one bf16 part only (the remainder zeroed):
    an error of up to 2⁻⁸ of each product."""
    from userdp.clients import matmul_precision

    original = matmul_precision.split_bf16

    def split_bf16(x, factor=None):
        out = original(x, factor)
        out[..., x.shape[-1] :] = 0
        return out

    monkeypatch.setattr(matmul_precision, "split_bf16", split_bf16)


@pytest.fixture
def mutation_run_states_point_estimate(monkeypatch):
    """The run loop states the Monte Carlo point estimate of a balls-in-bins ledger (summary,
    metrics, progress bar, the exported model) while the report states the certified ε."""
    from userdp.accounting import api, balls_in_bins
    from userdp.accounting.mechanisms import BallsInBinsMechanism

    from userdp.run.loop import RunLoop

    original = RunLoop._spent

    def spent(self):
        phases = self.ledger.phases()
        if len(phases) != 1 or not isinstance(phases[0][0], BallsInBinsMechanism):
            return original(self)
        mechanism, steps = phases[0]
        return balls_in_bins.epsilon(
            mechanism.noise_multiplier,
            mechanism.bins,
            api.balls_in_bins_epochs(mechanism, steps),
            self.setup.delta,
            bin_semantics=mechanism.bin_semantics,
            correlation=mechanism.correlation,
        )

    monkeypatch.setattr(RunLoop, "_spent", spent)
