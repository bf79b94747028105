"""Held-out evaluation: mean next-token loss on users that are never trained on (user-level split).

The evaluation set is fixed at the start of a run (the first ``max_examples`` examples of the
held-out users, round-robin over users so every held-out user counts), and the loss is the mean
over all predicted tokens. Held-out users' losses are published unprivatized: they are not
covered by the run's DP guarantee (the report says so), which protects the TRAINING users.
"""

from __future__ import annotations

import numpy as np
import torch

from userdp.clients.batching import Unit, make_batch, pack_units, prepare_units, token_losses


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


def token_frequency_loss(examples: list[np.ndarray]) -> float:
    """The held-out loss of a model that knows only the held-out examples' own token frequencies:
    the entropy (nats) of their predicted tokens' empirical distribution (each example's tokens
    after its first, as :class:`Evaluator` scores them). It is the best loss of any model that
    ignores context on these very examples, and uses no training user's data, so a run whose
    held-out loss is not below it has not learned beyond token frequencies. NaN without
    predicted tokens."""
    targets = [e[1:] for e in examples if len(e) >= 2]
    if not targets:
        return float("nan")
    _, counts = np.unique(np.concatenate(targets), return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log(p)).sum())


class Evaluator:
    """Mean token loss of a causal LM on a fixed list of examples.

    Batching, padding and the per-token cross-entropy are the worker engine's
    (:mod:`userdp.clients.batching`), so the held-out loss and the training loss the workers
    report (their loss sum over their token count) are the same quantity."""

    def __init__(
        self,
        model: torch.nn.Module,
        examples: list[np.ndarray],
        pad_id: int = 0,
        batch_tokens: int = 8192,
    ) -> None:
        self.model = model
        self.pad_id = pad_id
        ordered = sorted(examples, key=len)  # similar lengths share a batch: less padding
        self.prepared = prepare_units([Unit(str(i), [e]) for i, e in enumerate(ordered)], None)
        batches, oversized = pack_units(self.prepared, batch_tokens)
        self.batches = batches + [[i] for i in oversized]

    @torch.no_grad()
    def loss(self) -> float:
        """Mean cross-entropy per predicted token (nan without examples)."""
        device = next(self.model.parameters()).device
        total, tokens = 0.0, 0
        for units in self.batches:
            batch = make_batch(self.prepared, units, device, self.pad_id)
            total += float(token_losses(self.model, batch).double().sum())
            tokens += int(batch.mask.sum())
        return total / tokens if tokens else float("nan")
