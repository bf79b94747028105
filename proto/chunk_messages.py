r"""The two envelopes that carry tensor bytes, written and read in the protobuf wire format by hand.

``CoordinatorMessage{model_part}`` (an update's chunks) and ``WorkerMessage{result_part}`` (a
partial sum's chunks) carry nearly all of a session's bytes. The protobuf runtime copies a bytes
field at every step: into the message, out of it when serializing, into the parsed message, and
out again on each read of the field. Here the bytes are copied once per side:

- :func:`model_part_messages` / :func:`result_part_messages` build :class:`ChunkMessage`\ s
  whose serialized form is one join of a small header and the chunk's bytes (the snapshot the
  message keeps); serializing returns that form without another copy;
- :func:`decode_coordinator_message` / :func:`decode_worker_message` parse a received envelope
  with the chunk's bytes left in place: ``chunk.data`` is a view of the received buffer, which
  :class:`~userdp.proto.tensors.TensorAssembler` copies once into the tensor.

Every other message goes through the protobuf runtime. So does any envelope the parser does not
recognise field for field (another field, a repeated singular field, a varint out of its field's
range, invalid UTF-8, truncation): the parse returns what protobuf would return, or leaves the
bytes to protobuf, which then parses or rejects them itself. The bytes on the wire are those
protobuf writes (tested byte for byte), so either end may use the runtime.

A :class:`ChunkMessage` answers what the session code asks of the generated messages:
``WhichOneof("kind")``, ``.model_part`` / ``.result_part`` and their ``.chunk`` fields, and
``SerializeToString()``; :meth:`ChunkMessage.to_proto` gives the generated message.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.tensors import tensor_pieces

__all__ = [
    "Chunk",
    "ChunkMessage",
    "connect",
    "decode_coordinator_message",
    "decode_worker_message",
    "model_part_messages",
    "model_part_of",
    "result_part_messages",
    "serialize",
]


def _numbers(message: Any, *fields: str) -> tuple[int, ...]:
    """The field numbers of ``fields`` in a generated message type (userdp_v1.proto)."""
    return tuple(message.DESCRIPTOR.fields_by_name[field].number for field in fields)


(_COORDINATOR_MODEL_PART,) = _numbers(pb.CoordinatorMessage, "model_part")
(_WORKER_RESULT_PART,) = _numbers(pb.WorkerMessage, "result_part")
_MODEL_PART_VERSION, _MODEL_PART_CHUNK = _numbers(pb.ModelPart, "model_version", "chunk")
_RESULT_PART_TASK, _RESULT_PART_ATTEMPT, _RESULT_PART_CHUNK = _numbers(
    pb.ResultPart, "task_id", "attempt", "chunk"
)
_NAME, _DTYPE, _SHAPE, _TOTAL, _OFFSET, _DATA = _numbers(
    pb.TensorChunk, "name", "dtype", "shape", "total_bytes", "offset", "data"
)

_VARINT, _LEN = 0, 2  # wire types
_U32, _U64 = (1 << 32) - 1, (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class Chunk:
    """The fields of a ``TensorChunk``; ``data`` is a view of the envelope's buffer."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    total_bytes: int
    offset: int
    data: memoryview


@dataclass(frozen=True, slots=True)
class ModelPart:
    model_version: int
    chunk: Chunk


@dataclass(frozen=True, slots=True)
class ResultPart:
    task_id: str
    attempt: int
    chunk: Chunk


class ChunkMessage:
    """A ``CoordinatorMessage{model_part}`` or ``WorkerMessage{result_part}`` held as its wire
    bytes plus the decoded header (see the module docstring)."""

    __slots__ = ("_part", "_kind", "wire")

    def __init__(self, kind: str, part: ModelPart | ResultPart, wire: bytes) -> None:
        self._kind, self._part, self.wire = kind, part, wire

    def WhichOneof(self, group: str) -> str:  # noqa: N802 - the generated messages' method
        if group != "kind":
            raise ValueError(f"no oneof {group!r}; the envelopes' oneof is 'kind'")
        return self._kind

    @property
    def model_part(self) -> ModelPart:
        if self._kind != "model_part":
            raise AttributeError("a result_part envelope has no model_part")
        return self._part  # type: ignore[return-value]

    @property
    def result_part(self) -> ResultPart:
        if self._kind != "result_part":
            raise AttributeError("a model_part envelope has no result_part")
        return self._part  # type: ignore[return-value]

    def SerializeToString(self) -> bytes:  # noqa: N802 - the generated messages' method
        return self.wire

    def to_proto(self) -> pb.CoordinatorMessage | pb.WorkerMessage:
        """The generated message of the same bytes."""
        kind = pb.CoordinatorMessage if self._kind == "model_part" else pb.WorkerMessage
        return kind.FromString(self.wire)


def connect(channel: Any) -> Any:
    """The ``Coordinator.Connect`` stream of ``channel`` (a ``grpc.Channel``), as the generated
    stub declares it but with this module's serializer and deserializer."""
    method = pb.DESCRIPTOR.services_by_name["Coordinator"].methods_by_name["Connect"]
    return channel.stream_stream(
        f"/{method.containing_service.full_name}/{method.name}",
        request_serializer=serialize,
        response_deserializer=decode_coordinator_message,
        _registered_method=True,
    )


def serialize(message: Any) -> bytes:
    """The session streams' serializer: a :class:`ChunkMessage`'s bytes as they are, any
    generated message through the protobuf runtime."""
    return message.SerializeToString()


# ---- writing --------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    value &= _U64  # int64 negatives are written as their 64-bit two's complement (10 bytes)
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _scalar(field: int, value: int) -> bytes:
    """A varint field as proto3 writes it: nothing for 0."""
    return _key(field, _VARINT) + _varint(value) if value else b""


def _text(field: int, value: str) -> bytes:
    raw = value.encode()
    return _key(field, _LEN) + _varint(len(raw)) + raw if raw else b""


def _length_prefix(field: int, length: int) -> bytes:
    return _key(field, _LEN) + _varint(length)


def _chunk_header(name: str, dtype: str, shape: tuple[int, ...], total: int, offset: int) -> bytes:
    """A ``TensorChunk``'s fields before ``data``, in field order, as protobuf writes them."""
    packed = b"".join(_varint(d) for d in shape)
    return b"".join(
        (
            _text(_NAME, name),
            _text(_DTYPE, dtype),
            _length_prefix(_SHAPE, len(packed)) + packed if packed else b"",
            _scalar(_TOTAL, total),
            _scalar(_OFFSET, offset),
        )
    )


def _envelope(
    kind: str, outer: int, fields: bytes, inner: int, header: bytes, data: memoryview
) -> ChunkMessage:
    """Wrap a chunk (``header`` + ``data`` field) in its part (``fields``, then the chunk as field
    ``inner``) and the part in its envelope (field ``outer``): one copy of ``data``."""
    data_field = _length_prefix(_DATA, len(data)) if len(data) else b""
    chunk_len = len(header) + len(data_field) + len(data)
    part_prefix = fields + _length_prefix(inner, chunk_len)
    part_len = len(part_prefix) + chunk_len
    head = _length_prefix(outer, part_len) + part_prefix + header + data_field
    wire = b"".join((head, data))
    message = _parse_envelope(wire, outer, kind)  # the header's fields, read back from the bytes
    if message is None:
        raise ValueError(f"a {kind} envelope's fields are out of their protobuf types' range")
    return message


def _part_messages(
    kind: str, outer: int, fields: bytes, inner: int, tensors: Mapping[str, Any], chunk_bytes: int
) -> Iterator[ChunkMessage]:
    """The envelopes of ``tensors`` (name-sorted, chunks of at most ``chunk_bytes``), each part
    holding ``fields`` and one chunk as field ``inner``; each keeps a snapshot of its bytes."""
    for name in sorted(tensors):
        for dtype, shape, total, offset, data in tensor_pieces(tensors[name], chunk_bytes):
            header = _chunk_header(name, dtype, shape, total, offset)
            yield _envelope(kind, outer, fields, inner, header, data)


def model_part_messages(
    version: int, tensors: Mapping[str, Any], chunk_bytes: int
) -> Iterator[ChunkMessage]:
    """The ``CoordinatorMessage{model_part}`` envelopes of ``tensors`` for model ``version``."""
    fields = _scalar(_MODEL_PART_VERSION, version)
    return _part_messages(
        "model_part", _COORDINATOR_MODEL_PART, fields, _MODEL_PART_CHUNK, tensors, chunk_bytes
    )


def model_part_of(version: int, chunk: Chunk) -> ChunkMessage:
    """``chunk`` in a ``CoordinatorMessage{model_part}`` envelope of model ``version``."""
    header = _chunk_header(chunk.name, chunk.dtype, chunk.shape, chunk.total_bytes, chunk.offset)
    fields = _scalar(_MODEL_PART_VERSION, version)
    return _envelope(
        "model_part", _COORDINATOR_MODEL_PART, fields, _MODEL_PART_CHUNK, header, chunk.data
    )


def result_part_messages(
    task_id: str, attempt: int, tensors: Mapping[str, Any], chunk_bytes: int
) -> Iterator[ChunkMessage]:
    """The ``WorkerMessage{result_part}`` envelopes of a task's summed ``tensors``."""
    fields = _text(_RESULT_PART_TASK, task_id) + _scalar(_RESULT_PART_ATTEMPT, attempt)
    return _part_messages(
        "result_part", _WORKER_RESULT_PART, fields, _RESULT_PART_CHUNK, tensors, chunk_bytes
    )


# ---- reading --------------------------------------------------------------------------------


class _Unrecognised(Exception):
    """The bytes are not an envelope this parser reads field for field; protobuf decides."""


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if pos >= end or shift > 63:
            raise _Unrecognised
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if value > _U64:
                raise _Unrecognised
            return value, pos
        shift += 7


def _fields(buf: memoryview, pos: int, end: int) -> dict[int, int | memoryview]:
    """The fields of the message in ``buf[pos:end]``: number -> varint value or LEN payload.
    A field seen twice, or a wire type other than varint and LEN, is not read here."""
    out: dict[int, int | memoryview] = {}
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        number, wire_type = key >> 3, key & 7
        if number in out or number == 0:
            raise _Unrecognised
        if wire_type == _VARINT:
            out[number], pos = _read_varint(buf, pos, end)
        elif wire_type == _LEN:
            length, pos = _read_varint(buf, pos, end)
            if length > end - pos:
                raise _Unrecognised
            out[number] = buf[pos : pos + length]
            pos += length
        else:
            raise _Unrecognised
    return out


def _only(fields: dict[int, int | memoryview], allowed: dict[int, type]) -> None:
    for number, value in fields.items():
        if not isinstance(value, allowed.get(number, ())):
            raise _Unrecognised


def _string(fields: dict[int, int | memoryview], number: int) -> str:
    raw = fields.get(number)
    if raw is None:
        return ""
    try:
        return bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise _Unrecognised from None


def _int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _parse_chunk(buf: memoryview) -> Chunk:
    fields = _fields(buf, 0, len(buf))
    _only(
        fields,
        {
            _NAME: memoryview,
            _DTYPE: memoryview,
            _SHAPE: memoryview,
            _TOTAL: int,
            _OFFSET: int,
            _DATA: memoryview,
        },
    )
    shape: list[int] = []
    packed = fields.get(_SHAPE)
    if packed is not None:
        pos = 0
        while pos < len(packed):
            dim, pos = _read_varint(packed, pos, len(packed))  # type: ignore[arg-type]
            shape.append(_int64(dim))
    return Chunk(
        name=_string(fields, _NAME),
        dtype=_string(fields, _DTYPE),
        shape=tuple(shape),
        total_bytes=fields.get(_TOTAL, 0),  # type: ignore[arg-type]
        offset=fields.get(_OFFSET, 0),  # type: ignore[arg-type]
        data=fields.get(_DATA, memoryview(b"")),  # type: ignore[arg-type]
    )


def _parse_envelope(wire: bytes, outer: int, kind: str) -> ChunkMessage | None:
    """The :class:`ChunkMessage` of ``wire`` when it is exactly an envelope holding field
    ``outer`` that this parser reads, else None."""
    buf = memoryview(wire)
    try:
        top = _fields(buf, 0, len(buf))
        _only(top, {outer: memoryview})
        if outer not in top:
            return None
        part = _fields(top[outer], 0, len(top[outer]))  # type: ignore[arg-type]
        if kind == "model_part":
            _only(part, {_MODEL_PART_VERSION: int, _MODEL_PART_CHUNK: memoryview})
            if _MODEL_PART_CHUNK not in part:
                return None
            version = _int64(part.get(_MODEL_PART_VERSION, 0))  # type: ignore[arg-type]
            chunk = _parse_chunk(part[_MODEL_PART_CHUNK])  # type: ignore[arg-type]
            return ChunkMessage(kind, ModelPart(version, chunk), wire)
        _only(
            part,
            {
                _RESULT_PART_TASK: memoryview,
                _RESULT_PART_ATTEMPT: int,
                _RESULT_PART_CHUNK: memoryview,
            },
        )
        attempt = part.get(_RESULT_PART_ATTEMPT, 0)
        if _RESULT_PART_CHUNK not in part or attempt > _U32:  # type: ignore[operator]
            return None
        chunk = _parse_chunk(part[_RESULT_PART_CHUNK])  # type: ignore[arg-type]
        task_id = _string(part, _RESULT_PART_TASK)
        return ChunkMessage(kind, ResultPart(task_id, attempt, chunk), wire)  # type: ignore[arg-type]
    except _Unrecognised:
        return None


def decode_coordinator_message(wire: bytes) -> ChunkMessage | pb.CoordinatorMessage:
    """A received ``CoordinatorMessage``: a :class:`ChunkMessage` for a model part this module
    reads, else the generated message (protobuf's parse, or its error)."""
    message = _parse_envelope(wire, _COORDINATOR_MODEL_PART, "model_part")
    return message if message is not None else pb.CoordinatorMessage.FromString(wire)


def decode_worker_message(wire: bytes) -> ChunkMessage | pb.WorkerMessage:
    """A received ``WorkerMessage``: a :class:`ChunkMessage` for a result part this module reads,
    else the generated message (protobuf's parse, or its error)."""
    message = _parse_envelope(wire, _WORKER_RESULT_PART, "result_part")
    return message if message is not None else pb.WorkerMessage.FromString(wire)
