"""The ``vectorized`` engine (clients/vectorized.py, clients/ghost.py) agrees with ``loop``: ghost
and materialized user-level norms, the tied wte/lm_head weight, LayerNorm and generic modules,
book-keeping sums and sums of retained per-unit gradients, non-finite units, oversized units;
unsupported layouts are refused, not silently mis-clipped."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from userdp.clients import ghost, matmul_precision, norms, unit_gradients
from userdp.clients.engine import ClippingEngine, EngineError, Unit
from userdp.clients.norms import Factor, Padded, ghost_squared_norm, materialize

from tests.clients.engine_fixtures import (
    assert_sums_close,
    random_units,
    tiny_model,
    total_norm,
)
from tests.clients.test_engine import poison_token


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def lora_model():
    return tiny_model(lora_rank=2)


def both(module, units, clip_norm, **kwargs):
    loop = ClippingEngine(module, engine="loop", **kwargs).clipped_sum(units, clip_norm)
    vec = ClippingEngine(module, engine="vectorized", **kwargs).clipped_sum(units, clip_norm)
    return loop, vec


def assert_same(loop, vec):
    assert_sums_close(vec.sums, loop.sums, rtol=2e-5)
    assert (vec.stats.count, vec.stats.nonfinite, vec.stats.clipped, vec.stats.tokens) == (
        loop.stats.count,
        loop.stats.nonfinite,
        loop.stats.clipped,
        loop.stats.tokens,
    )
    for key in ("norm_min", "norm_max", "norm_sum", "norm_sum_sq", "loss_sum"):
        assert getattr(vec.stats, key) == pytest.approx(getattr(loop.stats, key), rel=1e-5), key


def test_ghost_identity_equals_materialized_norm_with_tied_uses():
    """‖Σ_c L_cᵀR_c‖² by Σ_{c,c'} ⟨L_cL_c'ᵀ, R_cR_c'ᵀ⟩, for dense and onehot (embedding) uses of
    one weight, in float64 (the trace identity ‖AᵀG‖²_F = tr(GᵀAAᵀG) behind the Hutchinson
    sketch of "Efficient DP-SGD for LLMs with Randomized Clipping")."""
    gen = torch.Generator().manual_seed(0)
    vocab, width, n = 11, 5, 9
    dense = Factor(torch.randn(n, vocab, generator=gen, dtype=torch.float64), None, vocab)
    onehot = Factor(None, torch.randint(0, vocab, (n,), generator=gen), vocab)
    uses = [
        (dense, torch.randn(n, width, generator=gen, dtype=torch.float64)),
        (onehot, torch.randn(n, width, generator=gen, dtype=torch.float64)),
    ]
    full = materialize(uses, torch.Size([vocab, width])).double()
    explicit = uses[0][0].dense.T @ uses[0][1]
    explicit.index_add_(0, onehot.index, uses[1][1])
    assert torch.allclose(full, explicit, rtol=1e-5, atol=1e-5)
    assert ghost_squared_norm(uses) == pytest.approx(float(explicit.pow(2).sum()), rel=1e-10)


@pytest.mark.parametrize(("d0", "d1", "max_len"), [(40, 30, 8), (4, 3, 20)])  # ghost, dense
@pytest.mark.parametrize("buffer", [norms.MAX_BUFFER_ELEMENTS, 50])  # one chunk, many chunks
def test_batched_unit_norms_equal_per_unit_materialized_norms(monkeypatch, d0, d1, max_len, buffer):
    monkeypatch.setattr(norms, "MAX_BUFFER_ELEMENTS", buffer)
    gen = torch.Generator().manual_seed(1)
    lengths = [int(n) for n in torch.randint(1, max_len + 1, (7,), generator=gen)]
    n = sum(lengths)
    spans, start = [], 0
    for length in lengths:
        spans.append(slice(start, start + length))
        start += length
    uses = [
        (Factor(torch.randn(n, d0, generator=gen), None, d0), torch.randn(n, d1, generator=gen)),
        (Factor(None, torch.randint(0, d0, (n,), generator=gen), d0), torch.randn(n, d1)),
    ]
    shape = torch.Size([d0, d1])
    got = norms.batched_exact_squared_norms(uses, Padded.of(spans, n, torch.device("cpu")), shape)
    for j, span in enumerate(spans):
        unit = [(f.select(span), r[span]) for f, r in uses]
        want = float(materialize(unit, shape).double().pow(2).sum())
        assert float(got[j]) == pytest.approx(want, rel=1e-4)


def spy_retained(monkeypatch) -> list[tuple[tuple[int, ...], bool]]:
    """Records (weight shape, retained?) for every exact weight norm the engine plans."""
    decisions = []
    plan = ghost.retains_unit_gradients

    def spy(uses, padded, shape, rates=None):
        retained = plan(uses, padded, shape, rates)
        decisions.append((tuple(shape), retained))
        return retained

    monkeypatch.setattr(ghost, "retains_unit_gradients", spy)
    return decisions


def test_gpt2_small_users_retain_their_gradients_and_examples_do_not():
    """The rule at GPT-2 small's shapes: 4 users × 4 × 127 positions retain the MLP and attention
    weights' per-unit gradients (no book-keeping product for them); 16 examples of 127 positions
    keep the ghost norm and the book-keeping; bf16 rows (half the bytes) need users twice as
    long."""

    def retained(units: int, positions: int, shape: tuple[int, int], dtype=torch.float32):
        spans = [slice(u * positions, (u + 1) * positions) for u in range(units)]
        padded = Padded.of(spans, units * positions, torch.device("cpu"))
        left = Factor(torch.empty(0, shape[0], dtype=dtype), None, shape[0])
        use = (left, torch.empty(0, shape[1], dtype=dtype))
        return unit_gradients.retains_unit_gradients([use], padded, torch.Size(shape))

    for shape in [(768, 3072), (3072, 768), (768, 2304), (768, 768)]:
        assert retained(4, 4 * 127, shape)
        assert not retained(16, 127, shape)
        assert retained(4, 8 * 127, shape, torch.bfloat16)
    assert not retained(4, 4 * 127, (768, 3072), torch.bfloat16)


@pytest.mark.parametrize(
    ("ratio", "chunk"),
    [
        (unit_gradients.RETAIN_RATIO, unit_gradients.RETAINED_CHUNK_ELEMENTS),
        (0.0, None),
        (0.6, None),
        (2.0, 1),
    ],
)
def test_retained_and_book_kept_weights_both_equal_loop(monkeypatch, model, ratio, chunk):
    """Users of 3 examples × 20–24 tokens: at the default ratio every weight of gpt2-tiny
    retains its per-unit gradients (Σ_u c_u M_u, no book-keeping product); ratio 0 sends the same
    micro-batch through ghost / materialized norms and book-keeping; 0.6 mixes both ways in one
    micro-batch; chunk 1: one unit per retained chunk. Each equals loop, clipped and not."""
    if chunk is not None:
        monkeypatch.setattr(unit_gradients, "RETAINED_CHUNK_ELEMENTS", chunk)
    monkeypatch.setattr(unit_gradients, "RETAIN_RATIO", ratio)
    decisions = spy_retained(monkeypatch)
    rng = np.random.default_rng(21)
    units = [
        Unit(f"r{i}", [rng.integers(3, 259, int(rng.integers(20, 25))) for _ in range(3)])
        for i in range(5)
    ]
    free = ClippingEngine(model, engine="loop").clipped_sum(units, 1e6)
    clip_norm = free.stats.norm_sum / free.stats.count  # the mean norm: some units clip
    loop, vec = both(model, units, clip_norm)
    assert 0 < loop.stats.clipped < 5
    assert_same(loop, vec)
    retained = {shape: r for shape, r in decisions}
    if ratio == 0.0:
        assert not any(retained.values())
    elif ratio == 0.6:
        assert retained[(64, 64)] and not retained[(64, 256)]
    else:
        assert all(retained.values()) and (64, 256) in retained


@pytest.mark.parametrize("clip_norm", [3.5, 1e6])
def test_vectorized_equals_loop(model, clip_norm):
    # up to 6 examples of up to 24 tokens: units below and above the ghost/materialize switch
    units = random_units(7, seed=11, max_examples=6)
    loop, vec = both(model, units, clip_norm)
    assert 0 < loop.stats.clipped < 7 if clip_norm == 3.5 else loop.stats.clipped == 0
    assert_same(loop, vec)


def test_vectorized_equals_loop_with_lora(lora_model):
    units = random_units(5, seed=12)
    loop, vec = both(lora_model, units, 0.05)
    assert loop.stats.clipped > 0 and all("lora_" in n for n in vec.sums)
    assert_same(loop, vec)


def test_vectorized_micro_batches_and_oversized_units(model):
    """Budget 40: several micro-batches, and units over budget run chunked through the loop
    path; one example over the budget runs alone."""
    rng = np.random.default_rng(13)
    units = random_units(4, seed=13, max_examples=3)
    units.append(Unit("long-example", [rng.integers(3, 259, 24)]))  # 23 positions
    loop = ClippingEngine(model, engine="loop").clipped_sum(units, 3.5)
    for budget in (40, 10):
        vec = ClippingEngine(model, engine="vectorized", token_budget=budget)
        assert_same(loop, vec.clipped_sum(units, 3.5))


def test_vectorized_huge_gradient_contributes_exactly_c():
    module = tiny_model()
    with torch.no_grad():
        module.transformer.wte.weight.mul_(1e3)
    got = ClippingEngine(module, engine="vectorized").clipped_sum(random_units(1, seed=3), 0.5)
    assert got.stats.clipped == 1 and got.stats.norm_max > 100
    assert total_norm(got.sums) == pytest.approx(0.5, rel=1e-5)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize(("ratio", "chunk"), [(0.0, None), (float("inf"), 1), (float("inf"), None)])
def test_vectorized_nonfinite_unit_is_dropped_from_a_shared_micro_batch(
    monkeypatch, value, ratio, chunk
):
    """Book-kept (ratio 0) and retained per-unit gradients (one unit per chunk, or one chunk):
    the poisoned unit in the middle of the micro-batch reaches no other unit's sum."""
    monkeypatch.setattr(unit_gradients, "RETAIN_RATIO", ratio)
    if chunk is not None:
        monkeypatch.setattr(unit_gradients, "RETAINED_CHUNK_ELEMENTS", chunk)
    module = tiny_model()
    poison = 200
    clean = [u for u in random_units(8, seed=5) if all(poison not in e for e in u.examples)][:4]
    bad = Unit("bad", [np.array([5, 6, poison, 7, 8]), np.array([9, 10, 11])])
    baseline = ClippingEngine(module, engine="loop").clipped_sum(clean, 1.0)
    handle = poison_token(module, poison, value)
    try:
        got = ClippingEngine(module, engine="vectorized").clipped_sum(
            [*clean[:2], bad, *clean[2:]], 1.0
        )
    finally:
        handle.remove()
    assert got.stats.nonfinite == 1 and got.stats.count == len(clean)
    assert all(torch.isfinite(t).all() for t in got.sums.values())
    assert_sums_close(got.sums, baseline.sums, rtol=2e-5)


# ---- a toy causal LM with a "generic" module (re-run per unit) ------------------------------


class ScaleNorm(torch.nn.Module):
    """RMS-style norm with a learned gain: not one of the specialized layer kinds."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = torch.nn.Parameter(torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.gain


class ToyLM(torch.nn.Module):
    def __init__(
        self,
        vocab: int = 31,
        width: int = 8,
        transpose: bool = False,
        functional: bool = False,
        sequence_first: bool = False,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, width)
        self.norm = ScaleNorm(width)
        self.mix = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab, bias=False)
        self.transpose = transpose
        self.functional = functional
        self.sequence_first = sequence_first

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        h = self.embed(input_ids)
        h = torch.cumsum(self.norm(h), dim=1)  # causal mixing over positions
        if self.transpose:  # [length, rows, width]: tokens not batch-first
            h = self.mix(h.transpose(0, 1)).transpose(0, 1)
        elif self.sequence_first:  # flattened [length·rows, width]: looks like [rows·length]
            rows, length, width = h.shape
            flat = self.mix(h.transpose(0, 1).reshape(length * rows, width))
            h = torch.tanh(flat.reshape(length, rows, width).transpose(0, 1))
        else:
            h = torch.tanh(self.mix(h))
        if self.functional:  # mix.weight used again OUTSIDE its module: invisible to hooks
            h = h + torch.nn.functional.linear(h, self.mix.weight)
        return SimpleNamespace(logits=self.head(h))


def toy_units(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        Unit(f"t{i}", [rng.integers(0, 31, int(rng.integers(2, 9))) for _ in range(1 + i % 3)])
        for i in range(n)
    ]


def test_generic_modules_are_rerun_per_unit_and_agree_with_loop():
    module = ToyLM()
    units = toy_units(6)
    unclipped = ClippingEngine(module, engine="loop").clipped_sum(units, 1e6)
    clip_norm = unclipped.stats.norm_sum / unclipped.stats.count  # the mean norm: some units clip
    loop = ClippingEngine(module, engine="loop").clipped_sum(units, clip_norm)
    vec = ClippingEngine(module, engine="vectorized").clipped_sum(units, clip_norm)
    assert 0 < loop.stats.clipped < 6
    assert_same(loop, vec)
    assert float(vec.sums["norm.gain"].abs().sum()) > 0


def test_layouts_the_vectorized_engine_cannot_attribute_are_refused():
    module = ToyLM(transpose=True)
    units = [Unit("a", [np.arange(9) % 31] * 3)]  # 3 rows x 8 positions
    with pytest.raises(EngineError, match="use engine 'loop'"):
        ClippingEngine(module, engine="vectorized").clipped_sum(units, 1.0)
    assert ClippingEngine(module, engine="loop").clipped_sum(units, 1.0).stats.count == 1


def test_bf16_model_vectorized_matches_loop_to_bf16_precision():
    module = tiny_model(dtype="bf16")
    units = random_units(4, seed=14)
    loop, vec = both(module, units, 3.5)
    assert all(t.dtype == torch.float32 for t in vec.sums.values())
    assert_sums_close(vec.sums, loop.sums, rtol=3e-2)
    assert vec.stats.norm_sum == pytest.approx(loop.stats.norm_sum, rel=3e-2)


def test_a_parameter_used_outside_its_module_is_detected_not_mis_clipped():
    """The first micro-batch checks Σ_u per-unit gradients against autograd's batch gradient."""
    module = ToyLM(functional=True)
    engine = ClippingEngine(module, engine="vectorized")
    with pytest.raises(EngineError, match="mix.weight"):
        engine.clipped_sum(toy_units(4), 1.0)
    assert ClippingEngine(module, engine="loop").clipped_sum(toy_units(4), 1.0).stats.count == 4
    checked = ClippingEngine(ToyLM(), engine="vectorized")
    checked.clipped_sum(toy_units(4), 1.0)
    assert checked.attribution_verified


def test_exact_matmul_switches_tf32_off_and_restores_the_callers_setting():
    """A training script's ``torch.set_float32_matmul_precision("medium")`` (bf16 passes in
    oneDNN on CPU, TF32 on CUDA) must not reach the norms and book-keeping, and the caller's
    setting (and its legacy getters) must work again afterwards."""
    backends = torch.backends
    precision = torch.get_float32_matmul_precision()
    reduction = backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    try:
        torch.set_float32_matmul_precision("medium")
        backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        with matmul_precision.exact_matmul():
            assert backends.cuda.matmul.fp32_precision == "ieee"
            assert backends.mkldnn.matmul.fp32_precision == "ieee"
            assert not backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        assert backends.cuda.matmul.fp32_precision == "tf32"
        assert backends.mkldnn.matmul.fp32_precision == "bf16"
        assert backends.cuda.matmul.allow_bf16_reduced_precision_reduction
        assert torch.get_float32_matmul_precision() == "medium"  # legacy getter still readable
        assert backends.cuda.matmul.allow_tf32
    finally:
        torch.set_float32_matmul_precision(precision)
        backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduction


def test_split_bf16_represents_float32_to_within_two_to_the_minus_16():
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(5)) * 1e3
    parts = matmul_precision.split_bf16(x)
    assert parts.dtype == torch.bfloat16 and parts.shape == (512, 128)
    rebuilt = parts[:, :64].double() - parts[:, 64:].double()  # hi − rest
    error = ((rebuilt - x.double()).abs() / x.double().abs()).max()
    assert 2.0**-24 < float(error) <= 2.0**-16  # two 8-bit significands, not float32's 24
    assert float(((parts[:, :64].double() - x.double()).abs() / x.double().abs()).max()) > 2.0**-12
    magnitudes = parts[:, :64].double().abs() + parts[:, 64:].double().abs()
    assert float((magnitudes / x.double().abs()).max()) <= 1 + 2.0**-7  # release_error's factor


def test_split_bf16_with_a_row_factor_splits_the_product_within_the_bound():
    """hi is the product rounded to float32 then bf16; hi − rest is within (2^-16 + 2^-24) of
    the exact product (whether or not the remainder's multiply-add is fused), and the parts'
    magnitudes stay within release_error's (1 + 2^-7)."""
    gen = torch.Generator().manual_seed(6)
    rows = torch.randn(300, 40, generator=gen).to(torch.bfloat16)
    factor = torch.rand(300, 1, generator=gen)
    fused = matmul_precision.split_bf16(rows, factor)
    exact = rows.double() * factor.double()
    assert torch.equal(fused[:, :40], (rows.float() * factor).to(torch.bfloat16))
    hi, rest = fused[:, :40].double(), fused[:, 40:].double()
    assert ((hi - rest - exact).abs() <= (2.0**-16 + 2.0**-24) * exact.abs()).all()
    assert float(rest.abs().max()) > 0  # the remainder is kept, not dropped
    assert ((hi.abs() + rest.abs()) <= (1 + 2.0**-7) * exact.abs()).all()
    x = torch.randn(30, 8, generator=gen)
    before = x.clone()
    matmul_precision.split_bf16(x)
    assert torch.equal(x, before)  # the caller's float32 tensor is not written to


def test_a_layer_that_mixes_units_tokens_is_detected_not_mis_clipped():
    """Flattened tokens in sequence-first order have the shape of batch-first ones, so the hooks
    attribute them to the wrong units; the sum over units is unchanged, but single units' norms
    are not, and the first micro-batch's per-unit check refuses."""
    module = ToyLM(sequence_first=True)
    units = [Unit(f"s{i}", [np.arange(i, i + 9) % 31]) for i in range(4)]  # 4 rows x 8
    with pytest.raises(EngineError, match="mixes units' tokens"):
        ClippingEngine(module, engine="vectorized").clipped_sum(units, 1.0)
    assert ClippingEngine(module, engine="loop").clipped_sum(units, 1.0).stats.count == 4


def test_accumulator_fuses_retained_and_block_sums_into_what_per_parameter_adds_give():
    """Retained per-unit gradients (two chunks) go into the sums by their GEMMs (written, then
    accumulated), the small parameters' block into a running sum added when the sums are read;
    both equal adding each parameter's clipped sum, micro-batch by micro-batch, including a
    micro-batch with a non-finite unit left out (not multiplied by 0: its rows are NaN)."""
    from userdp.clients.clipping import Accumulator
    from userdp.clients.unit_gradients import ParameterBlock, UnitGradients

    params = {"w": torch.zeros(3, 4), "b": torch.zeros(4), "g": torch.zeros(2), "x": torch.zeros(5)}
    fused, plain = Accumulator(params, 1.0), Accumulator(params, 1.0)
    gen = torch.Generator().manual_seed(3)
    for finite in ([0, 1, 2], [0, 2], [1]):
        grads = {name: torch.randn(3, p.numel(), generator=gen) for name, p in params.items()}
        for name in grads:
            grads[name][[j for j in range(3) if j not in finite]] = float("nan")
        factors = torch.rand(3, generator=gen)
        retained = UnitGradients((grads["w"][:2], grads["w"][2:]))  # two chunks
        block = ParameterBlock.of({"b": grads["b"], "g": grads["g"]})
        fused.add_unit_sum("w", retained, factors, finite)
        fused.add_block(block, factors, finite)
        for name in ("w", "b", "g"):
            part = UnitGradients((grads[name],)).clipped_sum(factors, finite)
            plain.add(name, part.reshape(params[name].shape))
    got, want = fused.host_sums(), plain.host_sums()
    for name in params:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6)
    assert torch.isfinite(got["w"]).all() and got["w"].abs().sum() > 0
    assert torch.equal(got["x"], torch.zeros(5))  # never added: zero


def test_sums_copied_range_by_range_in_the_last_pass_equal_one_copy_when_read():
    """``early_copy``: in the last pass each parameter's sum is final once written; ranges of
    final sums, in order, are copied as they complete. A sum written again after its copy
    started (``w`` below), one written before the parameters in front of it (``x``), the block
    flushed early and a parameter never added to (``z``): the host buffer equals the sums."""
    from userdp.clients.clipping import Accumulator
    from userdp.clients.unit_gradients import ParameterBlock, UnitGradients

    params = {n: torch.zeros(k) for n, k in (("w", 6), ("b", 4), ("x", 5), ("v", 3), ("z", 2))}
    gen = torch.Generator().manual_seed(5)
    early, plain = (Accumulator(params, 1.0, early_copy=flag) for flag in (True, False))
    early.COPY_ELEMENTS = 4  # a copy as soon as four elements in order are final

    def one_pass(acc, grads, factors, last=False):
        if last:
            acc.last_pass()
        acc.add_block(ParameterBlock.of({"b": grads["b"]}), factors, [0, 1])
        acc.add_unit_sum("w", UnitGradients((grads["w"],)), factors, [0, 1])
        if last and acc.early_copy:  # ``w`` and ``b`` (the block, flushed) are final: copied
            assert acc._copied == 10
        acc.add("x", grads["x"][0])
        acc.add("v", grads["v"][1])
        acc.add("w", grads["w"][1], 0.5)  # again, after its copy started
        acc.add("x", grads["x"][1])

    for last in (False, True):
        grads = {n: torch.randn(2, p.numel(), generator=gen) for n, p in params.items()}
        factors = torch.rand(2, generator=gen)
        for acc in (early, plain):
            one_pass(acc, grads, factors, last)
    assert early._copy is not None and plain._copy is None
    got, want = early.host_sums(), plain.host_sums()
    for name in params:
        assert torch.equal(got[name], want[name]), name
    assert got["w"].data_ptr() != early.flat.data_ptr()  # the host copy, not the device buffer
    assert torch.equal(got["z"], torch.zeros(2))


def test_the_engine_copying_sums_during_its_last_micro_batch_gives_the_same_sums(model):
    """The vectorized engine declares its last micro-batch (none after it, no oversized unit):
    with ``early_copy`` the sums copied range by range while it runs equal those copied when
    read, bit for bit; with an oversized unit after the micro-batches nothing is copied early."""
    from userdp.clients.batching import prepare_units
    from userdp.clients.clipping import Accumulator, UnitWork
    from userdp.clients.vectorized import vectorized_clipped_sum

    engine = ClippingEngine(model, engine="vectorized", token_budget=40)
    units = random_units(6, seed=21, max_examples=1)  # none over the budget
    for oversized in (False, True):
        if oversized:
            units.append(Unit("long", [np.arange(3, 27)] * 3))  # 69 positions > 40
        prepared = prepare_units(units, engine.max_positions)
        results = []
        for flag in (False, True):
            acc = Accumulator(engine.params, 2.0, early_copy=flag)
            acc.COPY_ELEMENTS = 5000
            work = UnitWork(
                engine.module, engine.params, prepared, range(len(units)), acc, 40, engine.pad_id
            )
            vectorized_clipped_sum(work)
            assert (acc._copy is not None) == (flag and not oversized)
            copied_before_read = acc._copied
            results.append(acc.host_sums())
        assert copied_before_read > 0 or oversized  # copies ran while the engine did
        for name in results[0]:
            assert torch.equal(results[0][name], results[1][name]), name


@pytest.mark.parametrize("padded_columns", [0, 3])
def test_onehot_rows_added_in_place_equal_a_scatter_then_an_add(monkeypatch, padded_columns):
    """A tied embedding / LM head weight (a dense use, then a onehot use with an id repeated):
    the onehot rows added into the per-unit gradients where they land (a GPU's way,
    ``index_put_`` with accumulation) give what a dense scatter and an add give (a CPU's way) to
    float32 rounding, each unit's rows in its own gradient. The dense product is a view of a
    padded product, as the bf16 GEMMs return it: with dense rows the rows are added through a
    contiguous view of its storage (no copy of it), with padded columns through the view itself."""
    from userdp.clients.matmul_precision import row_view

    gen = torch.Generator().manual_seed(11)
    vocab, width, n = 13, 5, 12
    ids = torch.randint(0, vocab, (n,), generator=gen)
    ids[:4] = 3
    dense = Factor(torch.randn(n, vocab, generator=gen), None, vocab)
    uses = [
        (Factor(None, ids, vocab), torch.randn(n, width, generator=gen)),
        (dense, torch.randn(n, width, generator=gen)),
    ]
    spans = [slice(0, 5), slice(5, 9), slice(9, 12)]
    padded = Padded.of(spans, n, torch.device("cpu"))
    products = []

    def padded_product(a, b):  # as the bf16 GEMMs return it: a view of a padded product
        m, k = a.shape[-2], b.shape[-1]
        product = torch.nn.functional.pad(a @ b, (0, padded_columns, 0, 2))[..., :m, :k]
        products.append(product)
        return product

    monkeypatch.setattr(norms, "mm32", padded_product)

    def per_unit_gradients():
        lefts, rights = norms.padded_factors(uses, padded)
        return norms.padded_unit_gradients(lefts, rights, (vocab, width))

    scattered = per_unit_gradients()
    in_place = []
    monkeypatch.setattr(matmul_precision, "scatters_in_place", lambda total: not in_place.append(1))
    added = per_unit_gradients()
    assert len(in_place) == 1 and added is products[-1]  # added into the GEMM's own output
    view = row_view(added)
    if padded_columns:
        assert view is None
    else:
        flat, per_unit = view
        assert flat.is_contiguous() and per_unit == vocab + 2
        assert flat.data_ptr() == added.data_ptr()
    torch.testing.assert_close(added, scattered, rtol=1e-6, atol=1e-6)
    for j, span in enumerate(spans):  # float64 reference, unit by unit
        want = dense.dense[span].double().T @ uses[1][1][span].double()
        want.index_add_(0, ids[span], uses[0][1][span].double())
        torch.testing.assert_close(added[j].double(), want, rtol=1e-5, atol=1e-6)
