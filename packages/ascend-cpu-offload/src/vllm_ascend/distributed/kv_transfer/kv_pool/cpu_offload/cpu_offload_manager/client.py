# SPDX-License-Identifier: Apache-2.0
"""Clients of the metadata server: typed calls, timeouts, and a back-off when it is gone.

The scheduler must never wait on a dead server step after step: after a
failed call the client reports itself unavailable for ``retry_after_s`` (core's
:class:`~vllm_ascend.distributed.kv_transfer.core.retry.RetryGuard`) and
every call in that window fails at once with :class:`ServerUnavailable`; the
scheduler then serves without the host cache (no hits, no saves).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient
from vllm_ascend.distributed.kv_transfer.core.errors import (
    PeerTimeoutError,
    RemoteError,
    WireFormatError,
)
from vllm_ascend.distributed.kv_transfer.core.retry import RetryGuard
from vllm_ascend.distributed.kv_transfer.core.wire import Ack, Message

from ..errors import OffloadError, PoolNotReadyError
from .protocol import (
    Attached,
    GetPool,
    GetStats,
    Lookup,
    LookupReply,
    Pin,
    PinReply,
    PlanReply,
    PlanStep,
    PoolInfo,
    RankGone,
    RegisterRank,
    Reset,
    ResetReply,
    SaveDone,
    SaveRequest,
    StatsReply,
    make_codec,
)

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=Message)


class ServerUnavailable(OffloadError, ConnectionError):
    """The metadata server did not answer (or answered garbage); the call was not done."""


def default_endpoint(engine_id: str, dp_rank: int = 0) -> str:
    """``ipc://<tmp>/vakv-offload-<engine id>-dp<rank>.ipc``: unique per instance and DP rank."""
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)[:64]
    return f"ipc://{os.path.join(tempfile.gettempdir(), f'vakv-offload-{safe}-dp{dp_rank}.ipc')}"


class MetadataClient:
    """Typed requests to the :class:`~.server.MetadataServer`.

    Args:
        endpoint: the server's endpoint.
        timeout_s: timeout of one call.
        retry_after_s: after a failure, calls fail fast for this long.
        clock: monotonic clock (tests).
    """

    def __init__(self, endpoint: str, *, timeout_s: float = 5.0, retry_after_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._rpc: RpcClient[Message] = RpcClient(endpoint, make_codec(), timeout_s=timeout_s)
        self.guard = RetryGuard(retry_after_s, clock)

    @property
    def available(self) -> bool:
        """False while in the back-off window after a failure."""
        return self.guard.available()

    @property
    def failures(self) -> int:
        """Calls that failed since creation."""
        return self.guard.trips

    def _call(self, request: Message, reply_type: type[R], *, timeout_s: float | None = None,
              backoff: bool = True) -> R:
        if backoff and not self.available:
            raise ServerUnavailable(f"offload metadata server {self.endpoint} is unavailable "
                                    "(recent failure; retrying later)")
        try:
            reply = self._rpc.call(request, timeout_s=timeout_s)
        except (PeerTimeoutError, WireFormatError) as exc:
            self._failed(exc)
            raise ServerUnavailable(str(exc)) from exc
        if not isinstance(reply, reply_type):
            exc2 = WireFormatError(f"{self.endpoint} answered {type(request).__name__} with "
                                   f"{type(reply).__name__}, expected {reply_type.__name__}")
            self._failed(exc2)
            raise ServerUnavailable(str(exc2)) from exc2
        self.guard.reset()
        return reply

    def _failed(self, exc: Exception) -> None:
        self.guard.trip()
        logger.warning("offload metadata server %s failed: %s; serving without the host cache "
                       "for %.0fs", self.endpoint, exc, self.retry_after_s)

    # ------------------------------------------------------------------ scheduler
    def lookup(self, hashes: Sequence[bytes]) -> int:
        """Leading cached blocks of a chain."""
        return self._call(Lookup(hashes=list(hashes)), LookupReply).num_blocks

    def pin(self, key: str, hashes: Sequence[bytes], owner: str = "") -> list[int]:
        """Pin the cached prefix of ``hashes``; returns its host block ids."""
        return self._call(Pin(key=key, hashes=list(hashes), owner=owner), PinReply).block_ids

    def plan_step(self, saves: Sequence[SaveRequest], unpin: Sequence[str],
                  owner: str = "") -> PlanReply:
        """Allocate a step's saves and release its pins."""
        return self._call(PlanStep(saves=list(saves), unpin=list(unpin), owner=owner), PlanReply)

    def reset(self) -> int:
        """Drop every unpinned cached block; returns the count."""
        return self._call(Reset(), ResetReply).freed

    def stats(self) -> StatsReply:
        """Pool occupancy and counters."""
        return self._call(GetStats(), StatsReply)

    # ------------------------------------------------------------------ ranks
    def register(self, reg: RegisterRank, *, timeout_s: float = 120.0,
                 poll_s: float = 0.05) -> PoolInfo:
        """Register a rank and wait until the pool exists (every rank registered).

        Raises:
            PoolNotReadyError: not every rank registered within ``timeout_s``.
            RemoteError: the server refused the layout or could not build the pool.
        """
        deadline = time.monotonic() + timeout_s
        info: Any = None
        while True:
            try:
                if info is None:
                    info = self._rpc.call(reg)
                else:
                    info = self._rpc.call(GetPool(rank=reg.rank))
            except PeerTimeoutError:
                # the server thread of rank 0 may not be up yet
                info = None
            if isinstance(info, PoolInfo) and info.ready:
                return info
            if time.monotonic() >= deadline:
                raise PoolNotReadyError(
                    f"rank {reg.rank}: the offload host pool at {self.endpoint} was not ready "
                    f"after {timeout_s:.0f}s (not every one of the {reg.world_size} ranks "
                    "registered)")
            time.sleep(poll_s)

    def attached(self, rank: int) -> None:
        """Tell the server this rank mapped its segment."""
        self._call(Attached(rank=rank), Ack, backoff=False)

    def save_done(self, rank: int, job_ids: Sequence[int], failed: Sequence[int] = ()) -> None:
        """Confirm copied save jobs (``failed``: jobs this rank could not copy)."""
        self._call(SaveDone(rank=rank, job_ids=list(job_ids), failed=list(failed)), Ack,
                   backoff=False)

    def rank_gone(self, rank: int) -> None:
        """This rank is shutting down."""
        try:
            self._call(RankGone(rank=rank), Ack, timeout_s=1.0, backoff=False)
        except (ServerUnavailable, RemoteError):
            pass

    def close(self) -> None:
        """Close the socket."""
        self._rpc.close()
