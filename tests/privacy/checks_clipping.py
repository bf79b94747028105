"""Per-unit clipping in the worker's engine (``userdp.clients.engine``), on a real tiny GPT-2.

The oracle is independent of the engine: each example's gradient comes from transformers' own
shifted LM loss (``model(input_ids=x, labels=x).loss``) and ``.backward()``; a user's gradient is
the mean over its examples (Algorithm 2 of "Fine-Tuning Large Language Models with User-Level
Differential Privacy"), clipped ONCE to C. With C below every unit's norm, clipping binds for every
unit, so (the missing-clipping and mini-batch-clipping bugs of "Finding Private Bugs: Debugging
Implementations of Differentially Private Stochastic Gradient Descent", §3.1, taken to users):

- missing clipping: a single unit's contribution has norm ‖g_u‖ > C instead of exactly C;
- clipping after summing/averaging (batch-level): the sum of B clipped units has norm C (or B·C
  along the mean) instead of ‖Σ_u C·g_u/‖g_u‖‖, which the constructed units make ≥ 1.5·C and
  ≤ 0.8·B·C;
- ULS clipping per example: a user of m examples whose gradients point in different directions
  contributes Σ_e clip(g_e) (norm up to m·C) or mean_e clip(g_e) (norm < C, another direction)
  instead of C·ḡ/‖ḡ‖.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from userdp.clients.engine import ClippingEngine, Unit
from userdp.clients.model import ModelShape, build_model

from userdp.config import ModelConfig

VOCAB = 259
SEQ_LEN = 24
SHAPE = ModelShape(VOCAB, SEQ_LEN, pad_id=0, eos_id=1)
REL_TOL = 1e-3  # float32 engine vs float64 oracle


@functools.lru_cache(maxsize=1)
def _model() -> torch.nn.Module:
    return build_model(ModelConfig(preset="gpt2-tiny"), SHAPE, seed=0)


def _engine(name: str) -> ClippingEngine:
    return ClippingEngine(_model(), engine=name, pad_id=0)


def _example(seed: int, low: int, high: int, length: int) -> np.ndarray:
    """Token ids drawn from [low, high): examples from disjoint ranges of the vocabulary have
    gradients pointing in different directions (different embedding and output rows)."""
    return np.random.default_rng(seed).integers(low, high, size=length)


def _units() -> list[Unit]:
    """Six users, each with 1–3 examples from its own slice of the vocabulary."""
    units = []
    for u in range(6):
        low = 3 + 40 * u
        examples = [_example(100 * u + e, low, low + 40, 10 + 3 * e) for e in range(1 + u % 3)]
        units.append(Unit(f"user-{u}", examples))
    return units


_ORACLE: dict[bytes, dict[str, torch.Tensor]] = {}


def _example_gradient(example: np.ndarray) -> dict[str, torch.Tensor]:
    """The oracle's gradient of one example (cached: the model's weights never change here)."""
    key = np.asarray(example, dtype=np.int64).tobytes()
    if key not in _ORACLE:
        _ORACLE[key] = _fresh_example_gradient(example)
    return _ORACLE[key]


def _fresh_example_gradient(example: np.ndarray) -> dict[str, torch.Tensor]:
    model = _model()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    ids = torch.as_tensor(example, dtype=torch.long)[None]
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {n: p.grad.detach().double().clone() for n, p in params.items()}
    model.zero_grad(set_to_none=True)
    return grads


def _unit_gradient(unit: Unit) -> dict[str, torch.Tensor]:
    """ULS: the mean of the unit's example gradients (unclipped)."""
    parts = [_example_gradient(e) for e in unit.examples]
    return {n: sum(p[n] for p in parts) / len(parts) for n in parts[0]}


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors.values()))


def _scaled(tensors, factor: float) -> dict[str, torch.Tensor]:
    return {n: t.double() * factor for n, t in tensors.items()}


def _add(a, b):
    return {n: a[n].double() + b[n].double() for n in a}


def _distance(a, b) -> float:
    return _norm({n: a[n].double() - b[n].double() for n in a})


def _clip_norm_below(norms: list[float]) -> float:
    return 0.5 * min(norms)


def check_engine_bounds_each_unit_by_clip_norm(engine: str = "loop") -> None:
    """Missing clipping: every unit's contribution alone has norm exactly C when ‖g_u‖ > C, and
    a task's sum is bounded by count·C."""
    units = _units()
    norms = [_norm(_unit_gradient(u)) for u in units]
    clip = _clip_norm_below(norms)
    eng = _engine(engine)
    for unit, norm in list(zip(units, norms, strict=True))[:3]:  # 1, 2 and 3 examples
        got = eng.clipped_sum([unit], clip)
        released = _norm(got.sums)
        assert released <= clip * (1 + REL_TOL), (
            f"engine {engine!r}: unit {unit.unit_id} (‖g‖ = {norm:.4g}) contributes norm "
            f"{released:.4g} > C = {clip:.4g}: missing clipping"
        )
        assert abs(released - clip) <= REL_TOL * clip, (
            f"engine {engine!r}: unit {unit.unit_id} (‖g‖ = {norm:.4g} > C) contributes norm "
            f"{released:.4g}, not C = {clip:.4g}: clipping is not to C"
        )
        assert got.stats.clipped == 1 and got.stats.count == 1, (
            f"engine {engine!r}: unit {unit.unit_id} reported clipped={got.stats.clipped}, "
            f"count={got.stats.count}"
        )
    total = eng.clipped_sum(units, clip)
    assert _norm(total.sums) <= len(units) * clip * (1 + REL_TOL), (
        f"engine {engine!r}: the sum of {len(units)} units has norm {_norm(total.sums):.4g} > "
        f"count·C = {len(units) * clip:.4g}: missing clipping"
    )


def check_engine_clips_each_unit_before_summing(engine: str = "loop") -> None:
    """Clipping after summing/averaging (batch-level): the task's sum equals Σ_u C·g_u/‖g_u‖ of
    the independent per-unit gradients."""
    units = _units()
    grads = [_unit_gradient(u) for u in units]
    norms = [_norm(g) for g in grads]
    clip = _clip_norm_below(norms)
    expected = _scaled(grads[0], clip / norms[0])
    for grad, norm in zip(grads[1:], norms[1:], strict=True):
        expected = _add(expected, _scaled(grad, clip / norm))
    size = _norm(expected)
    assert 1.5 * clip <= size <= 0.8 * len(units) * clip, (
        f"precondition: ‖Σ clip(g_u)‖ = {size:.4g} must be far from C and B·C ({clip:.4g})"
    )
    got = _engine(engine).clipped_sum(units, clip)
    error = _distance(got.sums, expected)
    assert error <= REL_TOL * size, (
        f"engine {engine!r}: the sum of {len(units)} clipped units has norm "
        f"{_norm(got.sums):.4g} and differs from Σ_u clip(g_u, C) (norm {size:.4g}, C = "
        f"{clip:.4g}) by {error:.3g}: units were not clipped one by one before summing "
        "(clipping after summing/averaging)"
    )


def check_engine_clips_user_mean_not_examples(engine: str = "loop") -> None:
    """ULS: a user's contribution is clip(mean_e g_e, C), clipped once, not Σ_e or mean_e of
    per-example clipped gradients."""
    user = Unit(
        "user-many",
        [_example(7000 + e, 3 + 60 * e, 63 + 60 * e, 12) for e in range(4)],
    )
    per_example = [_example_gradient(e) for e in user.examples]
    mean = {n: sum(g[n] for g in per_example) / len(per_example) for n in per_example[0]}
    example_norms = [_norm(g) for g in per_example]
    clip = 0.5 * min([_norm(mean), *example_norms])
    expected = _scaled(mean, clip / _norm(mean))
    # the per-example variants must be far from the right answer for the check to mean anything
    clipped_examples = [
        _scaled(g, clip / n) for g, n in zip(per_example, example_norms, strict=True)
    ]
    summed = clipped_examples[0]
    for g in clipped_examples[1:]:
        summed = _add(summed, g)
    averaged = _scaled(summed, 1 / len(per_example))
    for name, variant in (("Σ_e clip(g_e)", summed), ("mean_e clip(g_e)", averaged)):
        assert _distance(variant, expected) >= 0.2 * clip, f"precondition: {name} ≈ clip(mean)"
    got = _engine(engine).clipped_sum([user], clip)
    error = _distance(got.sums, expected)
    assert error <= REL_TOL * clip, (
        f"engine {engine!r}: a user of {len(per_example)} examples contributes norm "
        f"{_norm(got.sums):.4g} at distance {error:.3g} from clip(mean_e g_e, C) (norm "
        f"{clip:.4g}); Σ_e clip(g_e) would have norm {_norm(summed):.4g}: the user was "
        "clipped per example instead of once per user"
    )
    assert got.stats.count == 1, f"engine {engine!r}: one user counted as {got.stats.count} units"


CLIP_SLACK = 3e-4
"""Where C sits around a unit's true norm in the check below: C = ‖g_u‖/(1 + CLIP_SLACK), so
clipping binds by a hair, and C = ‖g_u‖·(1 + CLIP_SLACK), so it does not."""
HAIR_TOL = 1e-5
"""The engine clips by its own float32 gradient's norm: the unit's contribution is
(C/‖ĝ‖)·ĝ, of norm C up to the rounding of that norm and of the scaled float32 entries (a few
2⁻²⁴ relative, ~10⁻⁶ with the float64 norm taken here), however ĝ differs from the float64
oracle g (~10⁻⁶ relative on this model, far below CLIP_SLACK, so the engine sees ‖ĝ‖ > C too).
10⁻⁵ leaves an order of magnitude for that rounding and is 30 times below CLIP_SLACK: a clip
factor that lets norms up to (1 + 10⁻³)·C through unclipped releases (1 + 3·10⁻⁴)·C."""


def check_engine_clips_at_the_clip_norm_exactly(engine: str = "loop") -> None:
    """Slack in the clip itself: with C a hair (3·10⁻⁴) below a unit's true norm (float64
    oracle), the unit's contribution has norm C to 10⁻⁵ (justified at :data:`HAIR_TOL`), never
    its unclipped norm; with C a hair above, the unit is released unscaled (its norm is the
    oracle's to 10⁻⁵). The sensitivity the accountant assumes is C, not C plus a tolerance."""
    units = _units()[:3]  # 1, 2 and 3 examples
    eng = _engine(engine)
    for unit in units:
        norm = _norm(_unit_gradient(unit))
        clip = norm / (1 + CLIP_SLACK)
        got = eng.clipped_sum([unit], clip)
        released = _norm(got.sums)
        assert released <= clip * (1 + HAIR_TOL), (
            f"engine {engine!r}: unit {unit.unit_id} of norm {norm:.8g} = C·(1 + {CLIP_SLACK:g}) "
            f"contributes {released:.8g} = C·(1 + {released / clip - 1:.2e}) > C = {clip:.8g}: "
            "slack in the clip (norms slightly above C pass unclipped; the sensitivity is no "
            "longer C)"
        )
        assert got.stats.clipped == 1, (
            f"engine {engine!r}: unit {unit.unit_id} of norm C·(1 + {CLIP_SLACK:g}) reported "
            f"clipped = {got.stats.clipped}: slack in the clip"
        )
        loose = eng.clipped_sum([unit], norm * (1 + CLIP_SLACK))
        assert abs(_norm(loose.sums) - norm) <= HAIR_TOL * norm and loose.stats.clipped == 0, (
            f"engine {engine!r}: unit {unit.unit_id} of norm {norm:.8g} below C = "
            f"{norm * (1 + CLIP_SLACK):.8g} contributes norm {_norm(loose.sums):.8g} "
            f"(clipped = {loose.stats.clipped}): a unit within C must be released unscaled"
        )
