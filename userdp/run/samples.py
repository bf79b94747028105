"""Generation samples after the last evaluation: ``RUN/samples.jsonl`` and the report's appendix.

Prompts are ``output.sample_prompts`` (text, encoded with the shards' tokenizer) or, by default,
the first tokens of the first example of ``output.sample_count`` held-out users. Held-out users
are never trained on, so ε does not cover them, and their text appears verbatim in
``samples.jsonl``: keep that file inside the trust boundary (the report's appendix shows only the
continuations of configured prompts). Continuations are greedy (deterministic) and at most
``output.sample_max_new_tokens`` long.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from userdp.accounting.durable import atomic_write_text
from userdp.config import Config

PROMPT_TOKENS = 16
"""Tokens of a held-out user's first example used as its prompt."""


def sample_prompts(
    config: Config, tokenizer: Any, store: Any, eval_users: Sequence[str]
) -> list[tuple[str, np.ndarray]]:
    """(source, prompt ids) of the configured prompts or of held-out users' first tokens."""
    if config.output.sample_prompts is not None:
        encoded = tokenizer.encode_arrow(pa.array(list(config.output.sample_prompts)))
        return [
            ("output.sample_prompts", np.asarray(ids.values, dtype=np.int64))
            for ids in encoded
            if len(ids.values)
        ]
    prompts = []
    for user in eval_users:
        if len(prompts) >= config.output.sample_count:
            break
        examples = [e for e in store.user_examples(user) if len(e) >= 2]
        if examples:
            prompts.append((f"held-out user {user}", np.asarray(examples[0][:PROMPT_TOKENS])))
    return prompts


@torch.no_grad()
def generate_samples(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[tuple[str, np.ndarray]],
    max_new_tokens: int,
    pad_id: int,
) -> list[dict[str, Any]]:
    """Greedy continuations of each prompt (one at a time: no padding to get wrong), within the
    model's context: a prompt is cut to leave room for at least one new token."""
    config = getattr(model, "config", None)
    context = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", 0)
    rows = []
    for source, full in prompts:
        ids = full[: context - 1] if context else full
        new_tokens = min(max_new_tokens, context - len(ids)) if context else max_new_tokens
        inputs = torch.as_tensor(ids, dtype=torch.long)[None]
        output = model.generate(
            input_ids=inputs,
            attention_mask=torch.ones_like(inputs),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=pad_id,
        )
        new = output[0, inputs.shape[1] :].tolist()
        rows.append(
            {
                "source": source,
                "prompt": tokenizer.decode(ids.tolist()),
                "continuation": tokenizer.decode(new),
                "prompt_ids": ids.tolist(),
                "continuation_ids": new,
                "decoding": "greedy",
            }
        )
    return rows


def write_samples(rows: Sequence[dict[str, Any]], run_dir: Path) -> Path:
    path = Path(run_dir) / "samples.jsonl"
    atomic_write_text(path, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows))
    return path
