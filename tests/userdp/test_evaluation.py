"""The held-out token-frequency reference: the loss of the best context-free model of the
held-out examples, computed as the engine's Evaluator scores a model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from userdp.run.evaluation import Evaluator, token_frequency_loss


class FrequencyModel(torch.nn.Module):
    """A causal LM that ignores context: the same logits (log frequencies) at every position."""

    def __init__(self, log_p: torch.Tensor) -> None:
        super().__init__()
        self.log_p = torch.nn.Parameter(log_p)

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        logits = self.log_p.expand(*input_ids.shape, -1)
        return type("Output", (), {"logits": logits})()


def test_hand_computed_entropy() -> None:
    examples = [np.array([1, 2, 3]), np.array([7, 3]), np.array([4])]  # targets 2, 3, 3
    expected = -(1 / 3 * math.log(1 / 3) + 2 / 3 * math.log(2 / 3))
    assert token_frequency_loss(examples) == pytest.approx(expected, rel=1e-12)
    assert token_frequency_loss([np.array([5, 5, 5])]) == 0.0
    assert math.isnan(token_frequency_loss([np.array([5])]))


def test_it_is_the_loss_the_evaluator_gives_the_frequency_model() -> None:
    """The reference is what the Evaluator measures for a model whose logits are the held-out
    targets' log frequencies (float32 logits: agreement to 1e-5), and no context-free model
    does better (a perturbed one scores higher: cross-entropy ≥ entropy)."""
    rng = np.random.default_rng(0)
    vocab = 11
    examples = [rng.integers(0, vocab, size=rng.integers(2, 30)) for _ in range(40)]
    counts = np.bincount(np.concatenate([e[1:] for e in examples]), minlength=vocab)
    log_p = torch.tensor(np.log(np.maximum(counts, 1e-30) / counts.sum()), dtype=torch.float32)
    reference = token_frequency_loss(examples)
    measured = Evaluator(FrequencyModel(log_p), examples).loss()
    assert measured == pytest.approx(reference, rel=1e-5)
    other = Evaluator(FrequencyModel(log_p + 0.3 * torch.randn(vocab)), examples).loss()
    assert other > reference
