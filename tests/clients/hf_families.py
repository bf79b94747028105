"""Tiny causal LMs of the families userdp supports, built from their ``transformers`` configs
(no download): the shapes differ, the layer types are the families' own (RMSNorm, Gemma's scaled
embedding, OPT's learned positions, Phi's partial rotary and head bias, NeoX's fused QKV)."""

from __future__ import annotations

import torch

VOCAB = 259


def family_config(family: str):
    import transformers as tf

    common = {"vocab_size": VOCAB, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}
    if family == "llama":
        return tf.LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            **common,
        )
    if family == "mistral":
        return tf.MistralConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            sliding_window=16,
            tie_word_embeddings=False,
            **common,
        )
    if family == "qwen2":
        return tf.Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
            **common,
        )
    if family == "gemma":
        return tf.GemmaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=8,
            max_position_embeddings=64,
            **common,
        )
    if family == "phi":
        return tf.PhiConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            partial_rotary_factor=0.5,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attention_dropout=0.0,
            **common,
        )
    if family == "gpt_neox":
        return tf.GPTNeoXConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            rotary_pct=0.5,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            **common,
        )
    if family == "opt":
        return tf.OPTConfig(
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            max_position_embeddings=64,
            word_embed_proj_dim=32,
            dropout=0.0,
            attention_dropout=0.0,
            **common,
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
