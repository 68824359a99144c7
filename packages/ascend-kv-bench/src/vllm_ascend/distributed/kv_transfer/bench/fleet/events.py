# SPDX-License-Identifier: Apache-2.0
"""KV cache events of a simulated instance, in vLLM's wire format.

What ``vllm serve --kv-events-config '{"publisher": "zmq", ...}'`` sends
(``vllm.distributed.kv_events.ZmqEventPublisher``): on a PUB socket, frames
``(topic, seq, payload)``, ``seq`` an 8-byte big-endian counter from 0, ``payload`` a msgpack
``KVEventBatch`` (an array ``[ts, events, data_parallel_rank]``; each event a map tagged
``type``: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``; vLLM's default 64-bit
integer block hashes). A ROUTER replay socket answers ``(identity, b"", start_seq)`` with
every buffered batch from ``start_seq`` on as ``(identity, b"", topic, seq, payload)``, then
``(identity, b"", b"", -1, b"")``.

The classes below mirror vLLM's (same tags, field names and order, ``omit_defaults``), so
the bench does not need vLLM to publish; the tests decode them with vLLM's own classes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Batches kept for replay (vLLM's ``buffer_steps`` default).
BUFFER_STEPS = 10_000
MEDIUM_GPU = "GPU"


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """vLLM's ``BlockStored``: blocks of one request stored, chained from ``parent``."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """vLLM's ``BlockRemoved``: blocks evicted."""

    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """vLLM's ``AllBlocksCleared``: the cache was reset."""


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's ``KVEventBatch``: one engine step's events."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class Publisher:
    """One instance's PUB socket and ROUTER replay socket, both bound on ``host``.

    Args:
        ctx: the fleet's ZeroMQ context (asyncio).
        host: the address bound.
        topic: the topic frame (vLLM's default: empty).
    """

    def __init__(self, ctx: zmq.asyncio.Context, host: str = "127.0.0.1",
                 topic: str = "") -> None:
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._pub.setsockopt(zmq.LINGER, 0)
        port = self._pub.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._replay = ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        rport = self._replay.bind_to_random_port(f"tcp://{host}")
        self.replay_endpoint = f"tcp://{host}:{rport}"
        self._topic = topic.encode()
        self._seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=BUFFER_STEPS)
        self._enc = msgspec.msgpack.Encoder()
        self._task: asyncio.Task[None] | None = None
        self.published = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._serve_replay())

    def publish(self, events: list[Any]) -> None:
        """One batch, now (a PUB send never waits: past the high-water mark it drops, as
        vLLM's does, and the subscriber sees a gap it replays)."""
        if not events:
            return
        payload = self._enc.encode(KVEventBatch(time.time(), events, 0))
        seq, self._seq = self._seq, self._seq + 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload),
                                     flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        self.published += 1

    async def _serve_replay(self) -> None:
        while True:
            frame = await self._replay.recv_multipart()
            if len(frame) != 3:
                continue
            ident, _, start = frame
            first = int.from_bytes(start, "big")
            for seq, buf in list(self._buffer):
                if seq >= first:
                    await self._replay.send_multipart(
                        (ident, b"", self._topic, seq.to_bytes(8, "big"), buf))
            await self._replay.send_multipart((ident, b"", b"", END_SEQ, b""))

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._pub.close(linger=0)
        self._replay.close(linger=0)
