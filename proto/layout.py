"""Named tensors laid out back to back in one flat buffer: :class:`TensorLayout`.

One layout serves every place a set of tensors travels or is summed as one buffer: the engines'
accumulator (a task's sums, a view per parameter), ZeRO-3's gathered sums, the collective
plane's reduce (its buckets, and the members' held sums added into them) and its model broadcast
(a version's raw bytes split back into tensors). Each describes the tensors by name, shape and
wire dtype (:data:`userdp.proto.tensors.WIRE_DTYPES`), in their order in the buffer.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.tensors import WireTensor, wire_dtype, wire_itemsize


@dataclass(frozen=True)
class TensorLayout:
    """Tensors ``names[i]`` of shape ``shapes[i]`` and wire dtype ``dtypes[i]``, in that order
    in one flat buffer."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]

    @classmethod
    def of_shapes(cls, shapes: Mapping[str, Sequence[int]], dtype: str = "float32") -> TensorLayout:
        return cls(
            tuple(shapes),
            tuple(tuple(int(d) for d in s) for s in shapes.values()),
            (dtype,) * len(shapes),
        )

    @classmethod
    def of_tensors(cls, tensors: Mapping[str, Any], dtype: str | None = None) -> TensorLayout:
        """The layout of ``tensors`` in their order (``dtype``: every tensor's, overriding)."""
        return cls(
            tuple(tensors),
            tuple(tuple(t.shape) for t in tensors.values()),
            tuple(dtype or wire_dtype(t) for t in tensors.values()),
        )

    @classmethod
    def of_metas(cls, metas: Iterable[Any]) -> TensorLayout:
        """The layout a list of ``TensorMeta`` describes."""
        metas = list(metas)
        return cls(
            tuple(m.name for m in metas),
            tuple(tuple(int(d) for d in m.shape) for m in metas),
            tuple(m.dtype for m in metas),
        )

    def metas(self) -> list[pb.TensorMeta]:
        return [
            pb.TensorMeta(name=name, dtype=dtype, shape=list(shape))
            for name, shape, dtype in zip(self.names, self.shapes, self.dtypes, strict=True)
        ]

    @property
    def sizes(self) -> tuple[int, ...]:
        """Each tensor's number of elements."""
        return tuple(math.prod(shape) for shape in self.shapes)

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def nbytes(self) -> int:
        return sum(n * wire_itemsize(d) for n, d in zip(self.sizes, self.dtypes, strict=True))

    def views(self, flat: Any) -> dict[str, Any]:
        """One view per tensor into consecutive slices of the 1-D tensor ``flat``."""
        views, offset = {}, 0
        for name, shape, size in zip(self.names, self.shapes, self.sizes, strict=True):
            views[name] = flat[offset : offset + size].view(shape)
            offset += size
        return views

    def split_bytes(self, data: np.ndarray) -> dict[str, WireTensor]:
        """The tensors in the raw bytes ``data`` (a uint8 array of :attr:`nbytes`), as views."""
        if data.size != self.nbytes:
            raise ValueError(f"{data.size} bytes for tensors of {self.nbytes}")
        tensors, offset = {}, 0
        for name, shape, dtype, size in zip(
            self.names, self.shapes, self.dtypes, self.sizes, strict=True
        ):
            width = size * wire_itemsize(dtype)
            tensors[name] = WireTensor(dtype, shape, data[offset : offset + width])
            offset += width
        return tensors

    def buckets(self, elements: int) -> list[TensorLayout]:
        """Consecutive tensors grouped into layouts of at least ``elements`` elements (the last
        may be smaller; a tensor is never split)."""
        out: list[list[int]] = [[]]
        size = 0
        for index, numel in enumerate(self.sizes):
            if size >= elements:
                out.append([])
                size = 0
            out[-1].append(index)
            size += numel
        return [self._select(indices) for indices in out if indices]

    def _select(self, indices: list[int]) -> TensorLayout:
        return TensorLayout(
            tuple(self.names[i] for i in indices),
            tuple(self.shapes[i] for i in indices),
            tuple(self.dtypes[i] for i in indices),
        )
