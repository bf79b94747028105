"""DP-FedAvg local training in the worker engine (clients/fedavg.py): the clipped quantity is the
model delta θ_broadcast − θ_local after local SGD steps on the unit's own examples."""

from __future__ import annotations

import copy

import numpy as np
import torch
from userdp.clients.engine import ClippingEngine, Unit

from tests.clients.engine_fixtures import (
    assert_sums_close,
    random_units,
    tiny_model,
    total_norm,
)


def test_one_local_step_on_all_examples_is_lr_times_the_fedsgd_gradient():
    """Δ = lr·g, so Σ clip(Δ, C) = lr·Σ clip(g, C/lr)."""
    module = tiny_model()
    units = random_units(4, seed=41)
    lr, clip_norm = 0.05, 0.22
    engine = ClippingEngine(module, engine="loop")
    fedavg = engine.clipped_sum(units, clip_norm, local_steps=1, local_lr=lr)
    fedsgd = engine.clipped_sum(units, clip_norm / lr)
    assert 0 < fedavg.stats.clipped == fedsgd.stats.clipped < 4
    assert_sums_close(fedavg.sums, {n: lr * t for n, t in fedsgd.sums.items()}, rtol=1e-5)


def manual_delta(module, examples, steps, lr, batch_size):
    """Independent reference: a deep copy, transformers' own loss, ``.backward()``, SGD."""
    local = copy.deepcopy(module)
    trainable = [p for p in local.parameters() if p.requires_grad]
    n = len(examples)
    size = batch_size or n
    for step in range(steps):
        chosen = [examples[(step * size + i) % n] for i in range(size)]
        local.zero_grad(set_to_none=True)
        losses = []
        for example in chosen:
            ids = torch.as_tensor(example, dtype=torch.long)[None]
            losses.append(local(input_ids=ids, labels=ids).loss)
        torch.stack(losses).mean().backward()
        with torch.no_grad():
            for p in trainable:
                p.sub_(lr * p.grad)
    start = dict(module.named_parameters())
    return {
        name: (start[name] - p).detach() for name, p in local.named_parameters() if p.requires_grad
    }


def test_several_local_steps_with_batches_match_a_manual_sgd_loop_and_clip_jointly():
    module = tiny_model()
    rng = np.random.default_rng(42)
    examples = [rng.integers(3, 259, int(rng.integers(5, 20))) for _ in range(5)]
    delta = manual_delta(module, examples, steps=3, lr=0.1, batch_size=2)
    norm = total_norm(delta)
    engine = ClippingEngine(module, engine="vectorized", token_budget=30)
    unclipped = engine.clipped_sum(
        [Unit("u", examples)], 1e6, local_steps=3, local_lr=0.1, local_batch_size=2
    )
    assert_sums_close(unclipped.sums, delta, rtol=1e-4)
    clipped = engine.clipped_sum(
        [Unit("u", examples)], norm / 2, local_steps=3, local_lr=0.1, local_batch_size=2
    )
    assert clipped.stats.clipped == 1
    assert abs(total_norm(clipped.sums) - norm / 2) < 1e-5 * norm
    # the shared model was not modified by local training
    fresh = tiny_model()
    for (name, p), q in zip(module.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_lora_fedavg_deltas_cover_only_adapters():
    module = tiny_model(lora_rank=2)
    got = ClippingEngine(module, engine="loop").clipped_sum(
        random_units(2, seed=43), 1.0, local_steps=2, local_lr=0.5
    )
    assert got.sums and all("lora_" in n for n in got.sums) and total_norm(got.sums) > 0
