# SPDX-License-Identifier: Apache-2.0
"""The scheduler asks the workers how much of a prefix the pool holds.

Worker rank 0 (per data-parallel rank) serves :class:`PoolLookupRequest` on a
ZeroMQ socket (``ipc://`` under vLLM's RPC base path, named after the engine
id and DP rank so instances on one machine never collide); the scheduler's
:class:`LookupClient` asks it with a deadline. Messages are msgspec structs
in core's wire format: nothing is unpickled. A lookup that fails or times
out is a miss, and the client then stops asking for a while (a dead worker
side must not cost every scheduling step a timeout).

When the scheduler and the lookup rank share a process (vLLM's in-process
executor: one device, or ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), the client
calls the server's handler directly: no encoding, no socket and no hop to the
server thread, which under load costs the scheduler milliseconds per lookup.
The socket keeps serving other processes. The handler is the worker's
lookup, which never raises for a store failure (the worker's store guard
turns it into a miss at once); an exception it does raise is a miss here, as
over the socket.

With vLLM's hybrid KV cache manager on, the scheduler asks instead which blocks the pool
holds in each KV cache group (:class:`PoolGroupLookupRequest`): a hit is then the longest
prefix every group can serve, which the scheduler works out from the answer
(:func:`~.hybrid.hybrid_hit`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable

from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient, RpcServer
from vllm_ascend.distributed.kv_transfer.core.errors import (
    PeerTimeoutError,
    RemoteError,
    WireFormatError,
)
from vllm_ascend.distributed.kv_transfer.core.retry import RetryGuard
from vllm_ascend.distributed.kv_transfer.core.wire import Codec, Message

logger = logging.getLogger(__name__)


class PoolLookupRequest(Message):
    """How many leading tokens of these blocks does the pool hold?"""

    hashes: list[str]
    #: tokens covered by ``hashes`` (the last block may be partial)
    token_end: int


class PoolLookupReply(Message):
    """Leading tokens held by the pool (0 on a miss)."""

    hit_tokens: int


class PoolGroupLookupRequest(Message):
    """Which of these blocks does the pool hold, in each of these KV cache groups?"""

    hashes: list[str]
    #: vLLM's KV cache group indices
    groups: list[int]


class PoolGroupLookupReply(Message):
    """Per group asked (in order), per hash: whether the pool holds that block."""

    present: list[list[bool]]


#: KV cache groups one lookup may ask about
MAX_GROUPS = 64

#: the lookup of one group (``handler(hashes, token_end) -> hit tokens``)
Handler = Callable[[list[str], int], int]
#: the lookup of several groups (``handler(hashes, groups) -> present[group][block]``)
GroupHandler = Callable[[list[str], list[int]], list[list[bool]]]

_LookupMessage = PoolLookupRequest | PoolLookupReply | PoolGroupLookupRequest | PoolGroupLookupReply

LOOKUP_CODEC: Codec[_LookupMessage] = Codec(
    (PoolLookupRequest, PoolLookupReply, PoolGroupLookupRequest, PoolGroupLookupReply),
    max_size=4 << 20)


def lookup_endpoint(engine_id: str, dp_rank: int, port: int = 0,
                    base_path: str | None = None) -> str:
    """``ipc://`` path of the lookup socket of one engine and DP rank."""
    if base_path is None:
        try:
            import vllm.envs as envs

            base_path = envs.VLLM_RPC_BASE_PATH
        except Exception:  # vLLM missing (tools): fall back to the temp dir
            base_path = tempfile.gettempdir()
    # Unix socket paths are limited to ~107 bytes: name the socket by a short digest.
    digest = hashlib.sha256(f"{engine_id}|{port}|{dp_rank}".encode()).hexdigest()[:20]
    name = f"askv_lookup_{digest}"
    path = os.path.join(base_path, name)
    if len(path) > 100:
        path = os.path.join(tempfile.gettempdir(), name)
    return f"ipc://{path}"


#: The lookup servers of this process by endpoint, with the pid that created them (a forked
#: child never calls its parent's handler).
_IN_PROCESS: dict[str, tuple[int, Handler, GroupHandler | None]] = {}
_IN_PROCESS_LOCK = threading.Lock()


def in_process_handler(endpoint: str) -> Handler | None:
    """The handler of this process's lookup server at ``endpoint``, if there is one."""
    with _IN_PROCESS_LOCK:
        entry = _IN_PROCESS.get(endpoint)
    if entry is None or entry[0] != os.getpid():
        return None
    return entry[1]


def in_process_group_handler(endpoint: str) -> GroupHandler | None:
    """The group handler of this process's lookup server at ``endpoint``, if there is one."""
    with _IN_PROCESS_LOCK:
        entry = _IN_PROCESS.get(endpoint)
    if entry is None or entry[0] != os.getpid():
        return None
    return entry[2]


class LookupServer:
    """Answers lookups with ``handler(hashes, token_end) -> hit tokens``.

    Args:
        endpoint: socket to bind.
        handler: the worker's lookup.
        group_handler: the worker's lookup of several KV cache groups (hybrid KV cache
            manager); without it such a lookup is answered with an error (a miss).
    """

    def __init__(self, endpoint: str, handler: Handler,
                 group_handler: GroupHandler | None = None) -> None:
        self._handler = handler
        self._group_handler = group_handler
        # an ipc:// socket file left by a dead engine with the same id is removed, a live
        # engine's raises EndpointInUseError (RpcServer)
        self._server = RpcServer(endpoint, LOOKUP_CODEC, self._answer,
                                 name="ascend-store-lookup").start()
        self.endpoint = self._server.endpoint
        with _IN_PROCESS_LOCK:
            _IN_PROCESS[self.endpoint] = (os.getpid(), handler, group_handler)

    def _answer(self, request: Message) -> Message:
        if isinstance(request, PoolGroupLookupRequest):
            if self._group_handler is None:
                raise TypeError("this lookup server has no KV cache groups")
            groups = list(request.groups)
            if len(set(groups)) != len(groups) or len(groups) > MAX_GROUPS or any(
                    g < 0 for g in groups):
                raise ValueError(f"groups must be at most {MAX_GROUPS} distinct indices, got "
                                 f"{groups[:8]}")
            present = self._group_handler(list(request.hashes), list(request.groups))
            return PoolGroupLookupReply(present=[[bool(p) for p in row] for row in present])
        if not isinstance(request, PoolLookupRequest):
            raise TypeError(f"expected PoolLookupRequest, got {type(request).__name__}")
        if request.token_end < 0:
            raise ValueError(f"token_end must be >= 0, got {request.token_end}")
        return PoolLookupReply(hit_tokens=int(self._handler(list(request.hashes),
                                                        request.token_end)))

    def close(self) -> None:
        """Stop serving and remove the socket file."""
        with _IN_PROCESS_LOCK:
            entry = _IN_PROCESS.get(self.endpoint)
            if entry is not None and entry[1] is self._handler:
                del _IN_PROCESS[self.endpoint]
        self._server.stop()  # removes its socket file, if still its own


class LookupClient:
    """The scheduler's side of the lookup.

    Args:
        endpoint: the worker's lookup socket.
        timeout_s: deadline of one lookup.
        retry_interval_s: after a failure, lookups are misses for this long.
        clock: monotonic time source (tests).
        in_process: call the handler of a lookup server of this process directly (default);
            ``False`` always goes through the socket (tests of the wire).
    """

    def __init__(self, endpoint: str, *, timeout_s: float = 5.0, retry_interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, in_process: bool = True) -> None:
        self.endpoint = endpoint
        self.in_process = in_process
        self.timeout_s = timeout_s
        self.retry_interval_s = retry_interval_s
        self._client: RpcClient[_LookupMessage] = RpcClient(
            endpoint, LOOKUP_CODEC, timeout_s=timeout_s)
        self.guard = RetryGuard(retry_interval_s, clock)

    @property
    def failures(self) -> int:
        """Lookups that failed since creation."""
        return self.guard.trips

    def lookup(self, hashes: list[str], token_end: int) -> int:
        """Leading tokens of ``hashes`` in the pool; 0 when the worker side cannot answer."""
        if not hashes:
            return 0
        if not self.guard.available():
            return 0
        local = in_process_handler(self.endpoint) if self.in_process else None
        if local is not None:
            return self._lookup_in_process(local, hashes, token_end)
        try:
            reply = self._client.call(PoolLookupRequest(hashes=hashes, token_end=token_end))
        except (PeerTimeoutError, RemoteError, WireFormatError) as exc:
            self.guard.trip()
            logger.warning("pool lookup at %s failed (%s); lookups are misses for %.1fs",
                           self.endpoint, exc, self.retry_interval_s)
            return 0
        if not isinstance(reply, PoolLookupReply):
            logger.warning("pool lookup at %s: unexpected reply %s", self.endpoint,
                           type(reply).__name__)
            return 0
        return max(0, min(int(reply.hit_tokens), token_end))

    def lookup_groups(self, hashes: list[str], groups: list[int]) -> list[list[bool]]:
        """Per group, per hash: whether the pool holds that block; all ``False`` when the
        worker side cannot answer (a miss)."""
        miss = [[False] * len(hashes) for _ in groups]
        if not hashes or not groups or not self.guard.available():
            return miss
        local = in_process_group_handler(self.endpoint) if self.in_process else None
        try:
            if local is not None:
                present = local(list(hashes), list(groups))
            else:
                reply = self._client.call(PoolGroupLookupRequest(hashes=hashes, groups=groups))
                if not isinstance(reply, PoolGroupLookupReply):
                    logger.warning("pool lookup at %s: unexpected reply %s", self.endpoint,
                                   type(reply).__name__)
                    return miss
                present = reply.present
        except Exception as exc:  # as for one group: a failed lookup is a miss
            self.guard.trip()
            logger.warning("pool lookup at %s failed (%s); lookups are misses for %.1fs",
                           self.endpoint, exc, self.retry_interval_s)
            return miss
        if len(present) != len(groups) or any(len(row) != len(hashes) for row in present):
            logger.warning("pool lookup at %s: answer of the wrong shape", self.endpoint)
            return miss
        return [[bool(p) for p in row] for row in present]

    def _lookup_in_process(self, handler: Handler, hashes: list[str],
                           token_end: int) -> int:
        """The lookup by a direct call of the server's handler (same process)."""
        try:
            hit = int(handler(list(hashes), token_end))
        except Exception as exc:  # as over the socket: a failed lookup is a miss
            self.guard.trip()
            logger.warning("pool lookup at %s failed (%s); lookups are misses for %.1fs",
                           self.endpoint, exc, self.retry_interval_s)
            return 0
        return max(0, min(hit, token_end))

    def close(self) -> None:
        """Close the socket."""
        self._client.close()
