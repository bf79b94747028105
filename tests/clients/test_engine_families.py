"""Per-unit clipping on every supported architecture: the vectorized engine's clipped sum equals
the loop engine's and a float64 per-unit reference (each example run alone, no padding), to
1e-5 relative, for Llama-, Mistral-, Qwen2-, Gemma-, Phi-, GPT-NeoX- and OPT-style models (full
fine-tuning, and LoRA with the architecture's default targets). RMSNorm layers take their fast
path (never the per-unit re-run), and an untied head is an ordinary Linear use."""

from __future__ import annotations

import pytest
import torch
from userdp.clients.capture import GENERIC, LINEAR, RMSNORM, _kind
from userdp.clients.engine import ClippingEngine
from userdp.clients.model import _with_lora, lora_targets

from tests.clients.engine_fixtures import assert_sums_close, random_units
from tests.clients.hf_families import FAMILIES, family_model
from userdp.config import ModelConfig

CLIP = 0.5
RTOL = 1e-5  # float32 engines vs each other and vs float64: ~1e-7 relative in these sizes


def float64_reference(model: torch.nn.Module, units, clip_norm: float) -> dict[str, torch.Tensor]:
    """Σ_u clip(∇ loss_u, C) in float64, loss_u = mean over u's examples of the example's mean
    next-token cross-entropy, every example run alone (no padding, no batching)."""
    model = model.double()
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    for unit in units:
        losses = []
        for example in unit.examples:
            ids = torch.as_tensor(example, dtype=torch.long)[None]
            logits = model(input_ids=ids[:, :-1], use_cache=False).logits
            losses.append(torch.nn.functional.cross_entropy(logits[0], ids[0, 1:]))
        grads = torch.autograd.grad(torch.stack(losses).mean(), list(params.values()))
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        factor = min(1.0, clip_norm / float(norm))
        for (name, _), g in zip(params.items(), grads, strict=True):
            total[name] += factor * g
    model.float()
    return {name: t.float() for name, t in total.items()}


def _check(model: torch.nn.Module, units) -> None:
    loop = ClippingEngine(model, engine="loop").clipped_sum(units, CLIP)
    vectorized = ClippingEngine(model, engine="vectorized").clipped_sum(units, CLIP)
    assert loop.stats.count == vectorized.stats.count == len(units)
    assert loop.stats.clipped == vectorized.stats.clipped
    assert_sums_close(vectorized.sums, loop.sums, rtol=RTOL, atol=0.0)
    reference = float64_reference(model, units, CLIP)
    assert_sums_close(loop.sums, reference, rtol=RTOL, atol=0.0)
    assert_sums_close(vectorized.sums, reference, rtol=RTOL, atol=0.0)


@pytest.mark.parametrize("family", FAMILIES)
def test_full_fine_tuning_clips_each_unit_exactly(family: str) -> None:
    torch.manual_seed(0)
    model = family_model(family)
    _check(model, random_units(4, seed=3, max_examples=3, hi=16))


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_with_the_architecture_default_targets(family: str) -> None:
    model = _with_lora(family_model(family), ModelConfig(lora_rank=2))
    with torch.no_grad():  # peft starts B at zero: make every adapter matter
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.1)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    _check(model, random_units(4, seed=5, max_examples=3, hi=16))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "gemma"])
def test_rms_norms_take_the_fast_path(family: str) -> None:
    model = family_model(family)
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert norms and all(_kind(m) == RMSNORM for m in norms)
    owners = [m for m in model.modules() if list(m.parameters(recurse=False))]
    assert all(_kind(m) != GENERIC for m in owners), [type(m).__name__ for m in owners]


def test_an_untied_head_is_a_linear_use() -> None:
    model = family_model("llama")
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert _kind(model.lm_head) == LINEAR


def test_default_lora_targets_follow_the_architecture() -> None:
    config = ModelConfig(lora_rank=2)
    assert lora_targets(family_model("llama"), config) == ["q_proj", "v_proj"]
    assert lora_targets(family_model("gpt_neox"), config) == ["query_key_value"]
    given = ModelConfig(lora_rank=2, lora_target_modules=["o_proj", "down_proj"])
    assert lora_targets(family_model("llama"), given) == ["o_proj", "down_proj"]
    with pytest.raises(ValueError, match="c_attn"):
        lora_targets(
            family_model("llama"), ModelConfig(lora_rank=2, lora_target_modules=["c_attn"])
        )


def test_unknown_architectures_get_every_linear_layer() -> None:
    model = family_model("llama")
    model.config.model_type = "not-in-peft"
    assert lora_targets(model, ModelConfig(lora_rank=2)) == "all-linear"
    wrapped = _with_lora(model, ModelConfig(lora_rank=2))
    adapted = {
        n.split(".lora_A")[0].rsplit(".", 1)[-1]
        for n, _ in wrapped.named_parameters()
        if ".lora_A" in n
    }
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
