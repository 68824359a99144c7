# SPDX-License-Identifier: Apache-2.0
"""D's calls to P's side channel for one request: ``Claim``, ``Done``, the releases of a
request D will not read (or whose P ranks no D rank reads), and the probe that tells a P
that is gone from one that is slow. :class:`PeerCalls` is a part of
:class:`~.pull.reader.PullReader` (the fault and window tests hook its ``_claim``).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterable, Mapping
from typing import Any

from vllm_ascend.distributed.kernels.heads import HeadSlice
from vllm_ascend.distributed.kv_transfer.core.errors import KVTransferError, RemoteError

from ..errors import RemoteKVUnavailable
from ..protocol import Claim, ClaimGrant, ClaimOK, Done, DoneAck, worker_port
from ..worker_base import P2PWorkerBase
from .claims import Claimed
from .contract import RecvMeta
from .loads import LoadTracker

logger = logging.getLogger(__name__)

#: How long D waits for a TCP connection to P's side channel when it checks, before a
#: retry, whether P is still there.
PROBE_TIMEOUT_S = 1.0


class PeerCalls:
    """The side-channel calls of :class:`~.pull.reader.PullReader` (its ``shared`` state,
    its ``loads`` and its head plan)."""

    shared: P2PWorkerBase
    loads: LoadTracker

    def _head_plan(self, p_tp: int) -> tuple[tuple[HeadSlice, ...], Mapping[int, int]]:
        raise NotImplementedError

    def _p_gone(self, remote: Any, p_ranks: Iterable[int]) -> bool:
        """Whether a P rank's side-channel port refuses connections: the process is gone (a
        retry would only wait for timeouts). A P starved of CPU, or stopped, still has its
        connections accepted by the kernel; a cut network times out: both are retried."""
        for r in p_ranks:
            try:
                with socket.create_connection((remote.host_of(r), self._port_of(remote, r)),
                                              timeout=PROBE_TIMEOUT_S):
                    pass
            except ConnectionRefusedError:
                logger.info("P rank %d of request %s refuses connections: not retried", r,
                            remote.request_id)
                return True
            except OSError:
                return False  # no answer (a cut network): the other ranks will not say more
        return False

    def _done_quietly(self, meta: RecvMeta, p_ranks: list[int],
                      readers: Mapping[int, int]) -> None:
        """``Done`` to every P rank read from, after a load already reported loaded."""
        for r in p_ranks:
            try:
                self._done(meta, r, readers[r], success=True)
            except KVTransferError as exc:
                logger.info("Done for request %s to P rank %d failed: %s (its lease will lapse)",
                            meta.request_id, r, exc)

    def _port_of(self, remote: Any, p_rank: int) -> int:
        return worker_port(remote.port, tp_rank=p_rank, tp_size=remote.tp_size)

    def _claim(self, meta: RecvMeta, p_rank: int, num_readers: int) -> Claimed:
        """Claim the request's blocks on one P rank (claim thread); retries while P answers
        "unknown request" (its metadata may not have arrived yet), as ``claim_retry`` says,
        within the load's deadline."""
        remote = meta.remote
        assert remote is not None
        client = self.shared._client(remote.host_of(p_rank), self._port_of(remote, p_rank))
        msg = Claim(request_id=remote.request_id, block_ids=meta.remote_block_ids,
                    reader=self.shared.agent_id, num_readers=num_readers, token=remote.token)
        policy = self.shared.cfg.claim_retry
        started = time.monotonic()
        retries = 0
        while True:
            sent_at = time.monotonic()
            try:
                reply = client.call(msg)
            except RemoteError as exc:
                delay = (policy.next_delay(retries, started=started,
                                           until=self.loads.deadline(meta))
                         if exc.code == "unknown_request" else None)
                if delay is not None:
                    time.sleep(delay)
                    retries += 1
                    continue
                raise RemoteKVUnavailable(f"P rank {p_rank} refused the claim: {exc}",
                                          code=exc.code) from exc
            if isinstance(reply, ClaimGrant):
                return Claimed(first_try=retries == 0, sent_at=sent_at, grant=reply)
            if not isinstance(reply, ClaimOK):
                raise RemoteKVUnavailable(f"unexpected claim reply {type(reply).__name__}")
            return Claimed(first_try=retries == 0, sent_at=sent_at)

    def _done(self, meta: RecvMeta, p_rank: int, num_readers: int, *, success: bool) -> bool:
        remote = meta.remote
        assert remote is not None
        client = self.shared._client(remote.host_of(p_rank), self._port_of(remote, p_rank))
        reply = client.call(Done(request_id=remote.request_id, reader=self.shared.agent_id,
                                 success=success, num_readers=num_readers, token=remote.token))
        return isinstance(reply, DoneAck) and reply.valid

    def _release_remote(self, meta: RecvMeta) -> None:
        """Tell every P rank it can free a request D will not read (best effort)."""
        remote = meta.remote
        assert remote is not None
        plan, readers = self._head_plan(remote.tp_size)
        for r in sorted({s.remote_rank for s in plan}):
            try:
                self._done(meta, r, readers[r], success=False)
            except KVTransferError as exc:
                logger.info("could not release request %s on P rank %d: %s (its lease will "
                            "lapse)", remote.request_id, r, exc)
        self._release_unread(meta)

    def _release_unread(self, meta: RecvMeta) -> None:
        """P ranks no D rank reads (MLA, replicated heads) still hold the request: the D rank
        ``p_rank % d_tp`` releases each of them."""
        remote = meta.remote
        assert remote is not None
        _plan, readers = self._head_plan(remote.tp_size)
        for r in range(remote.tp_size * self.shared.cfg.prefill.pp_size):
            if r in readers or r % self.shared.tp_size != self.shared.tp_rank:
                continue
            try:
                self._done(meta, r, 1, success=True)
            except KVTransferError as exc:
                logger.info("could not release request %s on unread P rank %d: %s",
                            remote.request_id, r, exc)
