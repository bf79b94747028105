"""Units -> padded token micro-batches bounded by a token budget, and the per-token loss weights
that make a micro-batch's weighted loss the sum of its units' losses.

A unit's loss is the MEAN over its examples of each example's MEAN next-token cross-entropy
(Algorithm 2 of "Fine-Tuning Large Language Models with User-Level Differential Privacy": the
user gradient is the mean of the unclipped example gradients; an example-level unit has one
example). An example of L tokens is fed as ``x[:-1]`` and predicts
``x[1:]``: L − 1 positions, every one with a target. Examples with fewer than 2 tokens have no
target; they are DROPPED from their unit and counted (``skipped_examples``); a unit left without
examples has a zero gradient (it still counts as one unit, with norm 0).

Layout: every row of a micro-batch is one example of one unit, rows are right-padded (causal
attention: padding after the last real token cannot change the real positions; the attention
mask marks it too) and padded positions have weight 0. Row r of example e in unit u has weight 1 / (n_u · (L_e − 1)) on each of
its L_e − 1 positions, so Σ_t w_t·CE_t over a unit's rows is exactly that unit's loss.

Budget: a micro-batch's cost is its PADDED size, rows × longest row. Units are packed greedily in
order; a unit that alone exceeds the budget is ``oversized`` and handled by the caller (split
into example chunks); a single example longer than the budget still runs, alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


class EngineError(ValueError):
    """A unit, option or model cannot be processed; the message says what to change."""


@dataclass(frozen=True)
class Unit:
    """One privacy unit: a user (ULS: its selected examples) or one example (ELS)."""

    unit_id: str
    examples: list[np.ndarray]


@dataclass(frozen=True)
class PreparedUnit:
    """A unit's usable examples (≥ 2 tokens each) as int64 arrays."""

    unit_id: str
    examples: tuple[np.ndarray, ...]
    skipped: int

    @property
    def positions(self) -> int:
        """Predicted tokens (= positions with a target)."""
        return sum(len(e) - 1 for e in self.examples)

    @property
    def padded_rows(self) -> tuple[int, int]:
        """(rows, longest row) this unit needs on its own."""
        if not self.examples:
            return 0, 0
        return len(self.examples), max(len(e) - 1 for e in self.examples)


def prepare_units(units: Sequence[Unit], max_positions: int | None) -> list[PreparedUnit]:
    """Validate token ids and lengths; drop examples with fewer than 2 tokens (counted)."""
    prepared = []
    for unit in units:
        kept, skipped = [], 0
        for example in unit.examples:
            tokens = np.asarray(example)
            if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
                raise EngineError(
                    f"unit {unit.unit_id!r}: an example must be a 1-D integer array of token ids, "
                    f"got shape {tokens.shape} dtype {tokens.dtype}"
                )
            if len(tokens) < 2:
                skipped += 1
                continue
            if max_positions is not None and len(tokens) - 1 > max_positions:
                raise EngineError(
                    f"unit {unit.unit_id!r}: an example of {len(tokens)} tokens needs "
                    f"{len(tokens) - 1} positions but the model has {max_positions}; set "
                    f"data.seq_len <= {max_positions + 1} or use a model with a longer context"
                )
            kept.append(tokens.astype(np.int64, copy=False))
        prepared.append(PreparedUnit(unit.unit_id, tuple(kept), skipped))
    return prepared


@dataclass(frozen=True)
class MicroBatch:
    """Padded rows of whole units (or one chunk of one oversized unit).

    ``inputs``/``targets``/``weights``: [rows, length]; ``row_unit``: [rows] index into ``units``
    (positions in the caller's list); ``mask``: real positions."""

    units: tuple[int, ...]
    inputs: torch.Tensor
    targets: torch.Tensor
    weights: torch.Tensor
    mask: torch.Tensor
    row_unit: torch.Tensor


def padded_cost(rows: int, length: int) -> int:
    return rows * length


def pack_units(prepared: Sequence[PreparedUnit], budget: int) -> tuple[list[list[int]], list[int]]:
    """Greedy packing of whole units into micro-batches of padded cost ≤ ``budget``.

    Returns (micro-batches as lists of unit indices, oversized unit indices). Units without
    examples are put in no batch (their gradient is zero)."""
    if budget < 1:
        raise EngineError(f"token budget must be >= 1, got {budget}")
    batches: list[list[int]] = []
    oversized: list[int] = []
    current: list[int] = []
    rows = length = 0
    for index, unit in enumerate(prepared):
        unit_rows, unit_len = unit.padded_rows
        if unit_rows == 0:
            continue
        if padded_cost(unit_rows, unit_len) > budget:
            oversized.append(index)
            continue
        new_rows, new_len = rows + unit_rows, max(length, unit_len)
        if current and padded_cost(new_rows, new_len) > budget:
            batches.append(current)
            current, new_rows, new_len = [], unit_rows, unit_len
        current.append(index)
        rows, length = new_rows, new_len
    if current:
        batches.append(current)
    return batches, oversized


def chunk_examples(examples: Sequence[np.ndarray], budget: int) -> list[list[int]]:
    """Consecutive example chunks of padded cost ≤ ``budget`` (an example over budget is alone)."""
    chunks: list[list[int]] = []
    current: list[int] = []
    length = 0
    for index, example in enumerate(examples):
        positions = len(example) - 1
        new_len = max(length, positions)
        if current and padded_cost(len(current) + 1, new_len) > budget:
            chunks.append(current)
            current, new_len = [], positions
        current.append(index)
        length = new_len
    if current:
        chunks.append(current)
    return chunks


def make_batch(
    prepared: Sequence[PreparedUnit],
    unit_indices: Sequence[int],
    device: torch.device,
    pad_id: int,
    example_indices: Sequence[int] | None = None,
) -> MicroBatch:
    """Pad the examples of ``unit_indices`` (or, for one unit, only ``example_indices``) into a
    micro-batch with the unit-loss weights of the module docstring."""
    rows: list[tuple[int, np.ndarray, float]] = []
    for index in unit_indices:
        unit = prepared[index]
        chosen = range(len(unit.examples)) if example_indices is None else example_indices
        n = len(unit.examples)
        for e in chosen:
            example = unit.examples[e]
            rows.append((index, example, 1.0 / (n * (len(example) - 1))))
    length = max(len(example) - 1 for _, example, _ in rows)
    inputs = np.full((len(rows), length), pad_id, dtype=np.int64)
    targets = np.full((len(rows), length), pad_id, dtype=np.int64)
    weights = np.zeros((len(rows), length), dtype=np.float64)
    for r, (_, example, weight) in enumerate(rows):
        positions = len(example) - 1
        inputs[r, :positions] = example[:-1]
        targets[r, :positions] = example[1:]
        weights[r, :positions] = weight
    return MicroBatch(
        units=tuple(unit_indices),
        inputs=torch.from_numpy(inputs).to(device),
        targets=torch.from_numpy(targets).to(device),
        weights=torch.from_numpy(weights).to(device=device, dtype=torch.float32),
        mask=torch.from_numpy(weights > 0).to(device),
        row_unit=torch.tensor([u for u, _, _ in rows], dtype=torch.long, device=device),
    )


def token_losses(module: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
    """Per-position next-token cross-entropy [rows, length] in float32; 0 at padding.

    Padding positions are zeroed with ``where`` (not a multiply) so that a non-finite value at a
    padded position cannot leak into the sum as 0·NaN."""
    logits = module(
        input_ids=batch.inputs, attention_mask=batch.mask.long(), use_cache=False
    ).logits
    vocab = logits.shape[-1]
    ce = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, vocab), batch.targets.reshape(-1), reduction="none"
    ).view(batch.targets.shape)
    return torch.where(batch.mask, ce, torch.zeros((), device=ce.device))
