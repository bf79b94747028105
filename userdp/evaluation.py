"""Held-out evaluation: mean next-token loss on users that are never trained on (user-level split).

The evaluation set is fixed at the start of a run (the first ``max_examples`` examples of the
held-out users, round-robin over users so every held-out user counts), and the loss is the mean
over all predicted tokens. Held-out users' losses are published unprivatized: they are not
covered by the run's DP guarantee (the report says so), which protects the TRAINING users.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch


def eval_examples(
    store: object, users: list[str], seq_len: int, max_examples: int = 256
) -> list[np.ndarray]:
    """Round-robin over ``users``: their examples (truncated to ``seq_len``, ≥ 2 tokens)."""
    per_user = [
        [e[:seq_len] for e in store.user_examples(u) if len(e) >= 2]  # type: ignore[attr-defined]
        for u in users
    ]
    chosen: list[np.ndarray] = []
    depth = 0
    while len(chosen) < max_examples and any(depth < len(x) for x in per_user):
        for examples in per_user:
            if depth < len(examples) and len(chosen) < max_examples:
                chosen.append(np.asarray(examples[depth], dtype=np.int64))
        depth += 1
    return chosen


class Evaluator:
    """Mean token loss of a causal LM on a fixed list of examples, in padded batches."""

    def __init__(
        self,
        model: torch.nn.Module,
        examples: list[np.ndarray],
        pad_id: int = 0,
        batch_tokens: int = 8192,
    ) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.examples = sorted(examples, key=len)
        self.pad_id = pad_id
        self.batch_tokens = batch_tokens

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, value in tensors.items():
                target = self.params[name]
                target.copy_(value.to(dtype=target.dtype, device=target.device))

    @torch.no_grad()
    def loss(self) -> float:
        """Mean cross-entropy per predicted token (nan without examples)."""
        total, tokens = 0.0, 0
        batch: list[np.ndarray] = []
        for example in self.examples + [None]:  # type: ignore[list-item]
            if example is not None and (len(batch) + 1) * len(example) <= self.batch_tokens:
                batch.append(example)
                continue
            if batch:
                batch_total, batch_tokens = self._batch_loss(batch)
                total, tokens = total + batch_total, tokens + batch_tokens
            batch = [example] if example is not None else []
        return total / tokens if tokens else float("nan")

    def _batch_loss(self, batch: list[np.ndarray]) -> tuple[float, int]:
        length = max(len(e) for e in batch)
        ids = torch.full((len(batch), length), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), length), dtype=torch.long)
        for row, example in enumerate(batch):
            ids[row, : len(example)] = torch.as_tensor(example)
            mask[row, : len(example)] = 1
        logits = self.model(input_ids=ids, attention_mask=mask).logits.float()
        targets = ids[:, 1:].clone()
        targets[mask[:, 1:] == 0] = -100
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
        )
        return float(loss), int((targets != -100).sum())
