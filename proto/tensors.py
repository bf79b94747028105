"""Tensors on the wire: raw little-endian bytes + dtype + shape, split into ``TensorChunk`` messages.

Never pickle. A tensor is sent as consecutive chunks of at most ``chunk_bytes`` (default 4 MiB) so
a 100M-parameter model never meets gRPC's per-message limit. :class:`TensorAssembler` reassembles
them and refuses anything inconsistent: an unknown dtype, a shape whose byte size disagrees with
``total_bytes``, chunks out of order, overlapping or overflowing, a tensor that changes dtype or
shape between chunks, more bytes in total than the receiver allows, or an incomplete tensor.

Works on numpy arrays and torch tensors (torch is imported lazily; bfloat16 exists only in torch).
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from userdp.proto import userdp_v1_pb2 as pb

DEFAULT_CHUNK_BYTES = 4 << 20

# dtype name on the wire -> numpy dtype (bfloat16 travels as its raw 2-byte pattern).
_NUMPY_DTYPES: dict[str, np.dtype] = {
    "float64": np.dtype("<f8"),
    "float32": np.dtype("<f4"),
    "float16": np.dtype("<f2"),
    "bfloat16": np.dtype("<u2"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "int16": np.dtype("<i2"),
    "int8": np.dtype("i1"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
WIRE_DTYPES: tuple[str, ...] = tuple(_NUMPY_DTYPES)
FLOAT_DTYPES: tuple[str, ...] = ("float64", "float32", "float16", "bfloat16")


def wire_itemsize(dtype: str) -> int:
    """Bytes per element of the wire dtype ``dtype``."""
    numpy_dtype = _NUMPY_DTYPES.get(dtype)
    if numpy_dtype is None:
        raise ValueError(f"unknown tensor dtype {dtype!r}; allowed: {WIRE_DTYPES}")
    return numpy_dtype.itemsize


def wire_dtype(tensor: Any) -> str:
    """The wire name of a torch tensor's dtype ("float32", "bfloat16", ...)."""
    return str(tensor.dtype).removeprefix("torch.")


if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError("userdp.proto.tensors assumes a little-endian host")


class TensorDecodeError(ValueError):
    """Received tensor chunks are inconsistent, incomplete or too large (the sender is at fault)."""


@dataclass(frozen=True)
class WireTensor:
    """A reassembled tensor: its dtype name, shape and raw bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes | bytearray | np.ndarray
    """The raw bytes (anything with the buffer protocol; a uint8 array when reassembled)."""

    def numpy(self) -> np.ndarray:
        """A numpy view (bfloat16 comes back as its uint16 bit pattern; use :meth:`torch`)."""
        return np.frombuffer(self.data, dtype=_NUMPY_DTYPES[self.dtype]).reshape(self.shape)

    def torch(self) -> Any:
        """A torch tensor with the wire dtype (shares memory with :attr:`data`)."""
        import torch

        array = self.numpy()
        if self.dtype == "bfloat16":
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        if array.dtype == np.bool_:
            return torch.from_numpy(array.copy())
        return torch.from_numpy(array)


def _as_wire(tensor: Any) -> tuple[str, tuple[int, ...], memoryview]:
    """(dtype name, shape, flat byte view) of a numpy array or torch tensor, without pickling."""
    if isinstance(tensor, np.ndarray):
        array = np.ascontiguousarray(tensor)
        name = array.dtype.name
        if name not in _NUMPY_DTYPES or name == "bfloat16":
            raise TypeError(f"dtype {array.dtype} cannot be sent; allowed: {WIRE_DTYPES}")
        array = array.astype(_NUMPY_DTYPES[name], copy=False)
        return name, tuple(array.shape), memoryview(array.reshape(-1)).cast("B")
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a numpy array or torch tensor, got {type(tensor).__name__}")
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    name = wire_dtype(t)
    if name not in _NUMPY_DTYPES:
        raise TypeError(f"dtype {t.dtype} cannot be sent; allowed: {WIRE_DTYPES}")
    if name == "bfloat16":
        t = t.view(torch.int16)
    array = t.numpy()
    return name, tuple(t.shape), memoryview(array.reshape(-1)).cast("B")


def tensor_chunks(
    name: str,
    tensor: Any,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[pb.TensorChunk]:
    """The ``TensorChunk`` messages of one tensor, in offset order (one chunk for an empty one)."""
    for dtype, shape, total, offset, data in tensor_pieces(tensor, chunk_bytes):
        chunk = pb.TensorChunk()
        chunk.name = name
        chunk.dtype = dtype
        chunk.shape.extend(shape)
        chunk.total_bytes = total
        chunk.offset = offset
        chunk.data = data.tobytes()
        yield chunk


def tensor_pieces(
    tensor: Any, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[tuple[str, tuple[int, ...], int, int, memoryview]]:
    """(dtype, shape, total_bytes, offset, bytes) of each chunk of one tensor, in offset order
    (one empty piece for an empty tensor); the bytes are views of the tensor's memory."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    dtype, shape, flat = _as_wire(tensor)
    total = len(flat)
    offset = 0
    while True:
        end = min(offset + chunk_bytes, total)
        yield dtype, shape, total, offset, flat[offset:end]
        offset = end
        if offset >= total:
            return


def tensors_chunks(
    tensors: Mapping[str, Any],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> Iterator[pb.TensorChunk]:
    """Chunks of every tensor of a name -> tensor mapping, name-sorted (deterministic order)."""
    for name in sorted(tensors):
        yield from tensor_chunks(name, tensors[name], chunk_bytes)


class TensorAssembler:
    """Reassembles chunks into tensors, checking every invariant of the module docstring."""

    def __init__(self, max_total_bytes: int = 1 << 40, max_tensors: int = 1 << 20) -> None:
        self.max_total_bytes = max_total_bytes
        self.max_tensors = max_tensors
        self._buffers: dict[str, np.ndarray] = {}
        self._meta: dict[str, tuple[str, tuple[int, ...], int]] = {}
        self._received: dict[str, int] = {}
        self._total = 0

    def add(self, chunk: pb.TensorChunk) -> None:
        name, dtype, shape = chunk.name, chunk.dtype, tuple(int(d) for d in chunk.shape)
        if not name:
            raise TensorDecodeError("tensor chunk without a name")
        if dtype not in _NUMPY_DTYPES:
            raise TensorDecodeError(f"tensor {name!r}: dtype {dtype!r} not in {WIRE_DTYPES}")
        if any(d < 0 for d in shape):
            raise TensorDecodeError(f"tensor {name!r}: negative dimension in shape {shape}")
        expected = math.prod(shape) * _NUMPY_DTYPES[dtype].itemsize
        if chunk.total_bytes != expected:
            raise TensorDecodeError(
                f"tensor {name!r}: total_bytes {chunk.total_bytes} != {expected} for "
                f"{dtype}{list(shape)}"
            )
        meta = self._meta.get(name)
        if meta is None:
            if len(self._meta) >= self.max_tensors:
                raise TensorDecodeError(f"more than {self.max_tensors} tensors")
            if self._total + expected > self.max_total_bytes:
                raise TensorDecodeError(
                    f"tensor {name!r} would exceed the receiver's limit of "
                    f"{self.max_total_bytes} bytes"
                )
            self._total += expected
            self._meta[name] = (dtype, shape, expected)
            # uninitialized: every byte is written by a chunk before finish() accepts the tensor
            self._buffers[name] = np.empty(expected, dtype=np.uint8)
            self._received[name] = 0
        elif meta != (dtype, shape, expected):
            raise TensorDecodeError(
                f"tensor {name!r}: chunk says {dtype}{list(shape)}, earlier chunks said "
                f"{meta[0]}{list(meta[1])}"
            )
        received = self._received[name]
        if chunk.offset != received:
            raise TensorDecodeError(
                f"tensor {name!r}: chunk at offset {chunk.offset}, expected {received}"
            )
        data = chunk.data  # one read: each access of a protobuf bytes field copies it
        end = received + len(data)
        if end > expected or (len(data) == 0 and expected > 0):
            raise TensorDecodeError(f"tensor {name!r}: chunk overflows {expected} bytes")
        self._buffers[name][received:end] = np.frombuffer(data, dtype=np.uint8)
        self._received[name] = end

    def names(self) -> list[str]:
        return list(self._meta)

    def finish(self, expected_count: int | None = None) -> dict[str, WireTensor]:
        """All tensors, or TensorDecodeError if any is incomplete or the count is wrong."""
        if expected_count is not None and expected_count != len(self._meta):
            raise TensorDecodeError(
                f"received {len(self._meta)} tensors, the sender announced {expected_count}"
            )
        out: dict[str, WireTensor] = {}
        for name, (dtype, shape, expected) in self._meta.items():
            if self._received[name] != expected:
                raise TensorDecodeError(
                    f"tensor {name!r}: incomplete ({self._received[name]} of {expected} bytes)"
                )
            out[name] = WireTensor(dtype, shape, self._buffers[name])
        return out


def decode_chunks(
    chunks: Iterable[pb.TensorChunk], max_total_bytes: int = 1 << 40
) -> dict[str, WireTensor]:
    """Reassemble a complete sequence of chunks (convenience for tests and small payloads)."""
    assembler = TensorAssembler(max_total_bytes=max_total_bytes)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()


def _tensor_digest(name: str, dtype: str, shape: Iterable[int], pieces: Iterable[Any]) -> str:
    digest = hashlib.sha256(f"{name}|{dtype}|{list(shape)}|".encode())
    for piece in pieces:
        digest.update(piece)
    return digest.hexdigest()


def _combine(digests: Mapping[str, str]) -> str:
    return hashlib.sha256(
        "".join(f"{name}:{digests[name]};" for name in sorted(digests)).encode()
    ).hexdigest()


def tensors_sha256(tensors: Mapping[str, Any]) -> str:
    """Identity of a set of tensors: sha256 over the name-sorted per-tensor sha256 of
    (name, dtype, shape, raw bytes). Equal to :func:`chunks_sha256` of their chunks."""
    digests = {}
    for name, value in tensors.items():
        if isinstance(value, WireTensor):
            dtype, shape, flat = value.dtype, value.shape, memoryview(value.data)
        else:
            dtype, shape, flat = _as_wire(value)
        digests[name] = _tensor_digest(name, dtype, shape, [flat])
    return _combine(digests)


def chunks_sha256(chunks: Iterable[pb.TensorChunk]) -> str:
    """:func:`tensors_sha256` computed from chunks in offset order (no reassembly needed)."""
    running: dict[str, Any] = {}
    for chunk in chunks:
        digest = running.get(chunk.name)
        if digest is None:
            digest = running[chunk.name] = hashlib.sha256(
                f"{chunk.name}|{chunk.dtype}|{[int(d) for d in chunk.shape]}|".encode()
            )
        digest.update(chunk.data)
    return _combine({name: d.hexdigest() for name, d in running.items()})
