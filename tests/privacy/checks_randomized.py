"""Randomized clipping: the accountant is told the engine's TAIL probe count.

DP-SGD-RC ("Efficient DP-SGD for LLMs with Randomized Clipping") accounts a step by the law of
the norm estimate's error, which depends on k, the number of Hutchinson probes. Hutch++ draws two
probe matrices per weight, a head sketch S and tail probes P, and only P is a Hutchinson estimate
(:mod:`userdp.accounting.randomized_clipping`, "HUTCH++"): its envelope takes k = P's column
count, not S's plus P's. Telling the accountant more probes than the tail has makes ε smaller for
the same σ (and calibration picks a smaller σ for the same ε): an optimistic guarantee.

:func:`check_accountant_gets_the_engines_tail_probes` builds the strategy from a config as a run
does, sends its task through the wire encoding to the real clipping engine on a tiny GPT-2, and
records the tail probe matrix of every norm sketch the engine computes. Then:

- the mechanism the strategy hands the ledger names exactly that many probes;
- its ε (userdp's accountant for the mechanism) equals the randomized-clipping accountant's ε at
  the engine's tail count;
- the run's σ calibration (``strategy_from_config``) is handed a mechanism with that count
  (the calibration itself is tested against the accountant in tests/accounting).
"""

from __future__ import annotations

import dataclasses
import math
from unittest import mock

import numpy as np
from userdp.accounting import calibration, randomized_clipping
from userdp.accounting.api import epsilon
from userdp.clients import sketch
from userdp.clients.engine import ClippingEngine, EngineRequest, Unit
from userdp.clients.model import ModelShape, build_model
from userdp.proto.codec import task_from_proto, task_proto

from userdp.config import ModelConfig, parse_config
from userdp.run.components import strategy_from_config
from userdp.run.registry import build_strategy

PROBES = 6
Q = 0.05
STEPS = 20
TARGET_EPSILON = 4.0
DELTA = 1e-5
USERS = 400
SHAPE = ModelShape(259, 24, pad_id=0, eos_id=1)


def _config(estimator: str):
    return parse_config(
        {
            "strategy": {
                "name": "randomized-clipping",
                "engine": "randomized",
                "probes": PROBES,
                "estimator": estimator,
                "sampling_prob": Q,
                "steps": STEPS,
            },
            "privacy": {"epsilon": TARGET_EPSILON, "delta": DELTA},
            "output": {"seed": 0},
        }
    )


def _engine_tail_probes(strategy) -> set[int]:
    """The column counts of the tail probe matrices the real engine used for the strategy's task
    (one per sketched weight and micro-batch), recorded where the sketch consumes them."""
    seen: set[int] = set()
    hutchinson, hutchpp = sketch.batched_sketch_squared_norms, sketch.batched_hutchpp_squared_norms

    def record_hutchinson(uses, probes, padded):
        seen.add(int(probes.shape[1]))
        return hutchinson(uses, probes, padded)

    def record_hutchpp(uses, head, tail, padded):
        seen.add(int(tail.shape[1]))
        return hutchpp(uses, head, tail, padded)

    cohort = strategy.sample_cohort(0, [f"user-{i}" for i in range(USERS)])
    wire = task_proto(strategy.configure_task(0, cohort), 0, "t0", 0, 0, ["user-0"], 60.0)
    task = task_from_proto(wire)
    engine = ClippingEngine(build_model(ModelConfig(preset="gpt2-tiny"), SHAPE, seed=0))
    rng = np.random.default_rng(0)
    units = [Unit(f"user-{u}", [rng.integers(3, 259, size=12 + u)]) for u in range(3)]
    with (
        mock.patch.object(sketch, "batched_sketch_squared_norms", record_hutchinson),
        mock.patch.object(sketch, "batched_hutchpp_squared_norms", record_hutchpp),
    ):
        engine.run(dataclasses.replace(EngineRequest.of_task(task, units), probe_seed=0))
    return seen


def check_accountant_gets_the_engines_tail_probes(estimator: str) -> None:
    config = _config(estimator)
    strategy = build_strategy(config, USERS, 1.0)
    tails = _engine_tail_probes(strategy)
    assert len(tails) == 1, (
        f"{estimator}: the engine sketched norms with tail probe counts {sorted(tails)}; "
        "expected one count for every weight"
    )
    (tail,) = tails
    mechanism = strategy.mechanism()
    assert mechanism.probes == tail, (
        f"{estimator}: the accountant (ledger mechanism) is told k = {mechanism.probes} probes, "
        f"but the engine's norm estimate has {tail} tail probes: its envelope must use the tail "
        "count (Hutch++'s head sketch S is not a Hutchinson probe)"
    )

    got = epsilon(mechanism, STEPS, DELTA)
    at_tail = randomized_clipping.epsilon(
        mechanism.noise_multiplier, Q, STEPS, tail, DELTA, estimator=estimator
    )
    assert math.isclose(got, at_tail, rel_tol=1e-9), (
        f"{estimator}: the run's accountant gives ε = {got:.6g} at σ = "
        f"{mechanism.noise_multiplier:g}, but ε at the engine's {tail} tail probes is "
        f"{at_tail:.6g}: the accountant is given the wrong probe count"
    )

    told: list = []

    def calibrate(template, target_epsilon, delta, steps, **options):
        told.append(template)
        return 1.0

    with mock.patch.object(calibration, "calibrate_noise_multiplier", calibrate):
        strategy_from_config(config, USERS)
    assert [getattr(m, "probes", None) for m in told] == [tail], (
        f"{estimator}: σ is calibrated for the mechanism(s) {[m.to_dict() for m in told]}, but "
        f"the engine's norm estimate has {tail} tail probes: calibration was given the wrong "
        "probe count"
    )
