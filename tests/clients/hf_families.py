"""Tiny causal LMs of the families userdp supports, built from their ``transformers`` configs
(no download): the shapes differ, the layer types are the families' own (RMSNorm, Gemma's scaled
embedding, OPT's learned positions, Phi's partial rotary and head bias, NeoX's fused QKV)."""

from __future__ import annotations

import torch

VOCAB = 259


def family_config(family: str):
    import transformers as tf

    common = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}
    common.update(num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
    sized = {"hidden_size": 32, "intermediate_size": 64, **common}
    no_dropout = {"attention_dropout": 0.0}
    if family == "llama":
        return tf.LlamaConfig(num_key_value_heads=2, tie_word_embeddings=False, **sized)
    if family == "mistral":
        return tf.MistralConfig(
            num_key_value_heads=2, sliding_window=16, tie_word_embeddings=False, **sized
        )
    if family == "qwen2":
        return tf.Qwen2Config(num_key_value_heads=2, tie_word_embeddings=True, **sized)
    if family == "gemma":
        return tf.GemmaConfig(num_key_value_heads=1, head_dim=8, **sized)
    if family == "phi":
        return tf.PhiConfig(
            partial_rotary_factor=0.5, resid_pdrop=0.0, embd_pdrop=0.0, **no_dropout, **sized
        )
    if family == "gpt_neox":
        return tf.GPTNeoXConfig(rotary_pct=0.5, hidden_dropout=0.0, **no_dropout, **sized)
    if family == "opt":
        return tf.OPTConfig(
            hidden_size=32, ffn_dim=64, word_embed_proj_dim=32, dropout=0.0, **no_dropout, **common
        )
    raise ValueError(family)


FAMILIES = ("llama", "mistral", "qwen2", "gemma", "phi", "gpt_neox", "opt")


def family_model(family: str, seed: int = 0, dtype=torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family)).to(dtype)
    with torch.no_grad():  # nonzero norm weights (Gemma's are stored as w with y = x̂(1 + w))
        for name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in name.lower():
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()
