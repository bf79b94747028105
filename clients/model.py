"""The causal LM of a run, built the same way on the coordinator and on every worker.

No hub downloads: a model comes from a named preset (a ``transformers`` GPT-2 or Llama config
with the shards' vocabulary) or from any local folder ``AutoModelForCausalLM`` loads
(``model.path``, ``local_files_only=True``). With ``model.lora_rank > 0`` only LoRA adapters are
trainable (peft); their default targets come from the architecture (:func:`lora_targets`).

The coordinator owns the trainable tensors and broadcasts them; a worker's initial weights are
replaced by that broadcast, so the init seed only matters for reproducible research runs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from userdp.clients.presets import PRESETS
from userdp.clients.zero3 import is_partitioned, load_partitioned

# Where userdp's default differs from PEFT's: GPT-2 keeps adapters on attention AND MLP (PEFT's
# mapping has c_attn only), as userdp has always trained it.
USERDP_LORA_TARGETS: dict[str, list[str]] = {"gpt2": ["c_attn", "c_proj", "c_fc"]}


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
        model = _preset_model(model_config.preset, shape, dtype)
    if model_config.lora_rank > 0:
        model = _with_lora(model, model_config)
    model.eval()  # no dropout; train/eval mode does not change gradients otherwise
    return model


def _preset_model(name: str, shape: ModelShape, dtype: torch.dtype) -> torch.nn.Module:
    """A freshly initialized preset with the shards' vocabulary. Dropout is off: a user's
    gradient must be a function of the model and the user's data only, so that every clipping
    engine computes the same quantity. Under a ZeRO-3 build (:mod:`userdp.clients.distributed`,
    ``partitioned_build``) it is built partitioned, through transformers' ``from_config``."""
    import transformers
    from transformers.integrations import is_deepspeed_zero3_enabled

    config = preset_config(*PRESETS[name], shape)
    cls = (
        transformers.LlamaForCausalLM
        if config.model_type == "llama"
        else transformers.GPT2LMHeadModel
    )
    if is_deepspeed_zero3_enabled():
        return cls._from_config(config, dtype=dtype)
    return cls(config).to(dtype)


def preset_config(family: str, layers: int, width: int, heads: int, shape: ModelShape) -> Any:
    """The transformers config of a preset shape (:data:`userdp.clients.presets.PRESETS`'s
    columns): Llama with an untied head, grouped-query attention and a SwiGLU MLP, or GPT-2; no
    dropout."""
    import transformers

    ids = {"bos_token_id": shape.eos_id, "eos_token_id": shape.eos_id, "pad_token_id": shape.pad_id}
    if family == "llama":
        return transformers.LlamaConfig(
            vocab_size=shape.vocab_size,
            max_position_embeddings=max(shape.seq_len, 8),
            hidden_size=width,
            intermediate_size=(8 * width // 3 + 63) // 64 * 64,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=max(1, heads // 2),
            tie_word_embeddings=False,
            attention_dropout=0.0,
            **ids,
        )
    return transformers.GPT2Config(
        vocab_size=shape.vocab_size,
        n_positions=max(shape.seq_len, 8),
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        **ids,
    )


def lora_targets(model: torch.nn.Module, model_config: Any) -> list[str] | str:
    """``model.lora_target_modules`` when given (each must name a module of the model), else
    PEFT's own targets for the model type (GPT-2: :data:`USERDP_LORA_TARGETS`), else PEFT's
    "all-linear" (every Linear layer of attention and MLP, not the output head)."""
    names = [name for name, _ in model.named_modules()]
    given = model_config.lora_target_modules
    if given:
        missing = [t for t in given if not any(n == t or n.endswith("." + t) for n in names)]
        if missing:
            leaves = sorted({n.rsplit(".", 1)[-1] for n in names if n})
            raise ModelBuildError(
                f"model.lora_target_modules: {missing} name no module of "
                f"{type(model).__name__}; its module names include {leaves[:24]}"
            )
        return list(given)
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    default = USERDP_LORA_TARGETS.get(model_type)
    default = default or TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(model_type)
    if isinstance(default, str):  # PEFT gives some types as a regex over module names
        return default if any(re.fullmatch(default, n) for n in names) else "all-linear"
    if default and all(any(n.endswith("." + t) for n in names) for t in default):
        return list(default)
    return "all-linear"


def _with_lora(model: torch.nn.Module, model_config: Any) -> torch.nn.Module:
    try:
        import peft
    except ImportError:
        raise ModelBuildError(
            "model.lora_rank > 0 needs peft: install userdp with the [peft] extra"
        ) from None
    from transformers.pytorch_utils import Conv1D

    rank = model_config.lora_rank
    alpha = model_config.lora_alpha if model_config.lora_alpha is not None else 2 * rank
    lora = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=0.0,
        target_modules=lora_targets(model, model_config),
        # GPT-2's Conv1D stores its weight transposed
        fan_in_fan_out=any(isinstance(m, Conv1D) for m in model.modules()),
    )
    return peft.get_peft_model(model, lora)


def load_parameters(model: torch.nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` into ``model``'s parameters of the same names (dtype and device of the
    parameter). A name the model does not have is an error, never silently skipped. A ZeRO-3
    parameter takes only this rank's partition of its tensor
    (:func:`userdp.clients.zero3.load_partitioned`)."""
    params = dict(model.named_parameters())
    unknown = sorted(set(tensors) - set(params))
    if unknown:
        raise KeyError(f"the model has no parameters named {unknown[:3]}")
    with torch.no_grad():
        for name, value in tensors.items():
            param = params[name]
            if is_partitioned(param):
                load_partitioned(param, value)
            else:
                param.copy_(value.to(dtype=param.dtype, device=param.device))


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
