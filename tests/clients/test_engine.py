"""clients/engine.py, ``loop`` engine and the semantics every engine shares: a unit's gradient is
the gradient of the mean of its examples' mean token losses, clipped jointly over all trainable
parameters, summed without normalization; non-finite units contribute zero and are counted."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from userdp.clients import unit_gradients
from userdp.clients.engine import ClippingEngine, EngineError, Unit, build_engine

from tests.clients.engine_fixtures import (
    assert_sums_close,
    byte_manifest,
    random_units,
    tiny_engine,
    tiny_model,
    total_norm,
)
from userdp.config import parse_config


def reference_clipped_sum(model: torch.nn.Module, units, clip_norm: float):
    """An independent reference: transformers' own shifted LM loss per example (labels=x), mean
    over the unit's examples, ``.backward()``, clip, sum — no code shared with the engine."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    norms = []
    for unit in units:
        model.zero_grad(set_to_none=True)
        losses = []
        for example in unit.examples:
            ids = torch.as_tensor(example, dtype=torch.long)[None]
            losses.append(model(input_ids=ids, labels=ids).loss)
        torch.stack(losses).mean().backward()
        grads = {n: p.grad.detach().double() for n, p in params.items()}
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values()))
        norms.append(norm)
        factor = min(1.0, clip_norm / norm)
        for n in total:
            total[n] += factor * grads[n]
    model.zero_grad(set_to_none=True)
    return {n: t.float() for n, t in total.items()}, norms


@pytest.mark.parametrize(
    ("engine_name", "retain_ratio"),
    [("loop", None), ("vectorized", float("inf")), ("vectorized", 0.0)],
    ids=["loop", "vectorized-retained", "vectorized-book-kept"],
)
def test_engines_match_an_independent_reference(monkeypatch, engine_name, retain_ratio):
    """``loop``, and ``vectorized`` with every weight's per-unit gradients retained (Σ_u c_u M_u)
    and with none (ghost or materialized norms, book-keeping sums)."""
    if retain_ratio is not None:
        monkeypatch.setattr(unit_gradients, "RETAIN_RATIO", retain_ratio)
    engine = tiny_engine(engine_name)
    units = random_units(5, seed=1)
    expected, norms = reference_clipped_sum(engine.module, units, clip_norm=3.5)
    assert min(norms) < 3.5 < max(norms), "the case must mix clipped and unclipped units"
    got = engine.clipped_sum(units, 3.5)
    assert_sums_close(got.sums, expected)
    assert got.stats.count == 5 and got.stats.nonfinite == 0
    assert got.stats.clipped == sum(n > 3.5 for n in norms)
    assert got.stats.norm_min == pytest.approx(min(norms), rel=1e-4)
    assert got.stats.norm_max == pytest.approx(max(norms), rel=1e-4)
    assert got.stats.norm_sum == pytest.approx(sum(norms), rel=1e-4)
    assert got.stats.norm_sum_sq == pytest.approx(sum(n * n for n in norms), rel=1e-4)
    assert got.stats.tokens == sum(len(e) - 1 for u in units for e in u.examples)
    assert got.stats.loss_sum / got.stats.tokens == pytest.approx(math.log(259), rel=0.1)


def test_sums_are_cpu_float32_for_trainable_parameters_only_tied_once():
    engine = tiny_engine("loop")
    got = engine.clipped_sum(random_units(2), 1.0)
    names = [n for n, _ in engine.module.named_parameters()]
    assert list(got.sums) == names
    assert "lm_head.weight" not in got.sums and "transformer.wte.weight" in got.sums
    for tensor in got.sums.values():
        assert tensor.device.type == "cpu" and tensor.dtype == torch.float32


def test_a_huge_gradient_contributes_exactly_norm_c():
    engine = tiny_engine("loop")
    with torch.no_grad():
        engine.module.transformer.wte.weight.mul_(1e3)  # huge logits -> huge gradient
    unit = random_units(1, seed=3)
    got = engine.clipped_sum(unit, 0.5)
    assert got.stats.norm_max > 100 and got.stats.clipped == 1
    assert total_norm(got.sums) == pytest.approx(0.5, rel=1e-5)


def test_worker_returns_the_plain_sum_not_a_mean():
    engine = tiny_engine("loop")
    units = random_units(4, seed=4)
    together = engine.clipped_sum(units, 0.3)
    parts = [engine.clipped_sum([u], 0.3) for u in units]
    summed = {n: sum(p.sums[n] for p in parts) for n in together.sums}
    assert_sums_close(together.sums, summed)
    assert together.stats.count == 4
    # all four clipped: the sum of four norm-C vectors is far above C (it was not divided)
    assert together.stats.clipped == 4 and total_norm(together.sums) > 0.3 * 1.5


def test_uls_averages_before_clipping_copies_do_not_add_weight():
    engine = tiny_engine("loop")
    example = np.arange(3, 3 + 20) % 250 + 3
    one = engine.clipped_sum([Unit("a", [example])], 1e6)
    fifty = engine.clipped_sum([Unit("a", [example] * 50)], 1e6)
    assert_sums_close(fifty.sums, one.sums, rtol=1e-5)
    assert fifty.stats.norm_max == pytest.approx(one.stats.norm_max, rel=1e-5)


def test_averaging_then_clipping_differs_from_clipping_each_example():
    """Two examples with opposite-ish gradients: their mean is small (not clipped) while each
    example's gradient alone is clipped; per-example clipping would give a different vector."""
    engine = tiny_engine("loop")
    rng = np.random.default_rng(7)
    e1, e2 = rng.integers(3, 259, 16), rng.integers(3, 259, 16)
    single = [engine.clipped_sum([Unit("x", [e])], 1e6) for e in (e1, e2)]
    n1, n2 = single[0].stats.norm_max, single[1].stats.norm_max
    user = engine.clipped_sum([Unit("u", [e1, e2])], 1e6)
    mean = {n: (single[0].sums[n] + single[1].sums[n]) / 2 for n in user.sums}
    assert_sums_close(user.sums, mean, rtol=1e-5)  # unclipped: mean of example gradients
    clip = 0.5 * min(n1, n2)
    uls = engine.clipped_sum([Unit("u", [e1, e2])], clip)
    g_mean = user.stats.norm_max
    expected_uls = {n: t * min(1.0, clip / g_mean) for n, t in mean.items()}
    assert_sums_close(uls.sums, expected_uls, rtol=1e-5)
    per_example = {
        n: sum(s.sums[n] * (clip / s.stats.norm_max) for s in single) / 2 for n in user.sums
    }
    diff = total_norm({n: uls.sums[n] - per_example[n] for n in user.sums})
    assert diff > 0.05 * clip, "averaging-then-clipping must differ from clipping per example"


def poison_token(module: torch.nn.Module, token: int, value: float = float("nan")):
    """Input embeddings of ``token`` become ``value`` (a hook: the tied lm_head is untouched)."""

    def hook(_module, inputs, output):
        hit = (inputs[0] == token).unsqueeze(-1)
        return torch.where(hit, torch.full_like(output, value), output)

    return module.transformer.wte.register_forward_hook(hook)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nonfinite_unit_contributes_zero_and_is_counted(value):
    poison = 200
    engine = tiny_engine("loop")
    clean = [u for u in random_units(6, seed=5) if all(poison not in e for e in u.examples)][:3]
    bad = Unit("bad", [np.array([5, 6, poison, 7, 8])])
    baseline = engine.clipped_sum(clean, 1.0)
    handle = poison_token(engine.module, poison, value)
    try:
        got = engine.clipped_sum([clean[0], bad, *clean[1:]], 1.0)
    finally:
        handle.remove()
    assert got.stats.nonfinite == 1 and got.stats.count == len(clean)
    assert_sums_close(got.sums, baseline.sums, rtol=1e-6)
    assert all(torch.isfinite(t).all() for t in got.sums.values())
    assert math.isfinite(got.stats.loss_sum) and got.stats.tokens == baseline.stats.tokens


def test_token_budget_micro_batching_gives_the_same_sum():
    units = random_units(6, seed=6, max_examples=5)
    big = tiny_engine("loop", token_budget=100_000).clipped_sum(units, 1.0)
    small = tiny_engine("loop", token_budget=20).clipped_sum(units, 1.0)
    per_call = tiny_engine("loop").clipped_sum(units, 1.0, token_budget=7)
    assert_sums_close(small.sums, big.sums, rtol=1e-5)
    assert_sums_close(per_call.sums, big.sums, rtol=1e-5)
    assert small.stats.norm_sum == pytest.approx(big.stats.norm_sum, rel=1e-5)


def test_short_examples_are_skipped_and_counted():
    engine = tiny_engine("loop")
    full = [np.array([4, 5, 6, 7])]
    got = engine.clipped_sum(
        [Unit("a", [np.array([9]), *full]), Unit("empty", [np.array([3]), np.array([], int)])],
        1.0,
    )
    ref = engine.clipped_sum([Unit("a", full)], 1.0)
    assert got.skipped_examples == 3 and got.stats.count == 2 and got.stats.nonfinite == 0
    assert got.stats.norm_min == 0.0
    assert_sums_close(got.sums, ref.sums, rtol=1e-6)


def test_lora_sums_hold_only_adapter_parameters():
    engine = tiny_engine("loop", lora_rank=2)
    got = engine.clipped_sum(random_units(2), 1.0)
    assert got.sums and all("lora_" in name for name in got.sums)
    trainable = {n for n, p in engine.module.named_parameters() if p.requires_grad}
    assert set(got.sums) == trainable
    assert total_norm(got.sums) > 0


def test_bad_inputs_raise_clear_errors():
    engine = tiny_engine("loop")
    with pytest.raises(EngineError, match="local_lr"):
        engine.clipped_sum(random_units(1), 1.0, local_steps=2, local_lr=0.0)
    with pytest.raises(EngineError, match="clip_norm"):
        engine.clipped_sum(random_units(1), 0.0)
    with pytest.raises(EngineError, match="data.seq_len"):
        engine.clipped_sum([Unit("long", [np.arange(200) % 250 + 3])], 1.0)
    with pytest.raises(EngineError, match="integer"):
        engine.clipped_sum([Unit("f", [np.array([0.5, 1.5])])], 1.0)
    with pytest.raises(EngineError, match="engine"):
        ClippingEngine(tiny_model(), engine="magic")


def test_build_engine_from_config_with_deepspeed():
    config = parse_config(
        {
            "data": {"seq_len": 24},
            "strategy": {"engine": "loop"},
            "workers": {"token_budget": 64},
        }
    )
    engine = build_engine(config, byte_manifest())
    assert engine.deepspeed_engine is not None and engine.module is engine.deepspeed_engine.module
    assert engine.engine == "loop" and engine.token_budget == 64
    units = random_units(3, seed=8)
    plain = ClippingEngine(tiny_model(seed=0), engine="loop")
    assert_sums_close(engine.clipped_sum(units, 1.0).sums, plain.clipped_sum(units, 1.0).sums)
    assert all(p.grad is None for p in engine.module.parameters())


def test_cuda_device_without_a_gpu_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = parse_config({"data": {"seq_len": 24}, "workers": {"device": "cuda"}})
    with pytest.raises(EngineError, match="no CUDA device is visible"):
        build_engine(config, byte_manifest())
