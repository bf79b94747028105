"""The tensor-core norm margin, on CPU: the vectorized engine's clipping stays within C when its
norm GEMMs under-estimate as tensor cores do.

With ``workers.tensor_core_matmul`` the engine's norm GEMMs run on bf16 tensor cores, whose float32
accumulation is not IEEE: on an H100 it under-estimated a 50257-term sum of squares by 2.3e-4
relative (``tests/clients/test_engine_gpu.py`` measures it). A norm that is low by r makes the
clip factor C/n̂ high by r, so a clipped unit contributes C·(1 + r): more than the sensitivity
the noise is calibrated to. The engine therefore inflates every norm by
``TENSOR_CORE_NORM_MARGIN`` in that mode (:mod:`userdp.clients.matmul_precision`).

The GPU test of that margin is skipped without CUDA, so this check runs the engine's own code
path on CPU under an emulation of the accumulation error: tensor-core mode is switched on for the
CPU device, and every squared norm the engine takes from a GEMM (the exact batched norms and the
retained per-unit gradients' norms) comes out low by the measured error, (1 − 2.3e-4)², the
direction that loosens clipping. Each unit of a real tiny GPT-2 is then clipped alone with C below
every unit's norm, and:

- the norm the engine clipped by is not below the unit's true norm (float64 autograd oracle);
- the unit's contribution has norm at most C.

Tolerance: without emulation the engine's norms and contributions agree with the float64 oracle
and with C to ~1e-7 relative (float32 products, float64 sums of squares); 1e-5 leaves two orders
of magnitude for that rounding and is still 20× below the emulated error the margin must cover.
"""

from __future__ import annotations

from unittest import mock

from userdp.clients import ghost, matmul_precision
from userdp.clients.engine import ClippingEngine
from userdp.clients.unit_gradients import UnitGradients

from .checks_clipping import _clip_norm_below, _model, _norm, _unit_gradient, _units

MEASURED_UNDERESTIMATE = 2.3e-4
"""Relative under-estimate of a norm by tensor-core accumulation (H100, 50257 terms)."""
REL_TOL = 1e-5


def _emulated_tensor_core_norms():
    """Patches that run the engine's tensor-core branch on CPU with norms low by the measured
    accumulation error (see the module docstring)."""
    low = (1.0 - MEASURED_UNDERESTIMATE) ** 2
    exact = ghost.batched_exact_squared_norms
    retained = UnitGradients.squared_norms

    def exact_low(*args, **kwargs):
        return exact(*args, **kwargs) * low

    def retained_low(self):
        return retained(self) * low

    return (
        mock.patch.object(
            ghost, "tensor_cores_active", lambda device: matmul_precision._TENSOR_CORES.get()
        ),
        mock.patch.object(ghost, "batched_exact_squared_norms", exact_low),
        mock.patch.object(UnitGradients, "squared_norms", retained_low),
    )


def check_tensor_core_margin_covers_accumulation_error() -> None:
    units = _units()
    true_norms = [_norm(_unit_gradient(u)) for u in units]
    clip = _clip_norm_below(true_norms)
    engine = ClippingEngine(_model(), engine="vectorized", pad_id=0, tensor_core_matmul=True)
    tc_mode, exact_low, retained_low = _emulated_tensor_core_norms()
    with tc_mode, exact_low, retained_low:
        results = [engine.clipped_sum([unit], clip) for unit in units]
    for unit, true_norm, got in zip(units, true_norms, results, strict=True):
        used = got.stats.norm_sum
        released = _norm(got.sums)
        assert used >= true_norm * (1 - REL_TOL) and released <= clip * (1 + REL_TOL), (
            f"tensor-core mode (emulated on CPU, norms low by {MEASURED_UNDERESTIMATE:g}): unit "
            f"{unit.unit_id} was clipped by norm {used:.8g} < its true norm {true_norm:.8g} and "
            f"contributes {released:.8g} vs C = {clip:.8g} (ratio {released / clip:.6f}): the "
            "tensor-core norm margin does not cover the accumulation error"
        )
