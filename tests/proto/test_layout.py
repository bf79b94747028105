"""TensorLayout: views of a flat buffer, raw bytes split back into tensors, buckets, metas."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from userdp.proto.layout import TensorLayout
from userdp.proto.tensors import wire_itemsize

SHAPES = {"w": (2, 3), "b": (3,), "e": (4, 1)}


def test_views_are_consecutive_slices_of_the_buffer():
    layout = TensorLayout.of_shapes(SHAPES)
    assert layout.sizes == (6, 3, 4) and layout.numel == 13 and layout.nbytes == 52
    flat = torch.arange(13, dtype=torch.float32)
    views = layout.views(flat)
    assert list(views) == ["w", "b", "e"]
    assert views["b"].tolist() == [6.0, 7.0, 8.0] and views["e"].shape == (4, 1)
    views["w"][0, 0] = -1.0  # a view, not a copy
    assert flat[0] == -1.0


def test_raw_bytes_split_back_into_the_tensors_of_each_dtype():
    tensors = {
        "h": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "i": torch.tensor([7], dtype=torch.int64),
    }
    layout = TensorLayout.of_tensors(tensors)
    assert layout.dtypes == ("bfloat16", "float32", "int64")
    raw = np.concatenate([t.reshape(-1).view(torch.uint8).numpy() for t in tensors.values()])
    assert layout.nbytes == raw.size == 2 * 2 + 6 * 4 + 8
    split = layout.split_bytes(raw)
    for name, value in tensors.items():
        assert torch.equal(split[name].torch(), value), name
    with pytest.raises(ValueError, match="bytes for tensors of"):
        layout.split_bytes(raw[:-1])


def test_metas_round_trip_and_a_dtype_override():
    tensors = {name: torch.zeros(shape, dtype=torch.float16) for name, shape in SHAPES.items()}
    layout = TensorLayout.of_tensors(tensors, "float32")
    assert TensorLayout.of_metas(layout.metas()) == layout == TensorLayout.of_shapes(SHAPES)


def test_buckets_hold_whole_tensors_in_order():
    layout = TensorLayout.of_shapes(SHAPES)
    assert [b.names for b in layout.buckets(1)] == [("w",), ("b",), ("e",)]
    assert [b.names for b in layout.buckets(7)] == [("w", "b"), ("e",)]
    assert [b.names for b in layout.buckets(1 << 20)] == [("w", "b", "e")]


def test_an_unknown_wire_dtype_is_refused():
    assert wire_itemsize("bfloat16") == 2 and wire_itemsize("float64") == 8
    with pytest.raises(ValueError, match="unknown tensor dtype 'complex64'"):
        wire_itemsize("complex64")
