"""The vectorized engine's choice between retained per-unit gradients and book-keeping by cost on
the device (clients/unit_cost.py), priced on CPU with an H200's datasheet rates at GPT-2 small's
shapes, and the memory cap that bounds it either way."""

from __future__ import annotations

import pytest
import torch
from userdp.clients.norms import Factor, Padded
from userdp.clients.unit_cost import DeviceRates, device_rates, path_costs
from userdp.clients.unit_gradients import retains_unit_gradients

H200 = DeviceRates(bf16_flops=989e12, float32_flops=67e12, memory_bytes=4.8e12)
TOKENS = 16384  # a 16k-token micro-batch


def dense_use(shape, dtype=torch.bfloat16):
    """One Linear use of a [d0, d1] weight over the micro-batch's rows (values never read)."""
    d0, d1 = shape
    left = torch.empty(TOKENS, d0, dtype=dtype)
    return [(Factor(left, None, d0), torch.empty(TOKENS, d1, dtype=dtype))]


def units_of(length):
    spans = [slice(s, s + length) for s in range(0, TOKENS, length)]
    return Padded.of(spans, TOKENS, torch.device("cpu"))


@pytest.mark.parametrize(
    ("length", "shape", "cheaper", "cap_allows"),
    [
        (128, (768, 3072), "book_kept", False),  # ULS G=1 / ELS at seq 128, the MLP's c_fc
        (1024, (768, 2304), "retained", True),  # ULS G=8, c_attn
        (512, (768, 2304), "retained", False),  # G=4, c_attn: cheaper, but over the memory cap
    ],
)
def test_h200_prices_gpt2_small_weights_as_the_issue_shapes_need(
    length, shape, cheaper, cap_allows
):
    """On the tensor cores (bf16 rows, two book-keeping parts) the retained path's three passes
    over U·d0·d1 float32 cost more than ghost norms + book-keeping for 128-token units, less for
    1024-token users; retaining is chosen only where it is cheaper AND within the memory cap."""
    uses, padded = dense_use(shape), units_of(length)
    costs = path_costs(uses, padded, shape, H200, bf16_parts=True)
    assert costs.retained > 0 and costs.book_kept > 0
    assert (costs.retained < costs.book_kept) == (cheaper == "retained")
    allowed = retains_unit_gradients(uses, padded, torch.Size(shape))  # the cap alone (CPU)
    assert allowed == cap_allows


def test_the_device_rates_decide_where_the_memory_cap_allows_both():
    """A float32 G=4 user's c_attn (ghost norms when book-kept): within the memory cap; a device
    with slow memory keeps the book-keeping, one with slow GEMMs retains, and without rates (a
    CPU) the cap decides."""
    shape = (768, 2304)
    uses, padded = dense_use(shape, torch.float32), units_of(512)
    size = torch.Size(shape)
    assert retains_unit_gradients(uses, padded, size)
    slow_memory = DeviceRates(989e12, 67e12, 1e11)
    slow_gemm = DeviceRates(989e12, 1e12, 4.8e12)
    for rates, retains in ((slow_memory, False), (slow_gemm, True), (H200, True)):
        costs = path_costs(uses, padded, shape, rates)
        assert (costs.retained <= costs.book_kept) == retains
        assert retains_unit_gradients(uses, padded, size, rates) == retains


def test_book_keeping_in_two_bf16_parts_costs_one_more_gemm_than_in_float32():
    """Same rates for both kinds of GEMM: the book-kept path's second part adds one product's
    FLOPs and the split's two more bytes per row element; the retained path costs the same."""
    shape = (768, 3072)
    uses, padded = dense_use(shape), units_of(128)
    rates = DeviceRates(1e14, 1e14, 1e12)
    one, two = (path_costs(uses, padded, shape, rates, bf16_parts=p) for p in (False, True))
    gemm = 2.0 * TOKENS * shape[0] * shape[1] / rates.bf16_flops
    split = 2.0 * TOKENS * shape[1] / rates.memory_bytes
    assert two.retained == one.retained
    assert two.book_kept - one.book_kept == pytest.approx(gemm + split, rel=1e-12)


def test_a_cpu_has_no_rates_and_keeps_the_memory_rule():
    assert device_rates(torch.device("cpu")) is None
