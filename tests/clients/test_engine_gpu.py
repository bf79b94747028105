"""The worker engine on a CUDA device (skipped without one; run on a GPU machine with
``pytest -m gpu``): the CUDA engines compute the same clipped sums as the CPU reference, the
result leaves the device as CPU float32, every unit's contribution stays within C under bf16
and DeepSpeed, and the randomized engine's probes keep their law on the device."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats
from userdp.clients import matmul_precision, tensor_core_bound
from userdp.clients.engine import ClippingEngine, build_engine
from userdp.clients.sketch import GaussianProbes

from tests.clients.engine_fixtures import (
    SEQ_LEN,
    assert_sums_close,
    byte_manifest,
    random_units,
    tiny_model,
    total_norm,
)
from userdp.config import parse_config

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def exact_float32_matmul():
    """TF32 would make CUDA float32 products agree with the CPU only to ~1e-3."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def cpu_loop(units, clip_norm, seed=0):
    return ClippingEngine(tiny_model(seed=seed), engine="loop").clipped_sum(units, clip_norm)


@pytest.mark.parametrize("engine", ["loop", "vectorized"])
def test_cuda_engines_equal_the_cpu_loop_in_float32(engine):
    units = random_units(12, seed=31, max_examples=5)
    reference = cpu_loop(units, 3.5)
    assert 0 < reference.stats.clipped < len(units)  # both branches of the clip are exercised
    got = ClippingEngine(tiny_model().to(CUDA), engine=engine).clipped_sum(units, 3.5)
    assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in got.sums.values())
    assert_sums_close(got.sums, reference.sums, rtol=1e-4)
    assert (got.stats.count, got.stats.clipped, got.stats.nonfinite, got.stats.tokens) == (
        reference.stats.count,
        reference.stats.clipped,
        reference.stats.nonfinite,
        reference.stats.tokens,
    )
    assert got.stats.norm_sum == pytest.approx(reference.stats.norm_sum, rel=1e-4)


def test_cuda_vectorized_micro_batches_give_the_same_sum():
    units = random_units(10, seed=32, max_examples=4)
    engine = ClippingEngine(tiny_model().to(CUDA), engine="vectorized")
    whole = engine.clipped_sum(units, 2.0, token_budget=8192)
    split = engine.clipped_sum(units, 2.0, token_budget=2 * SEQ_LEN)
    assert_sums_close(split.sums, whole.sums, rtol=1e-5)


def test_every_unit_contributes_at_most_c_on_cuda():
    """One unit per call: a clipped unit's contribution has norm exactly C (to float32)."""
    engine = ClippingEngine(tiny_model().to(CUDA), engine="vectorized")
    for unit in random_units(6, seed=33, max_examples=3):
        got = engine.clipped_sum([unit], 1e-3)
        assert got.stats.clipped == 1
        assert total_norm(got.sums) == pytest.approx(1e-3, rel=1e-4)


def ds_config(zero_stage: int, dtype: str, engine: str):
    return parse_config(
        {
            "data": {"seq_len": SEQ_LEN},
            "model": {"preset": "gpt2-tiny", "dtype": dtype, "zero_stage": zero_stage},
            "strategy": {"engine": engine},
            "workers": {"device": "cuda", "token_budget": 64},
        }
    )


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_deepspeed_cuda_engine_fp32_equals_the_cpu_loop(zero_stage):
    engine = build_engine(ds_config(zero_stage, "fp32", "vectorized"), byte_manifest())
    assert engine.deepspeed_engine is not None and engine.device.type == "cuda"
    units = random_units(8, seed=34)
    got = engine.clipped_sum(units, 2.0)
    assert_sums_close(got.sums, cpu_loop(units, 2.0).sums, rtol=1e-4)
    assert all(p.grad is None for p in engine.module.parameters())


def test_deepspeed_cuda_bf16_stays_within_the_clip_bound_and_near_fp32():
    """bf16 changes the gradients (~1e-2 relative), never the sensitivity: each unit's
    contribution is clipped in float32 after the bf16 backward."""
    engine = build_engine(ds_config(2, "bf16", "vectorized"), byte_manifest())
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    units = random_units(8, seed=35)
    for unit in units[:3]:
        one = engine.clipped_sum([unit], 1e-3)
        assert one.stats.clipped == 1 and total_norm(one.sums) <= 1e-3 * (1 + 1e-4)
    got = engine.clipped_sum(units, 1e6)  # nothing clipped: the plain sum of gradients
    reference = cpu_loop(units, 1e6)
    assert all(torch.isfinite(t).all() for t in got.sums.values())
    diff = math.sqrt(
        sum(float((got.sums[n] - reference.sums[n]).double().pow(2).sum()) for n in got.sums)
    )
    assert diff <= 5e-2 * total_norm(reference.sums)


def test_randomized_engine_on_cuda_equals_loop_when_nothing_is_clipped():
    units = random_units(5, seed=36)
    got = ClippingEngine(tiny_model().to(CUDA), engine="randomized", probes=4).clipped_sum(
        units, 1e6
    )
    assert got.stats.clipped == 0
    assert_sums_close(got.sums, cpu_loop(units, 1e6).sums, rtol=1e-4)


def test_cuda_probes_are_gaussian_with_variance_one_over_k():
    source = GaussianProbes(16, seed=0)
    drawn = source.draw(8000, CUDA)
    assert drawn.device.type == "cuda" and drawn.shape == (8000, 16)
    scaled = (drawn * 4).flatten().double().cpu().numpy()  # √k·P ~ N(0, 1)
    assert stats.kstest(scaled, "norm").pvalue > 1e-4
    assert not torch.equal(drawn, source.draw(8000, CUDA))


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


def test_bf16_products_are_float32_exact_on_the_tensor_cores():
    """Tensor-core mode: mm32 on bf16 operands (exact products, float32 accumulation) and the book-keeping's
    two-part split of a float32 right factor agree with float64 as closely as a float32 GEMM
    of the same values does (float32 accumulation over 4096 terms: a few 1e-6; the split adds
    at most 2^-16 per entry, a few 1e-6 over random data), not to bf16 rounding."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    left = torch.randn(4096, 768, device=CUDA, generator=gen).to(torch.bfloat16)
    right = torch.randn(4096, 3072, device=CUDA, generator=gen).to(torch.bfloat16)
    scaled = right.float() * torch.rand(4096, 1, device=CUDA, generator=gen)  # c_t ⊙ R
    with matmul_precision.exact_matmul(tensor_cores=True):
        product = matmul_precision.mm32(left.T, right)
        booked = matmul_precision.left_times_scaled(left, scaled)
        batched = matmul_precision.mm32(
            left.view(4, 1024, 768).transpose(1, 2), right.view(4, 1024, 3072)
        )
    assert product.dtype == booked.dtype == batched.dtype == torch.float32
    assert _relative_error(product, left.double().T @ right.double()) < 2e-5
    assert _relative_error(booked, left.double().T @ scaled.double()) < 2e-5
    want = torch.bmm(
        left.double().view(4, 1024, 768).transpose(1, 2), right.double().view(4, 1024, 3072)
    )
    assert _relative_error(batched, want) < 2e-5
    fp32 = left.float().T @ scaled  # the float32 GEMM the split replaces, same order of error
    assert _relative_error(fp32, left.double().T @ scaled.double()) < 2e-5
    # the positive control: one bf16 rounding of the scaled factor is orders worse
    assert (
        _relative_error(
            matmul_precision.mm32(left.T, scaled.bfloat16()), left.double().T @ scaled.double()
        )
        > 1e-4
    )


def test_float32_products_ignore_a_global_tf32_setting():
    gen = torch.Generator(device="cuda").manual_seed(1)
    a = torch.randn(2048, 2048, device=CUDA, generator=gen)
    b = torch.randn(2048, 2048, device=CUDA, generator=gen)
    want = a.double() @ b.double()
    torch.backends.cuda.matmul.allow_tf32 = True  # the fixture restores it
    assert _relative_error(a @ b, want) > 1e-5  # TF32 is really on outside the context
    with matmul_precision.exact_matmul():
        assert _relative_error(matmul_precision.mm32(a, b), want) < 2e-5
    assert torch.backends.cuda.matmul.allow_tf32


@pytest.mark.parametrize("tensor_cores", [False, True])
def test_bf16_products_with_unaligned_dimensions(tensor_cores):
    """GPT-2's vocabulary (50257) as M, as the inner dimension of both operands, and as the
    inner dimension of one operand only: the tensor-core path's zero padding never changes the
    product, and every entry is within the rounding bound the engine clips by,
    |fl(A B) − A B| ≤ γ(K)·(|A| |B|) entrywise (clients/tensor_core_bound.py: γ = dot_error for
    the tensor cores, the IEEE bound for float32 GEMMs). Measured on an H100 over the 50257-term
    Gram: IEEE float32 3.7e-5 relative (either sign), the tensor cores 2.3e-4 and low."""
    gen = torch.Generator(device="cuda").manual_seed(2)

    def bf16(*shape):
        return torch.randn(*shape, device=CUDA, generator=gen).to(torch.bfloat16)

    g, a = bf16(1000, 50257), bf16(1000, 771)
    rows = bf16(3, 40, 50257)
    row_major, right = bf16(37, 1003), bf16(1003, 19)
    cases = [
        (g.T, a),  # M unaligned, stored inner (the lm_head book-keeping)
        (rows, rows.transpose(1, 2)),  # K unaligned, inner on both sides (the ghost Gram)
        (row_major, right),  # K unaligned, inner on the left only; M and N unaligned too
    ]
    with matmul_precision.exact_matmul(tensor_cores=tensor_cores):
        for left, right_side in cases:
            got = matmul_precision.mm32(left, right_side)
            want = torch.matmul(left.double(), right_side.double())
            assert got.shape == want.shape and got.dtype == torch.float32
            inner = left.shape[-1]
            gamma = (
                tensor_core_bound.dot_error(inner)
                if tensor_cores
                else tensor_core_bound.ieee_error(inner)
            )
            allowed = gamma * torch.matmul(left.double().abs(), right_side.double().abs())
            assert bool(((got.double() - want).abs() <= allowed).all())


@pytest.mark.parametrize("shift", [0, 4, 8])
def test_tensor_core_accumulation_keeps_the_bits_the_bound_assumes(shift):
    """Stagnation on the hardware: an accumulator of 1, then products (255/128)·2^-(24 − shift)
    of bf16 factors. A device that keeps p ≥ 24 aligned bits loses less than 2^-23 of each, inside
    γ(n)·Σ|p|; one that keeps 24 − shift bits or fewer loses every one of them, about 2^(shift+1)/7
    times the bound for shift ≥ 4: the test fails on a device outside the model."""
    n = 4096
    left = torch.full((1, n), 255 / 128 * 2.0**-12, device=CUDA)
    right = torch.full((n, 1), 2.0 ** (-12 + shift), device=CUDA)
    left[0, 0] = right[0, 0] = 1.0
    left, right = left.to(torch.bfloat16), right.to(torch.bfloat16)
    exact = float(left.double() @ right.double())
    with matmul_precision.exact_matmul(tensor_cores=True):
        got = float(matmul_precision.mm32(left, right))
    assert abs(got - exact) <= tensor_core_bound.dot_error(n) * exact


def test_tensor_core_mode_matches_ieee_float32_and_clips_by_a_bound():
    """workers.tensor_core_matmul (the default) on a bf16 model: the same sums as IEEE float32
    GEMMs to bf16-product accuracy, and every norm it clips by at least the IEEE one (the
    rounding bound only ever raises a norm) and within a few percent of it (the bound is not so
    loose that it clips much harder)."""
    units = random_units(8, seed=37, max_examples=5)
    config = ds_config(0, "bf16", "vectorized")
    ieee = config.model_copy(
        update={"workers": config.workers.model_copy(update={"tensor_core_matmul": False})}
    )
    default = build_engine(ieee, byte_manifest()).clipped_sum(units, 1e6)
    engine = build_engine(config, byte_manifest())
    assert engine.tensor_core_matmul
    tc = engine.clipped_sum(units, 1e6)
    scale = total_norm(default.sums)
    diff = math.sqrt(
        sum(float((tc.sums[n] - default.sums[n]).double().pow(2).sum()) for n in tc.sums)
    )
    assert diff <= 2e-3 * scale
    ratio = tc.stats.norm_sum / default.stats.norm_sum
    assert 1 - 1e-4 < ratio < 1.05


def test_sums_copied_on_a_side_stream_during_the_last_micro_batch_equal_one_copy(monkeypatch):
    """The single-process CUDA engine copies its sums to page-locked host memory during its
    last micro-batch, range by range on a side stream: bit for bit what one copy at the end
    gives. Every write to the sums is queued behind a ~1 ms GPU sleep, so the host is far ahead
    of the device: a copy that did not wait for the compute stream would read stale sums."""
    from userdp.clients.batching import prepare_units
    from userdp.clients.clipping import Accumulator, UnitWork
    from userdp.clients.vectorized import vectorized_clipped_sum

    def late(method):
        def write(self, *args, **kwargs):
            torch.cuda._sleep(2_000_000)  # GPU cycles, on the compute stream
            return method(self, *args, **kwargs)

        return write

    for name in ("add", "add_unit_sum"):
        monkeypatch.setattr(Accumulator, name, late(getattr(Accumulator, name)))

    engine = ClippingEngine(tiny_model().to(CUDA), engine="vectorized", token_budget=60)
    units = random_units(16, seed=41, max_examples=2)
    prepared = prepare_units(units, engine.max_positions)
    results = []
    for flag in (False, True):
        acc = Accumulator(engine.params, 2.5, early_copy=flag)
        acc.COPY_ELEMENTS = 4096  # many ranges, each racing the kernels queued after it
        vectorized_clipped_sum(
            UnitWork(
                engine.module, engine.params, prepared, range(len(units)), acc, 60, engine.pad_id
            )
        )
        assert (acc._copied > 0) == flag
        results.append(acc.host_sums())
    assert all(t.is_pinned() for t in results[1].values())
    for name in results[0]:
        assert torch.equal(results[0][name], results[1][name]), name
    got = ClippingEngine(tiny_model().to(CUDA), engine="vectorized", token_budget=60)
    assert_sums_close(got.clipped_sum(units, 2.5).sums, results[0], rtol=1e-6)


def test_device_rates_are_measured_once_with_the_tensor_cores_ahead():
    """The rates the vectorized engine prices retained against book-kept weights with
    (clients/unit_cost.py): measured once per device, bf16 tensor-core GEMMs faster than IEEE
    float32 ones, memory in the range of any CUDA GPU, and the caller's random draws and float32
    precision setting untouched."""
    from userdp.clients import unit_cost
    from userdp.clients.unit_cost import device_rates

    unit_cost._measured.cache_clear()
    precision = torch.get_float32_matmul_precision()
    torch.cuda.manual_seed(7)
    expected = torch.randn(4, device=CUDA)
    torch.cuda.manual_seed(7)
    rates = device_rates(CUDA)
    assert torch.equal(torch.randn(4, device=CUDA), expected)
    assert torch.get_float32_matmul_precision() == precision
    assert rates is device_rates(torch.device("cuda", torch.cuda.current_device()))
    assert rates.bf16_flops > rates.float32_flops > 1e12
    assert 1e10 < rates.memory_bytes < 1e14


def test_onehot_rows_added_in_place_on_cuda_equal_the_reference_without_a_copy():
    """A tied embedding / LM head weight's per-unit gradients on the tensor cores (bf16 rows, a
    vocabulary that is not a multiple of 8, so the product is a view of a padded GEMM output):
    the onehot rows are added where they land, without a copy of the [U, vocab, width] product
    (peak memory of the add far below its size), and each unit's gradient equals the float64
    reference to the rounding of bf16 products accumulated in float32."""
    from userdp.clients import norms
    from userdp.clients.matmul_precision import add_scattered, exact_matmul
    from userdp.clients.norms import Factor, Padded

    gen = torch.Generator().manual_seed(12)
    vocab, width, n = 1001, 64, 96
    ids = torch.randint(0, vocab, (n,), generator=gen)
    ids[:10] = 7
    left = torch.randn(n, vocab, generator=gen).to(torch.bfloat16)
    rights = [torch.randn(n, width, generator=gen).to(torch.bfloat16) for _ in range(2)]
    spans = [slice(0, 30), slice(30, 64), slice(64, 96)]
    uses = [
        (Factor(None, ids.to(CUDA), vocab), rights[0].to(CUDA)),
        (Factor(left.to(CUDA), None, vocab), rights[1].to(CUDA)),
    ]
    padded = Padded.of(spans, n, CUDA)
    calls = []

    def measured(total, *args):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = add_scattered(total, *args)
        torch.cuda.synchronize()
        calls.append((torch.cuda.max_memory_allocated() - before, total.numel() * 4))
        return out

    with exact_matmul(tensor_cores=True):
        lefts, padded_rights = norms.padded_factors(uses, padded)
        original = norms.add_scattered
        norms.add_scattered = measured
        try:
            per_unit = norms.padded_unit_gradients(lefts, padded_rights, (vocab, width))
        finally:
            norms.add_scattered = original
    ((grown, size),) = calls
    assert not per_unit.is_contiguous()  # the padded GEMM's view: the case that must not copy
    assert grown < size / 4, f"the add allocated {grown} bytes for a {size}-byte product"
    for j, span in enumerate(spans):
        want = left[span].double().T @ rights[1][span].double()
        want.index_add_(0, ids[span], rights[0][span].double())
        torch.testing.assert_close(per_unit[j].double().cpu(), want, rtol=1e-4, atol=1e-4)
