"""Shared builders for the engine tests: a tiny GPT-2 (byte vocabulary, 259 ids) on the CPU."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import torch
from userdp.clients.engine import ClippingEngine, Unit
from userdp.clients.model import ModelShape, build_model
from userdp.clients.shard_format import TokenizerInfo

from userdp.config import ModelConfig

VOCAB = 259
SEQ_LEN = 24


def tiny_model(lora_rank: int = 0, seed: int = 0, dtype: str = "fp32") -> torch.nn.Module:
    config = ModelConfig(preset="gpt2-tiny", dtype=dtype, lora_rank=lora_rank)
    return build_model(config, ModelShape(VOCAB, SEQ_LEN, pad_id=0, eos_id=1), seed)


def tiny_engine(engine: str = "loop", **kwargs) -> ClippingEngine:
    lora_rank = kwargs.pop("lora_rank", 0)
    return ClippingEngine(tiny_model(lora_rank), engine=engine, **kwargs)


def byte_manifest() -> SimpleNamespace:
    info = TokenizerInfo("byte", "byte", "0" * 64, VOCAB, eos_id=1, pad_id=0, path=None)
    return SimpleNamespace(tokenizer=info)


def random_units(n: int, seed: int = 0, max_examples: int = 4, lo: int = 3, hi: int = SEQ_LEN):
    rng = np.random.default_rng(seed)
    units = []
    for i in range(n):
        examples = [
            rng.integers(3, VOCAB, size=int(rng.integers(lo, hi + 1)))
            for _ in range(int(rng.integers(1, max_examples + 1)))
        ]
        units.append(Unit(f"u{i}", examples))
    return units


def total_norm(sums: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in sums.values()))


def assert_sums_close(a, b, rtol: float = 1e-4, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    scale = max(total_norm(a), total_norm(b), 1e-12)
    for name in a:
        diff = float((a[name].double() - b[name].double()).norm())
        assert diff <= rtol * scale + atol, f"{name}: |diff| {diff:.3g} vs scale {scale:.3g}"
