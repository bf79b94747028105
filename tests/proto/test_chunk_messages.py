"""The hand-written chunk envelopes: byte for byte what protobuf writes, and read as protobuf
reads them (or left to protobuf) on valid, unusual and corrupted bytes."""

from __future__ import annotations

import numpy as np
import pytest
from google.protobuf.message import DecodeError
from userdp.proto import chunk_messages as cm
from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.tensors import TensorAssembler, chunks_sha256, tensors_chunks, tensors_sha256

TENSORS = {
    "layer.weight": np.arange(10_000, dtype=np.float32).reshape(100, 100),
    "bias": np.array([1, -2, 3], dtype=np.int64),
    "empty": np.zeros((0, 5), dtype=np.float16),
    "scalar": np.array(2.5, dtype=np.float64),
    "ünïcode": np.ones(7, dtype=np.bool_),
}


def _proto_model_parts(version: int, chunk_bytes: int) -> list[pb.CoordinatorMessage]:
    return [
        pb.CoordinatorMessage(model_part=pb.ModelPart(model_version=version, chunk=chunk))
        for chunk in tensors_chunks(TENSORS, chunk_bytes)
    ]


def _proto_result_parts(task_id: str, attempt: int, chunk_bytes: int) -> list[pb.WorkerMessage]:
    return [
        pb.WorkerMessage(result_part=pb.ResultPart(task_id=task_id, attempt=attempt, chunk=chunk))
        for chunk in tensors_chunks(TENSORS, chunk_bytes)
    ]


def _fields(message) -> tuple:
    """Everything a receiver reads of an envelope, from a ChunkMessage or a generated message."""
    kind = message.WhichOneof("kind")
    if kind == "model_part":
        part = message.model_part
        head: tuple = (part.model_version,)
    elif kind == "result_part":
        part = message.result_part
        head = (part.task_id, part.attempt)
    else:
        return (kind, message.SerializeToString())
    c = part.chunk
    chunk = (c.name, c.dtype, tuple(c.shape), c.total_bytes, c.offset, bytes(c.data))
    return (kind, *head, chunk)


@pytest.mark.parametrize("version", [0, 1, 2**40, -1])
@pytest.mark.parametrize("chunk_bytes", [1 << 20, 999])
def test_model_parts_are_protobufs_bytes(version, chunk_bytes) -> None:
    mine = list(cm.model_part_messages(version, TENSORS, chunk_bytes))
    theirs = _proto_model_parts(version, chunk_bytes)
    assert len(mine) == len(theirs) == len(TENSORS) + (40 if chunk_bytes == 999 else 0)
    for m, t in zip(mine, theirs, strict=True):
        assert cm.serialize(m) == t.SerializeToString()
        assert _fields(m) == _fields(t)
        assert m.to_proto() == t


@pytest.mark.parametrize(("task_id", "attempt"), [("t-1", 0), ("täsk", 3), ("", 2**32 - 1)])
def test_result_parts_are_protobufs_bytes(task_id, attempt) -> None:
    mine = list(cm.result_part_messages(task_id, attempt, TENSORS, 4096))
    theirs = _proto_result_parts(task_id, attempt, 4096)
    for m, t in zip(mine, theirs, strict=True):
        assert cm.serialize(m) == t.SerializeToString()
        assert _fields(m) == _fields(t)


def test_a_chunk_is_rewrapped_for_another_version() -> None:
    (original,) = cm.model_part_messages(3, {"bias": TENSORS["bias"]}, 1 << 20)
    moved = cm.model_part_of(9, original.model_part.chunk)
    (expected,) = cm.model_part_messages(9, {"bias": TENSORS["bias"]}, 1 << 20)
    assert moved.wire == expected.wire and moved.model_part.model_version == 9


def test_decoded_parts_reassemble_the_tensors_with_their_digest() -> None:
    wires = [cm.serialize(m) for m in cm.model_part_messages(5, TENSORS, 999)]
    messages = [cm.decode_coordinator_message(w) for w in wires]
    assert all(isinstance(m, cm.ChunkMessage) for m in messages)  # the fast path took them
    assembler = TensorAssembler()
    for message in messages:
        assembler.add(message.model_part.chunk)
    tensors = assembler.finish()
    for name, array in TENSORS.items():
        np.testing.assert_array_equal(tensors[name].numpy(), array)
    assert chunks_sha256(m.model_part.chunk for m in messages) == tensors_sha256(TENSORS)


def test_other_messages_go_through_protobuf() -> None:
    for message in (
        pb.CoordinatorMessage(task=pb.Task(task_id="t", unit_ids=["u"])),
        pb.CoordinatorMessage(model_commit=pb.ModelCommit(model_version=2, full=True)),
        pb.CoordinatorMessage(),
    ):
        decoded = cm.decode_coordinator_message(message.SerializeToString())
        assert isinstance(decoded, pb.CoordinatorMessage) and decoded == message
    beat = pb.WorkerMessage(heartbeat=pb.Heartbeat())
    assert cm.decode_worker_message(beat.SerializeToString()) == beat
    assert cm.serialize(beat) == beat.SerializeToString()


def _key(field: int, wire_type: int) -> bytes:
    return cm._varint(field << 3 | wire_type)


def _wrap_chunk(chunk_fields: bytes, attempt: int = 1) -> bytes:
    """A WorkerMessage{result_part{task_id "t", attempt, chunk = chunk_fields}} by hand."""
    part = b"\x0a\x01t" + _key(2, 0) + cm._varint(attempt) + _key(3, 2)
    part += cm._varint(len(chunk_fields)) + chunk_fields
    return _key(3, 2) + cm._varint(len(part)) + part


_GOOD_CHUNK = b"\x0a\x01w\x12\x07float32\x1a\x01\x02\x20\x08\x32\x08" + bytes(range(8))


@pytest.mark.parametrize(
    ("wire", "fast"),
    [
        (_wrap_chunk(_GOOD_CHUNK), True),
        # shape written unpacked (a parser must accept both encodings)
        (_wrap_chunk(_GOOD_CHUNK.replace(b"\x1a\x01\x02", _key(3, 0) + b"\x02")), False),
        # the data field twice: protobuf keeps the last
        (_wrap_chunk(_GOOD_CHUNK + b"\x32\x02ab"), False),
        # an unknown field: protobuf keeps it as unknown
        (_wrap_chunk(_GOOD_CHUNK + _key(15, 0) + b"\x01"), False),
        # a fixed64 field where none is declared
        (_wrap_chunk(_GOOD_CHUNK + _key(7, 1) + bytes(8)), False),
        # attempt beyond uint32 (protobuf truncates)
        (_wrap_chunk(_GOOD_CHUNK, attempt=2**32 + 5), False),
        # a non-minimal varint for total_bytes (protobuf accepts it)
        (_wrap_chunk(_GOOD_CHUNK.replace(b"\x20\x08", b"\x20\x88\x00")), True),
    ],
)
def test_unusual_envelopes_read_as_protobuf_reads_them(wire, fast) -> None:
    decoded = cm.decode_worker_message(wire)
    assert isinstance(decoded, cm.ChunkMessage) == fast
    assert _fields(decoded) == _fields(pb.WorkerMessage.FromString(wire))


@pytest.mark.parametrize(
    "wire",
    [
        _wrap_chunk(_GOOD_CHUNK.replace(b"\x0a\x01w", b"\x0a\x01\xff")),  # name not UTF-8
        _wrap_chunk(_GOOD_CHUNK)[:-3],  # truncated
        _wrap_chunk(_GOOD_CHUNK[:-9] + b"\x32\x7f" + bytes(8)),  # length past the end
    ],
)
def test_malformed_envelopes_are_refused_as_protobuf_refuses_them(wire) -> None:
    with pytest.raises(DecodeError):
        pb.WorkerMessage.FromString(wire)
    with pytest.raises(DecodeError):
        cm.decode_worker_message(wire)


def test_corrupted_bytes_decode_as_protobuf_decodes_them() -> None:
    # Random damage to valid envelopes (flipped bytes, truncation, insertions): whenever protobuf
    # accepts the bytes, the decoder returns the same fields; whenever it refuses, so does the
    # decoder. Seeded, so every run checks the same 3000 cases.
    rng = np.random.default_rng(0)
    worker = (cm.decode_worker_message, pb.WorkerMessage)
    coordinator = (cm.decode_coordinator_message, pb.CoordinatorMessage)
    seeds = [(m.wire, worker) for m in cm.result_part_messages("task", 2, TENSORS, 64)]
    seeds += [(m.wire, coordinator) for m in cm.model_part_messages(-3, TENSORS, 64)]
    fast = 0
    for _ in range(3000):
        original, (decode, kind) = seeds[rng.integers(len(seeds))]
        wire = bytearray(original)
        action = rng.integers(3)
        if action == 0:
            for _ in range(rng.integers(1, 4)):
                wire[rng.integers(len(wire))] = rng.integers(256)
        elif action == 1:
            del wire[rng.integers(len(wire)) :]
        else:
            at = rng.integers(len(wire))
            wire[at:at] = rng.integers(0, 256, rng.integers(1, 4), dtype=np.uint8).tobytes()
        wire = bytes(wire)
        try:
            expected = _fields(kind.FromString(wire))
        except DecodeError:
            with pytest.raises(DecodeError):
                decode(wire)
            continue
        decoded = decode(wire)
        fast += isinstance(decoded, cm.ChunkMessage)
        assert _fields(decoded) == expected
    assert fast > 100  # the fast path itself was exercised on damaged-but-valid bytes
