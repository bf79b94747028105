"""Chunked tensor encoding: round trips bit-exactly and refuses every inconsistency."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.tensors import (
    TensorAssembler,
    TensorDecodeError,
    decode_chunks,
    tensor_chunks,
    tensors_chunks,
    tensors_sha256,
)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int64", "int32", "uint8"])
def test_numpy_round_trip_is_bit_exact(dtype: str) -> None:
    rng = np.random.default_rng(0)
    array = (rng.standard_normal((7, 13)) * 100).astype(dtype)
    chunks = list(tensor_chunks("w", array, chunk_bytes=17))
    assert len(chunks) > 1 and all(len(c.data) <= 17 for c in chunks)
    out = decode_chunks(chunks)["w"]
    assert out.dtype == dtype and out.shape == (7, 13)
    assert out.numpy().tobytes() == array.tobytes()


def test_torch_bfloat16_and_scalar_and_empty() -> None:
    tensors = {
        "bf": torch.randn(5, 3).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
    }
    out = decode_chunks(tensors_chunks(tensors, chunk_bytes=8))
    assert torch.equal(out["bf"].torch(), tensors["bf"])
    assert out["scalar"].torch().item() == 3.5 and out["scalar"].shape == ()
    assert out["empty"].shape == (0, 4)
    assert tensors_sha256(out) == tensors_sha256(tensors)


def test_chunks_survive_protobuf_serialization() -> None:
    array = np.arange(1000, dtype=np.float32)
    wire = [pb.TensorChunk.FromString(c.SerializeToString()) for c in tensor_chunks("a", array, 64)]
    np.testing.assert_array_equal(decode_chunks(wire)["a"].numpy(), array)


def _chunks(array: np.ndarray, size: int = 16) -> list[pb.TensorChunk]:
    return list(tensor_chunks("t", array, chunk_bytes=size))


def test_rejects_out_of_order_chunks() -> None:
    chunks = _chunks(np.zeros(16, np.float32))
    with pytest.raises(TensorDecodeError, match="offset"):
        decode_chunks([chunks[1], chunks[0], *chunks[2:]])


def test_rejects_duplicate_chunk() -> None:
    chunks = _chunks(np.zeros(16, np.float32))
    with pytest.raises(TensorDecodeError, match="offset"):
        decode_chunks([chunks[0], chunks[0]])


def test_rejects_incomplete_tensor() -> None:
    chunks = _chunks(np.zeros(16, np.float32))
    with pytest.raises(TensorDecodeError, match="incomplete"):
        decode_chunks(chunks[:-1])


def test_rejects_shape_that_disagrees_with_bytes() -> None:
    chunk = _chunks(np.zeros(4, np.float32))[0]
    chunk.shape[:] = [5]
    with pytest.raises(TensorDecodeError, match="total_bytes"):
        decode_chunks([chunk])


def test_rejects_shape_change_between_chunks() -> None:
    chunks = _chunks(np.zeros(16, np.float32))
    chunks[1].shape[:] = [4, 4]
    with pytest.raises(TensorDecodeError, match="earlier chunks"):
        decode_chunks(chunks)


def test_rejects_unknown_dtype_and_overflow_and_size_limit() -> None:
    chunk = _chunks(np.zeros(4, np.float32))[0]
    bad = pb.TensorChunk()
    bad.CopyFrom(chunk)
    bad.dtype = "object"
    with pytest.raises(TensorDecodeError, match="dtype"):
        decode_chunks([bad])
    over = pb.TensorChunk()
    over.CopyFrom(chunk)
    over.data = chunk.data + b"xxxx"
    with pytest.raises(TensorDecodeError, match="overflows"):
        decode_chunks([over])
    with pytest.raises(TensorDecodeError, match="limit"):
        decode_chunks(_chunks(np.zeros(100, np.float32)), max_total_bytes=100)


def test_announced_count_checked() -> None:
    assembler = TensorAssembler()
    for c in _chunks(np.zeros(4, np.float32)):
        assembler.add(c)
    with pytest.raises(TensorDecodeError, match="announced"):
        assembler.finish(expected_count=2)


def test_refuses_object_arrays() -> None:
    with pytest.raises(TypeError):
        list(tensor_chunks("x", np.array([object()])))
