"""The model presets a config may name (``model.preset``), without importing torch: a config
check sizes a preset from this table before any model is built."""

from __future__ import annotations

# name -> (family, layers, width, heads); vocabulary and context come from the shards and the
# config. Llama presets have an untied head, grouped-query attention and a SwiGLU MLP.
PRESETS: dict[str, tuple[str, int, int, int]] = {
    "gpt2-tiny": ("gpt2", 2, 64, 4),
    "gpt2-small": ("gpt2", 12, 768, 12),
    "gpt2-medium": ("gpt2", 24, 1024, 16),
    "llama-tiny": ("llama", 2, 64, 4),
    "llama-small": ("llama", 12, 768, 12),
}
