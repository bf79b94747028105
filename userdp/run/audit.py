"""``userdp audit``: an empirical lower bound on ε from one training run with canary users.

The one-run audit of Steinke, Nasr & Jagielski ("Privacy Auditing with One (1) Training Run",
NeurIPS 2023), white-box, at the user level:

1. ``m`` canary users are made; each is put into the training population independently with
   probability 1/2 (the secret bits S_j). Included canaries are sampled by the strategy's real
   sampler like every other user.
2. A canary's gradient is a "Dirac" vector: ``canary_norm`` (≫ C) on one coordinate of its own.
   It goes through the engine's own clipping arithmetic
   (:func:`userdp.clients.clipping.add_clipped_unit`), so a clipped canary contributes exactly C.
   Real users go through the real worker compute (in-process simulator).
3. The auditor sees what the coordinator releases — the noisy sums — and scores canary j by the
   sum over steps of the released value at its coordinate.
4. It guesses "in" for the k highest scores and "out" for the k lowest (r = 2k guesses) and
   counts the correct guesses v. If the run is ε-DP, v is stochastically dominated by
   Binomial(r, e^ε/(1+e^ε)) (their Theorem 1), so the largest ε with
   P[Binomial(r, e^ε/(1+e^ε)) ≥ v] ≤ β/|K| is a lower bound with confidence 1 − β
   (Bonferroni over the |K| guess counts tried).

What it can and cannot show: with r guesses the bound is at most logit(β^(1/r)) (about 3.5 for
r = 100 at β = 0.05), so it finds gross violations (clipping off, noise off or mis-scaled) and
says nothing about a claimed ε far above that ceiling. δ is treated as 0 (the (ε, δ) form of the
theorem adds a δ term we do not subtract), which can only make the lower bound LARGER: a false
alarm, never a false assurance; keep δ small (≤ 1e-6) for audits.

The auditor's view is the step's ``on_release`` callback (:mod:`userdp.strategies.step`): it sees
exactly the releases the ledger charges. ``test_only_disable_clipping`` (test-only, NOT PRIVATE)
hands the workers and the canaries a clip norm no gradient reaches, so the test suite can show
the audit flags a broken run; no config key or CLI flag reaches it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats

from userdp.accounting.api import epsilon as accountant_epsilon
from userdp.accounting.durable import atomic_write_text
from userdp.clients.clipping import Accumulator, add_clipped_unit
from userdp.config import Config
from userdp.run.components import prepare_run
from userdp.run.in_process import InProcessWorker
from userdp.server.population import Population
from userdp.strategies.local_step import run_local_step
from userdp.strategies.unit_stats import UnitStats

GUESS_COUNTS = (10, 20, 50, 100, 200, 500)
UNREACHABLE_CLIP_NORM = 1e30
"""The clip norm of ``test_only_disable_clipping``: no gradient reaches it, so nothing is clipped."""
CANARY_SHARD = "__canaries__"


@dataclass(frozen=True)
class AuditResult:
    epsilon_lower_bound: float
    confidence: float
    epsilon_point_estimate: float
    claimed_epsilon: float
    delta: float
    flagged: bool
    canaries: int
    included: int
    guesses: int
    correct: int
    steps: int
    noise_multiplier: float
    clip_norm: float
    canary_norm: float
    parameter: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def epsilon_lower_bound(guesses: int, correct: int, beta: float) -> float:
    """Largest ε with P[Binomial(r, e^ε/(1+e^ε)) ≥ v] ≤ β (0 if none): if the mechanism were
    ε-DP for a smaller ε, seeing ≥ v correct of r would have probability < β."""
    if guesses <= 0 or correct <= 0:
        return 0.0

    def tail(eps: float) -> float:  # P[Bin(r, p_eps) >= v], increasing in eps
        p = 1.0 / (1.0 + math.exp(-eps))
        return float(stats.binom.sf(correct - 1, guesses, p))

    if tail(0.0) > beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while tail(hi) <= beta and hi < 100:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        if tail(mid) <= beta:
            lo = mid
        else:
            hi = mid
    return lo


def largest_lower_bound(canaries: int, confidence: float) -> float:
    """The largest ε lower bound an audit with ``canaries`` canaries can report at
    ``confidence``: every one of its guesses correct, at the best guess count."""
    counts = [k for k in GUESS_COUNTS if 2 * k <= canaries]
    beta = (1.0 - confidence) / max(len(counts), 1)
    return max((epsilon_lower_bound(2 * k, 2 * k, beta) for k in counts), default=0.0)


def _canary_parameter(params: dict[str, torch.Tensor], canaries: int) -> str:
    """The largest trainable matrix that is not the (tied) embedding: one coordinate each."""
    candidates = sorted(
        ((p.numel(), n) for n, p in params.items() if p.dim() == 2 and "wte" not in n), reverse=True
    )
    if not candidates or candidates[0][0] < canaries:
        raise ValueError(f"no trainable matrix has {canaries} entries for the canaries")
    return candidates[0][1]


def run_audit(
    config: Config,
    *,
    canaries: int = 200,
    canary_norm_multiple: float = 100.0,
    confidence: float = 0.95,
    seed: int | None = None,
    test_only_disable_clipping: bool = False,
    on_phase: Callable[[str], None] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> AuditResult:
    """Train ``config`` once in the in-process simulator with canaries (module docstring).
    ``on_phase`` hears what the audit is doing ("preparing", "training", "accounting"),
    ``on_step`` the number of each finished step (a progress bar)."""
    if canaries < 20:
        raise ValueError(f"--canaries must be at least 20, got {canaries}")
    if not 0.5 < confidence < 1:
        raise ValueError(f"--confidence must be in (0.5, 1), got {confidence}")
    if on_phase is not None:
        on_phase("preparing")
    setup = prepare_run(config)
    strategy, params = setup.strategy, setup.trainable
    clip_norm = config.strategy.clip_norm
    if strategy.unit != "user":
        raise ValueError("userdp audit supports user-unit strategies (uls, dp-fedavg, ...) only")
    rng = np.random.default_rng(seed)
    included = rng.random(canaries) < 0.5
    ids = [f"canary-{j:05d}" for j in range(canaries)]
    parameter = _canary_parameter(params, canaries)
    flat = rng.choice(params[parameter].numel(), size=canaries, replace=False)
    coordinate = {cid: int(flat[j]) for j, cid in enumerate(ids)}
    canary_norm = canary_norm_multiple * clip_norm
    population = Population(
        shard_of_user={
            **setup.population.shard_of_user,
            **{cid: CANARY_SHARD for cid, inside in zip(ids, included, strict=True) if inside},
        },
        shard_sha256=setup.population.shard_sha256,
    )
    compute = InProcessWorker(config, setup)
    current_step = [0]

    def worker(spec: Any, unit_ids: Any, current: dict[str, torch.Tensor]) -> tuple[dict, Any]:
        if test_only_disable_clipping:
            spec = replace(spec, clip_norm=UNREACHABLE_CLIP_NORM)
        real = [u for u in unit_ids if u not in coordinate]
        fake = [u for u in unit_ids if u in coordinate]
        sums = {
            name: torch.zeros_like(value, dtype=torch.float32) for name, value in current.items()
        }
        count = clipped = 0
        if real:
            result = compute(spec, current_step[0], real, current)
            sums = {k: v.clone() for k, v in result.sums.items()}
            count, clipped = result.stats.count, result.stats.clipped
        if fake:
            acc = Accumulator({parameter: current[parameter]}, spec.clip_norm)
            for cid in fake:
                grad = torch.zeros(current[parameter].numel(), dtype=torch.float32)
                grad[coordinate[cid]] = canary_norm
                add_clipped_unit(acc, {parameter: grad.view_as(current[parameter])}, 0.0, 0)
            sums[parameter] += acc.sums[parameter]
            count, clipped = count + acc.stats.count, clipped + acc.stats.clipped
        return sums, UnitStats(count=count, clipped=clipped)

    scores = np.zeros(canaries)
    index = torch.as_tensor(flat)

    def observe(release: Any) -> None:  # the auditor's view: what the coordinator releases
        scores[:] += release.noisy_sum[parameter].reshape(-1)[index].double().numpy()

    if on_phase is not None:
        on_phase("training")
    try:
        for step in range(config.strategy.steps):
            current_step[0] = step
            run_local_step(
                strategy,
                step,
                params,
                population,
                worker,
                workers=config.workers.count,
                options=setup.options,
                on_release=observe,
            )
            if on_step is not None:
                on_step(step + 1)
    finally:
        compute.close()
    if on_phase is not None:
        on_phase("accounting")

    beta = 1.0 - confidence
    counts = [k for k in GUESS_COUNTS if 2 * k <= canaries]
    order = np.argsort(scores)
    best = (0.0, 0, 0)
    for k in counts:
        correct = int((~included[order[:k]]).sum() + included[order[-k:]].sum())
        bound = epsilon_lower_bound(2 * k, correct, beta / len(counts))
        if bound >= best[0]:
            best = (bound, 2 * k, correct)
    bound, guesses, correct = best
    rate = (correct + 0.5) / (guesses + 1)  # smoothed, so r/r correct stays finite
    claimed = float(accountant_epsilon(strategy.mechanism(), config.strategy.steps, setup.delta))
    return AuditResult(
        epsilon_lower_bound=bound,
        confidence=confidence,
        epsilon_point_estimate=max(0.0, math.log(rate / (1 - rate))),  # not a bound
        claimed_epsilon=claimed,
        delta=setup.delta,
        flagged=bound > claimed,
        canaries=canaries,
        included=int(included.sum()),
        guesses=guesses,
        correct=correct,
        steps=config.strategy.steps,
        noise_multiplier=setup.noise_multiplier,
        clip_norm=clip_norm,
        canary_norm=canary_norm,
        parameter=parameter,
    )


def write_audit(result: AuditResult, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "audit.json"
    atomic_write_text(path, json.dumps(result.to_dict(), indent=2, sort_keys=True) + "\n")
    return path
