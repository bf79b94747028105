"""The collective toolkit over a real gloo group of three ranks (threads of this process, a real
TCPStore): the failure count and the byte broadcast with a header."""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist
from userdp.proto import gloo
from userdp.proto.collectives import broadcast_bytes, failure_count

RANKS = 3
TIMEOUT_S = 60.0
"""Bounds a collective whose peer died; these move a few bytes between threads."""


def _on_every_rank(body):
    """``body(group, rank)`` on each rank of one gloo group; the ranks' results in rank order."""
    master = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    transport = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")

    def run(rank):
        # a connection of its own: a rank waiting in the store must not hold up the others
        store = gloo.client_store("127.0.0.1", master.port, TIMEOUT_S)
        group = gloo.group(store, "test/", rank, RANKS, TIMEOUT_S, transport)
        return body(group, rank)

    with ThreadPoolExecutor(RANKS) as pool:
        return list(pool.map(run, range(RANKS)))


def test_every_rank_learns_how_many_ranks_failed():
    assert _on_every_rank(lambda group, rank: failure_count(rank == 2, group)) == [1, 1, 1]
    assert _on_every_rank(lambda group, rank: failure_count(False, group)) == [0, 0, 0]


def test_bytes_and_their_header_reach_every_rank():
    payload = bytes(range(256)) * 3

    def body(group, rank):
        header, data = broadcast_bytes(
            payload if rank == 0 else None, group=group, header=(7, 1) if rank == 0 else (0, 0)
        )
        return header, bytes(data.numpy())

    assert _on_every_rank(body) == [([7, 1], b"")] + [([7, 1], payload)] * (RANKS - 1)


def test_a_source_without_bytes_sends_only_its_header():
    def body(group, rank):
        header, data = broadcast_bytes(None, group=group, header=(7, 0) if rank == 0 else (0, 0))
        return header, data.numel()

    assert _on_every_rank(body) == [([7, 0], 0)] * RANKS


def test_a_tensor_is_sent_as_its_bytes():
    values = torch.arange(5, dtype=torch.float32)

    def body(group, rank):
        _, data = broadcast_bytes(values if rank == 0 else None, group=group)
        return data.view(torch.float32).tolist() if rank else None

    assert _on_every_rank(body)[1:] == [values.tolist()] * (RANKS - 1)
