"""The causal LM of a run, built the same way on the coordinator and on every worker.

No hub downloads: a model comes from a named preset (a ``transformers`` GPT-2 config with the
shards' vocabulary) or from a local directory (``model.path``, loaded with
``local_files_only=True``). With ``model.lora_rank > 0`` only LoRA adapters are trainable (peft).

The coordinator owns the trainable tensors and broadcasts them; a worker's initial weights are
replaced by that broadcast, so the init seed only matters for reproducible research runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# name -> (layers, width, heads); vocabulary and context come from the shards and the config.
PRESETS: dict[str, tuple[int, int, int]] = {
    "gpt2-tiny": (2, 64, 4),
    "gpt2-small": (12, 768, 12),
    "gpt2-medium": (24, 1024, 16),
}
# GPT-2's linear-like modules: LoRA adapters go on these.
GPT2_LORA_TARGETS = ("c_attn", "c_proj", "c_fc")


class ModelBuildError(ValueError):
    """The model section cannot be built (missing local path, peft not installed...)."""


@dataclass(frozen=True)
class ModelShape:
    """What the model needs from the data: vocabulary size, pad/eos ids and the context length."""

    vocab_size: int
    seq_len: int
    pad_id: int | None = None
    eos_id: int | None = None


def model_shape(manifest: Any, seq_len: int) -> ModelShape:
    """The :class:`ModelShape` of a shard manifest's tokenizer."""
    info = manifest.tokenizer
    return ModelShape(info.vocab_size, seq_len, info.pad_id, info.eos_id)


def torch_dtype(name: str) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def build_model(model_config: Any, shape: ModelShape, seed: int | None = 0) -> torch.nn.Module:
    """A fresh causal LM for ``model_config`` (the config's ``[model]`` section)."""
    import transformers

    if seed is not None:
        torch.manual_seed(seed)
    dtype = torch_dtype(model_config.dtype)
    if model_config.path:
        path = Path(model_config.path)
        if not (path / "config.json").is_file():
            raise ModelBuildError(f"model.path = {str(path)!r} has no config.json")
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=dtype
        )
        if model.config.vocab_size < shape.vocab_size:
            raise ModelBuildError(
                f"model at {path} has vocab_size {model.config.vocab_size} but the shards' "
                f"tokenizer has {shape.vocab_size} ids: re-shard with the model's tokenizer"
            )
    else:
        layers, width, heads = PRESETS[model_config.preset]
        config = transformers.GPT2Config(
            vocab_size=shape.vocab_size,
            n_positions=max(shape.seq_len, 8),
            n_embd=width,
            n_layer=layers,
            n_head=heads,
            bos_token_id=shape.eos_id,
            eos_token_id=shape.eos_id,
            pad_token_id=shape.pad_id,
            # Dropout off: a user's gradient must be a function of the model and the user's data
            # only, so that every clipping engine computes the same quantity.
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        model = transformers.GPT2LMHeadModel(config).to(dtype)
    if model_config.lora_rank > 0:
        model = _with_lora(model, model_config.lora_rank)
    model.eval()  # no dropout; train/eval mode does not change gradients otherwise
    return model


def _with_lora(model: torch.nn.Module, rank: int) -> torch.nn.Module:
    try:
        import peft
    except ImportError:
        raise ModelBuildError(
            "model.lora_rank > 0 needs peft: install userdp with the [peft] extra"
        ) from None
    targets = [t for t in GPT2_LORA_TARGETS if any(n.endswith(t) for n, _ in model.named_modules())]
    if not targets:
        raise ModelBuildError(
            f"LoRA: none of {GPT2_LORA_TARGETS} found in {type(model).__name__}; "
            "this model needs its own target modules"
        )
    lora = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=targets, fan_in_fan_out=True
    )
    return peft.get_peft_model(model, lora)


def load_parameters(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into ``model``'s parameters of the same names (dtype and device of the
    parameter). A name the model does not have is an error, never silently skipped."""
    params = dict(model.named_parameters())
    unknown = sorted(set(tensors) - set(params))
    if unknown:
        raise KeyError(f"the model has no parameters named {unknown[:3]}")
    with torch.no_grad():
        for name, value in tensors.items():
            params[name].copy_(value.to(dtype=params[name].dtype, device=params[name].device))


def split_parameters(
    model: torch.nn.Module,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(trainable, frozen) tensors by parameter name, detached copies on the CPU.

    Tied parameters (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``) appear once, under
    the first name ``named_parameters`` gives them."""
    trainable, frozen = {}, {}
    for name, param in model.named_parameters():
        target = trainable if param.requires_grad else frozen
        target[name] = param.detach().to("cpu").clone()
    return trainable, frozen
