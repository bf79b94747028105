"""The coordinator's current model in wire form: a step's update for in-sync workers, the full
model for a resync.

:meth:`ModelPublisher.publish` encodes a step's update (the trainable tensors, chunked once,
shared by every session); :meth:`ModelPublisher.full` adds the frozen tensors for a resync.
Updates carry no sha256 (transport integrity is TCP/HTTP2/TLS and the chunk checks); a full model
carries one, which the worker verifies before applying it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from userdp.proto import userdp_v1_pb2 as pb
from userdp.proto.chunk_messages import ChunkMessage, model_part_messages, model_part_of
from userdp.proto.tensors import chunks_sha256

if TYPE_CHECKING:
    import torch

Message = ChunkMessage | pb.CoordinatorMessage
"""A message to a worker: a model part (hand-encoded) or any generated message."""


class ModelPublisher:
    """The current model version in wire form (see the module docstring)."""

    def __init__(self, chunk_bytes: int = 1 << 20) -> None:
        self.chunk_bytes = chunk_bytes
        self._lock = threading.Lock()
        self.version = -1
        self._trainable_parts: list[ChunkMessage] = []
        self._trainable_count = 0
        self._frozen_parts: list[ChunkMessage] = []
        self._frozen_count = 0
        self._full_cache: tuple[int, list[Message]] | None = None

    def _parts(
        self,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        sink: Callable[[Message], None] | None = None,
    ) -> list[ChunkMessage]:
        out: list[ChunkMessage] = []
        for message in model_part_messages(version, tensors, self.chunk_bytes):
            out.append(message)
            if sink is not None:
                sink(message)  # complete: stream it while the next chunk is encoded
        return out

    def publish(
        self,
        version: int,
        trainable: Mapping[str, torch.Tensor],
        frozen: Mapping[str, torch.Tensor] | None = None,
        sink: Callable[[Message], None] | None = None,
    ) -> list[Message]:
        """Encode ``trainable`` (and ``frozen`` when given) as ``version``; return the update
        messages (trainable tensors + a non-full commit) to send to in-sync workers. ``sink``
        receives each message as soon as it is encoded (the commit included), so sending
        overlaps encoding."""
        parts = self._parts(version, trainable, sink)
        frozen_parts = self._parts(version, frozen) if frozen is not None else None
        with self._lock:
            self.version = version
            self._trainable_parts, self._trainable_count = parts, len(trainable)
            if frozen_parts is not None:
                self._frozen_parts, self._frozen_count = frozen_parts, len(frozen)
            self._full_cache = None
        commit = pb.CoordinatorMessage(
            model_commit=pb.ModelCommit(
                model_version=version, full=False, num_tensors=len(trainable)
            )
        )
        if sink is not None:
            sink(commit)
        return [*parts, commit]

    def full(self) -> tuple[int, list[Message]]:
        """(version, every tensor + a full commit with the model's sha256) for a resync."""
        with self._lock:
            if self._full_cache is None or self._full_cache[0] != self.version:
                frozen_parts = [
                    part
                    if part.model_part.model_version == self.version
                    else model_part_of(self.version, part.model_part.chunk)
                    for part in self._frozen_parts
                ]
                parts = [*frozen_parts, *self._trainable_parts]
                commit = pb.ModelCommit(
                    model_version=self.version,
                    full=True,
                    num_tensors=self._frozen_count + self._trainable_count,
                    params_sha256=chunks_sha256(m.model_part.chunk for m in parts),
                )
                self._full_cache = (
                    self.version,
                    [*parts, pb.CoordinatorMessage(model_commit=commit)],
                )
            return self._full_cache
