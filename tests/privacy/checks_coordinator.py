"""The real coordinator over loopback gRPC (tests/server's harness and toy workers).

- :func:`check_coordinator_noise_magnitude`: the update the coordinator releases after a real
  gather carries, on EVERY trainable tensor, noise of std lr·σ·C/(qN) — qN the expected cohort,
  on a step whose realized cohort is ≥ 25% off it (exact χ² test against a noiseless replay).
- :func:`check_coordinator_counts_each_unit_once`: a slow worker's task is re-issued; its CancelTask
  is lost in flight, so its late result really arrives — while the step is still gathering. The
  model must equal the noiseless single-process reference (each unit once) and the ledger must
  hold one entry per released step.
- :func:`check_coordinator_resume_draws_fresh_noise`: the coordinator crashes after drawing a
  step's noise but before releasing it; a new process resumes from the checkpoint and replays
  the step: every noise draw of the run (before and after the crash) is independent.
- :func:`check_coordinator_replay_commits_a_fresh_release`: the same crash after the ledger
  append; the replay's release commitment in the release journal differs from the discarded
  draw's in the ledger, and `userdp ledger verify` accepts the run.

Each check takes ``collective``: run it over the collective data plane (the workers hold their
sums, reduce them in a gloo group to the coordinator, and receive versions through the group;
:mod:`userdp.server.group_plane`), where noise once, exactly once, fresh noise and no
re-release must hold just the same.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from userdp.clients.grpc_client import WorkerClient
from userdp.server.coordinator import CoordinatorSettings
from userdp.server.group_plane import GroupSettings
from userdp.strategies.builtins import UserLevelSampling
from userdp.strategies.noise import GaussianNoise, NoiseRng
from userdp.strategies.optimizers import Sgd

from tests.server import (
    harness,
    toy,  # the server tests' loopback harness, reused
)
from tests.server.harness import Loopback, reference_params

from .stats import ALPHA, assert_gaussian_noise, assert_uncorrelated

SIGMA = 2.0
CLIP = 3.0
LR = 0.5
Q = 0.3
N_USERS = 40
SHAPES = {"w": (400, 256), "b": (256,), "e": (3, 7)}
GROUP = GroupSettings(store_bind="127.0.0.1", timeout_s=60.0)
"""The collective plane's group: its timeout only ends a collective whose member died."""


def _params(shapes=SHAPES) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {name: 0.1 * torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _strategy(seed: int, noise=None) -> UserLevelSampling:
    return UserLevelSampling(
        noise_multiplier=SIGMA,
        clip_norm=CLIP,
        sampling_prob=Q,
        seed=seed,
        noise=noise,
        optimizer=Sgd(LR),
    )


def make_loopback(
    tmp_path: Path,
    strategy,
    params,
    population,
    *,
    no_noise: bool = False,
    settings: CoordinatorSettings | None = None,
    fault_hook=None,
    collective: bool = False,
    checkpoint_dir: Path | None = None,
) -> Loopback:
    """tests/server/harness.make_loopback with this module's parameters (a model large enough
    for exact noise statistics, 1 MiB chunks); ``collective``: the collective data plane."""
    return harness.make_loopback(
        tmp_path,
        strategy=strategy,
        params=params,
        population=population,
        no_noise=no_noise,
        settings=settings,
        fault_hook=fault_hook,
        publisher_chunk_bytes=1 << 20,
        group=GROUP if collective else None,
        checkpoint_dir=checkpoint_dir,
    )


def start_worker(loop: Loopback, worker_id, shards, compute, client_class=WorkerClient):
    return loop.add_worker(worker_id, shards, compute, client_class=client_class)


def _seed_with_cohort_gap(population, gap: float = 0.25) -> int:
    """A sampler seed whose step-0 cohort is ≥ ``gap`` off the expected qN (deterministic)."""
    for seed in range(1000):
        cohort = _strategy(seed).sample_cohort(0, population.users)
        if abs(len(cohort) - cohort.expected_size) >= gap * cohort.expected_size:
            return seed
    raise AssertionError("no sampler seed with a step-0 cohort ≥ 25% off qN")


# ---------------------------------------------------------------------------------------------


def check_coordinator_noise_magnitude(tmp_path: Path, collective: bool = False) -> None:
    """One real coordinator step (2 workers); released − noiseless replay is exactly
    N(0, (lr·σ·C/(qN))²) on every trainable tensor (qN = 12 expected users, realized ≥ 25% off)."""
    population = toy.toy_population(N_USERS, 4)
    seed = _seed_with_cohort_gap(population)
    strategy = _strategy(seed, noise=GaussianNoise(NoiseRng.for_testing(99)))
    loop = make_loopback(tmp_path, strategy, _params(), population, collective=collective)
    shards = list(population.shard_sha256)
    try:
        start_worker(loop, "w0", shards, toy.ToyCompute())
        start_worker(loop, "w1", shards, toy.ToyCompute())
        loop.coordinator.wait_for_workers()
        reports = loop.coordinator.run(1)
    finally:
        loop.close()
    expected = Q * N_USERS
    realized = reports[0].units
    reference = reference_params(_strategy(seed), population, 1, start=_params())
    std = LR * SIGMA * CLIP / expected
    for name, released in loop.coordinator.params.items():
        noise = (reference[name] - released).double().numpy()
        assert_gaussian_noise(
            noise,
            std,
            f"coordinator step 0, tensor {name!r} ({noise.size} values; cohort {realized}, "
            f"expected {expected:g})",
            ALPHA / len(SHAPES),
        )
    records = loop.coordinator.ledger.records
    assert [r["step"] for r in records] == [0], f"ledger holds {len(records)} records after 1 step"


class _LostCancel(set):
    """The worker never sees a CancelTask (the message is delayed in the network)."""

    def __contains__(self, item) -> bool:
        return False


class LateWorker(WorkerClient):
    """A real worker client whose CancelTask messages are lost: its late result is sent."""

    def _task_loop(self, tasks, outbox, cancelled) -> None:
        super()._task_loop(tasks, outbox, _LostCancel())


class TimedCompute(toy.ToyCompute):
    """The toy compute, sleeping ``first_try_s`` on first attempts and ``retry_s`` on the FIRST
    re-issued task it gets (later ones run at once); logs (time ready, attempt)."""

    def __init__(self, first_try_s: float, retry_s: float = 0.0, log: list | None = None) -> None:
        super().__init__()
        self.first_try_s, self.retry_s = first_try_s, retry_s
        self.log = log if log is not None else []

    def compute(self, task):
        if task.attempt == 0:
            time.sleep(self.first_try_s)
        elif not any(attempt > 0 for _, attempt in self.log):
            time.sleep(self.retry_s)
        result = super().compute(task)
        self.log.append((time.monotonic(), task.attempt))
        return result


def check_coordinator_counts_each_unit_once(tmp_path: Path, collective: bool = False) -> None:
    """A slow worker's task times out and is re-issued; its late result arrives while the step
    still gathers (another shard's re-issued task is outstanding). The released model equals the
    noiseless single-process reference and the report counts each unit once."""
    population = toy.toy_population(N_USERS, 2)
    s0, s1 = sorted(population.shard_sha256)
    settings = CoordinatorSettings(step_deadline_s=20, task_deadline_s=1.5, max_step_retries=0)
    strategy = _strategy(0)
    start = _params({"w": (6,), "b": (2, 3)})
    loop = make_loopback(
        tmp_path,
        strategy,
        {n: t.clone() for n, t in start.items()},
        population,
        no_noise=True,
        settings=settings,
        collective=collective,
    )
    late_log: list = []
    backup_log: list = []
    try:
        # ties go to the smallest id: a-late gets shard 0, b-slow shard 1, c-backup nothing
        # a-late: 2.0 s (> the 1.5 s task deadline); its result is sent anyway at ~2.0 s
        # b-slow: 2.5 s, times out at 1.5 s too (keeps a re-issued task outstanding)
        # c-backup: gets both re-issues at ~1.5 s and answers at ~2.5 s, after the late result
        # and before the re-issued task's own deadline (~3.0 s): 0.5 s margins both ways
        start_worker(loop, "a-late", [s0], TimedCompute(2.0, log=late_log), LateWorker)
        start_worker(loop, "b-slow", [s1], TimedCompute(2.5))
        start_worker(loop, "c-backup", [s0, s1], TimedCompute(0.0, 1.0, backup_log))
        loop.coordinator.wait_for_workers()
        reports = loop.coordinator.run(1)
    finally:
        loop.close()
    report = reports[0]
    cohort = strategy.sample_cohort(0, population.users)
    retries = [t for t, attempt in backup_log if attempt > 0]
    assert report.failed_tasks >= 2 and late_log and retries, (
        f"precondition: the slow tasks were not re-issued (failed_tasks={report.failed_tasks})"
    )
    assert late_log[0][0] < max(retries), (
        "precondition: the late result was ready only after the re-issued tasks finished "
        f"({late_log[0][0] - max(retries):+.2f} s); the scenario did not happen (machine overloaded?)"
    )
    assert report.units == len(cohort) and report.stats.count == len(cohort), (
        f"the step counted {report.units} units for a cohort of {len(cohort)}: a unit was "
        "counted twice after its task was re-issued"
    )
    expected = reference_params(_strategy(0), population, 1, start=start)
    for name, value in loop.coordinator.params.items():
        error = float((value - expected[name]).abs().max())
        assert error <= 1e-5, (
            f"model after step 0 differs from the each-unit-once reference by {error:.3g} on "
            f"{name!r}: a unit was counted twice after its task was re-issued"
        )
    steps = [r["step"] for r in loop.coordinator.ledger.records]
    assert steps == [0], f"ledger records {steps} after one released step"


def check_coordinator_resume_draws_fresh_noise(tmp_path: Path, collective: bool = False) -> None:
    """Crash after step 1's noise was drawn (at the ledger phase), resume in a new coordinator with
    a new strategy object from the checkpoint, replay step 1 and run step 2: all four noise draws
    are mutually independent (production noise generator, os.urandom)."""
    draws: list[tuple[int, np.ndarray]] = []

    class Recording(UserLevelSampling):
        def add_noise(self, step, summed, stats=None):
            noisy = super().add_noise(step, summed, stats)
            noise = torch.cat([(noisy[n] - summed[n]).flatten() for n in sorted(summed)])
            draws.append((step, noise.double().numpy()))
            return noisy

    def recording():
        return Recording(
            noise_multiplier=SIGMA, clip_norm=CLIP, sampling_prob=Q, seed=0, optimizer=Sgd(LR)
        )

    class Crash(Exception):
        pass

    def crash(phase, step):
        if (phase, step) == ("ledger", 1):
            raise Crash()

    population = toy.toy_population(N_USERS, 4)
    shapes = {"w": (64, 64), "b": (64,)}
    shards = list(population.shard_sha256)
    loop = make_loopback(
        tmp_path, recording(), _params(shapes), population, fault_hook=crash, collective=collective
    )
    try:
        start_worker(loop, "w0", shards, toy.ToyCompute())
        loop.coordinator.wait_for_workers()
        try:
            loop.coordinator.run(3)
        except Crash:
            pass
        else:
            raise AssertionError("precondition: the simulated crash did not happen")
    finally:
        loop.close()
    loop = make_loopback(tmp_path, recording(), _params(shapes), population, collective=collective)
    try:
        assert loop.coordinator.step == 1, "resume must replay the unreleased step 1"
        start_worker(loop, "w0", shards, toy.ToyCompute())
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(3)
    finally:
        loop.close()
    assert [s for s, _ in draws] == [0, 1, 1, 2], f"unexpected noise draws {[s for s, _ in draws]}"
    pairs = [(i, j) for i in range(len(draws)) for j in range(i)]
    for i, j in pairs:
        assert_uncorrelated(
            draws[i][1],
            draws[j][1],
            f"noise of step {draws[i][0]} (draw {i}) vs step {draws[j][0]} (draw {j}) across a "
            "coordinator crash and resume",
            ALPHA / len(pairs),
        )
    steps = [r["step"] for r in loop.coordinator.ledger.records]
    assert steps == [0, 1, 2], f"ledger after resume holds steps {steps}; expected [0, 1, 2]"


def check_coordinator_uls_resume_never_rereleases(tmp_path: Path, collective: bool = False) -> None:
    """ULS with a checkpoint every 2 steps: the coordinator crashes after step 2 was charged AND
    broadcast but before the next checkpoint. The resumed coordinator must continue after step
    2 (it stays charged; its update is lost), never release step 2 a second time: across both
    processes every step index appears once in the release journal, and once in the ledger."""
    from userdp.server.release_journal import read_release_journal

    class Crash(Exception):
        pass

    def crash(phase, step):
        if (phase, step) == ("sync", 3):
            raise Crash()

    population = toy.toy_population(N_USERS, 4)
    shards = list(population.shard_sha256)
    shapes = {"w": (8, 4), "b": (4,)}
    settings = CoordinatorSettings(step_deadline_s=60, task_deadline_s=30, checkpoint_every=2)
    loop = make_loopback(
        tmp_path,
        _strategy(0),
        _params(shapes),
        population,
        settings=settings,
        fault_hook=crash,
        collective=collective,
    )
    try:
        start_worker(loop, "w0", shards, toy.ToyCompute())
        loop.coordinator.wait_for_workers()
        try:
            loop.coordinator.run(5)
        except Crash:
            pass
        else:
            raise AssertionError("precondition: the simulated crash did not happen")
    finally:
        loop.close()
    journal = read_release_journal(tmp_path / "ckpt")
    assert journal == [0, 1, 2], f"precondition: releases before the crash were {journal}"
    loop = make_loopback(
        tmp_path,
        _strategy(0),
        _params(shapes),
        population,
        settings=settings,
        collective=collective,
    )
    try:
        start_worker(loop, "w0", shards, toy.ToyCompute())
        loop.coordinator.wait_for_workers()
        loop.coordinator.run(5)
    finally:
        loop.close()
    journal = read_release_journal(tmp_path / "ckpt")
    twice = sorted({s for s in journal if journal.count(s) > 1})
    assert not twice, (
        f"step(s) {twice} released twice after resume (release journal {journal}): a step the "
        "journal shows as broadcast must stay lost, not be replayed with new noise"
    )
    charged = [int(r["step"]) for r in loop.coordinator.ledger.records]
    assert charged == sorted(set(charged)) and set(journal) <= set(charged), (
        f"ledger {charged} vs releases {journal}: every release charged exactly once"
    )
    assert journal[-1] == 4, f"the resumed run did not finish: releases {journal}"


def check_coordinator_replay_commits_a_fresh_release(
    tmp_path: Path, collective: bool = False
) -> None:
    """The coordinator crashes after charging step 1 and before releasing it (at the update); a
    new process resumes and replays step 1 (same checkpoint, cohort and toy sum). The release
    journal must mark the replay, its commitment (``release_sha256``) must differ from the one
    the ledger recorded for the discarded draw — reused noise on the same sum would give the same
    release — and `userdp ledger verify` must accept the run folder."""
    from userdp.server.release_journal import read_release_records

    from userdp.cli import main as cli_main

    class Crash(Exception):
        pass

    def crash(phase, step):
        if (phase, step) == ("update", 1):
            raise Crash()

    population = toy.toy_population(N_USERS, 4)
    shards = list(population.shard_sha256)
    shapes = {"w": (16, 8), "b": (8,)}
    checkpoints = tmp_path / "checkpoints"  # a run folder's layout, which `ledger verify` reads
    for hook in (crash, None):
        loop = make_loopback(
            tmp_path,
            _strategy(0),
            _params(shapes),
            population,
            fault_hook=hook,
            collective=collective,
            checkpoint_dir=checkpoints,
        )
        try:
            start_worker(loop, "w0", shards, toy.ToyCompute())
            loop.coordinator.wait_for_workers()
            loop.coordinator.run(3)
        except Crash:
            pass
        finally:
            loop.close()
    committed = {r["step"]: r.get("release_sha256") for r in loop.coordinator.ledger.records}
    journal = read_release_records(checkpoints)
    replays = [line for line in journal if line.get("replayed")]
    assert [line["step"] for line in replays] == [1], (
        f"precondition: step 1 charged before the crash must be replayed once ({journal})"
    )
    assert committed[1] is not None and replays[0].get("release_sha256") is not None, (
        "the ledger and the release journal must commit to step 1's releases"
    )
    assert replays[0]["release_sha256"] != committed[1], (
        "step 1 was replayed with the release the crash discarded (release_sha256 IDENTICAL in "
        "the ledger and the release journal): the replay did not draw fresh noise"
    )
    code = cli_main(["ledger", "verify", str(tmp_path)])
    assert code == 0, "`userdp ledger verify` refuses the run's release commitments"
