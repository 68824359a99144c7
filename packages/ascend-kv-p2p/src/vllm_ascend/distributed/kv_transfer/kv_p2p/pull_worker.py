# SPDX-License-Identifier: Apache-2.0
"""Worker side of ``MooncakeConnectorV1`` (decode pulls).

P worker: registers its KV cache with the transfer engine and serves a
side channel (one ZeroMQ socket a worker rank). Every request the scheduler
holds for D is a lease: D's ``Claim`` and ``Renew`` extend it, D's ``Done``
(from every expected reader) releases it, and a lease that lapses frees the
blocks anyway, reported exactly once through ``get_finished``. P only
answers a ``Claim`` for blocks it holds for that very request.

D worker: pulls each request on a thread pool: handshake with every P rank it
needs (cached, with the compatibility check), ``Claim``, one batched read
through the transfer engine, ``Done``. With enough CPUs the claims go out on
claim threads while the pull thread reads; the read's data is then used only
when every claim was accepted at its first try, otherwise it is read again
under the accepted claims (see :meth:`PullWorker._pull`). Every request ends
exactly once, as loaded or as failed; a failed request's blocks go to
``get_block_ids_with_load_errors`` so vLLM recomputes or fails it per
``kv_load_failure_policy``; a request still loading at its deadline is
failed at the deadline, except that its blocks go back to vLLM only once no
read into them is in flight (the transfer engine cannot cancel a read, and a
late one would overwrite blocks vLLM gave to another request).
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm_ascend.distributed.kernels import gather_blocks, scatter_blocks
from vllm_ascend.distributed.kv_transfer.core.channel import RpcServer, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig
from vllm_ascend.distributed.kv_transfer.core.errors import (
    KVTransferError,
    PeerTimeoutError,
    RemoteError,
    TransferError,
)
from vllm_ascend.distributed.kv_transfer.core.leases import LeaseTable
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.wire import ErrorReply, Message

from .errors import HandshakeMismatchError, RemoteKVUnavailable
from .protocol import (
    CODEC,
    AgentMeta,
    Claim,
    ClaimOK,
    Done,
    DoneAck,
    GetMeta,
    Renew,
    RenewReply,
    compatibility_problem,
    worker_port,
)
from .pull_scheduler import MooncakeConnectorMetadata, RecvMeta
from .tp_plan import PullSlice, plan_pulls, readers_per_p_rank
from .worker_base import P2PWorkerBase, heads_in_block

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

#: How many released request ids P remembers (to tell "freed" from "never had").
_RELEASED_MEMORY = 16384
#: How long D retries a Claim that P answers "unknown request" (P may not have the
#: request's metadata yet: it arrives with P's next engine step).
CLAIM_RETRY_S = 10.0
#: How long P's side channel waits for a request's registration before answering "unknown".
CLAIM_WAIT_S = 0.2
#: CPUs this process may run on from which D overlaps its claims with the read. The
#: transfer engine's synchronous read busy-waits for completion on the pull thread (one
#: CPU), the transport moves the bytes on its own threads (and, over TCP, the kernel copies
#: them), and the claim needs a thread and ZeroMQ's I/O thread: with fewer CPUs the claim
#: only slows the read down (measured on 2 CPUs: 1-block loads ~10% slower overlapped).
OVERLAP_MIN_CPUS = 4


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class Held:
    """Blocks P holds for one request."""

    block_ids: list[int]
    readers_expected: int = 1
    readers_done: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Claimed:
    """P rank's answer to a claim D sent."""

    #: P accepted the first ``Claim`` sent (no "unknown request" retry)
    first_try: bool
    #: ``time.monotonic()`` when the accepted ``Claim`` was sent; P renewed the lease to a
    #: full ``lease_ttl_s`` when it answered, which is later
    sent_at: float


@dataclass
class Pending:
    """A D request being loaded."""

    meta: RecvMeta
    deadline: float
    #: a transfer-engine read into the request's blocks is in flight
    reading: bool = False
    #: the deadline passed during a read: the load fails once the read has returned
    expired: bool = False


class PullWorker(P2PWorkerBase):
    """Worker-side logic of the pull connector (both roles)."""

    def __init__(self, vllm_config: VllmConfig, cfg: MooncakeP2PConfig, engine_id: str,
                 recorder: MetricsRecorder, *, tp_rank: int | None = None,
                 pp_rank: int | None = None) -> None:
        super().__init__(vllm_config, cfg, engine_id, recorder, codec=CODEC, tp_rank=tp_rank,
                         pp_rank=pp_rank)
        # ---- P state
        self.held: LeaseTable[str, Held] = LeaseTable(cfg.lease_ttl_s, name="p2p-held")
        self._released: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._finished_sending: set[str] = set()
        self._send_lock = threading.Lock()
        # signalled when the scheduler's metadata registers new held requests
        self._held_cv = threading.Condition()
        self.server: RpcServer[Message] | None = None
        # ---- D state
        self._pool = ThreadPoolExecutor(max_workers=cfg.num_recv_workers,
                                        thread_name_prefix="p2p-pull")
        # Done messages sent after a load was reported (keeps them off the pull threads)
        self._notify = ThreadPoolExecutor(max_workers=1, thread_name_prefix="p2p-done")
        #: send the claims on claim threads while the pull thread reads (else claim first)
        self.overlap_claims = usable_cpus() >= OVERLAP_MIN_CPUS
        # the claim threads (started on demand)
        self._claims = ThreadPoolExecutor(max_workers=4 * cfg.num_recv_workers,
                                          thread_name_prefix="p2p-claim")
        self._pending: dict[str, Pending] = {}
        self._done_recving: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._recv_lock = threading.Lock()
        # notified (under _recv_lock) whenever a load ends: see wait_loads
        self._recv_ended = threading.Condition(self._recv_lock)
        # (P's TP size, MLA) -> this rank's pull plan and the readers of each P rank
        self._plans: dict[tuple[int, bool], tuple[tuple[PullSlice, ...], Mapping[int, int]]] = {}

    # ================================================================ set-up
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Describe the cache, register it with the transfer engine, start the side channel."""
        self._register_kv_memory(kv_caches)
        assert self.layout is not None
        if self.is_producer:
            self.server = RpcServer(tcp_endpoint(self.host, self.port), CODEC, self._handle,
                                    name=f"p2p-side-channel-{self.port}").start()
            logger.info("P side channel on %s (engine %s, %d layers, %d blocks)",
                        self.server.endpoint, self.engine_id, self.layout.num_layers,
                        self.layout.num_blocks)

    def shutdown(self) -> None:
        """Stop serving, stop pulling, release the registered KV memory."""
        if self.server is not None:
            self.server.stop()
            self.server = None
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._claims.shutdown(wait=True)
        self._notify.shutdown(wait=True)
        self._release_resources()

    # ================================================================ P side
    def _handle(self, msg: Message) -> Message:
        """Side-channel handler (runs on the server thread)."""
        if isinstance(msg, GetMeta):
            assert self.meta is not None
            return self.meta
        if isinstance(msg, Claim):
            return self._on_claim(msg)
        if isinstance(msg, Renew):
            return RenewReply(held=[r for r in msg.request_ids if self.held.renew(r)])
        if isinstance(msg, Done):
            return self._on_done(msg)
        return ErrorReply(code="unsupported", message=f"{type(msg).__name__} is not a request")

    def _on_claim(self, msg: Claim) -> Message:
        held = self.held.get(msg.request_id)
        if held is None:
            # D can be faster than P's next engine step, which registers the request:
            # wait a little for it instead of making D retry.
            deadline = time.monotonic() + CLAIM_WAIT_S
            with self._held_cv:
                while held is None and time.monotonic() < deadline:
                    self._held_cv.wait(max(0.0, deadline - time.monotonic()))
                    held = self.held.get(msg.request_id)
        if held is None:
            with self._send_lock:
                released = msg.request_id in self._released
            code = "released" if released else "unknown_request"
            why = ("was already freed (read, released or its lease lapsed)" if released
                   else "is not held here")
            return ErrorReply(code=code, message=f"request {msg.request_id!r} {why}")
        extra = sorted(set(msg.block_ids) - set(held.block_ids))
        if extra:
            return ErrorReply(code="bad_blocks",
                              message=f"request {msg.request_id!r} does not hold blocks {extra[:8]}"
                                      f"{'...' if len(extra) > 8 else ''}")
        # D reads the blocks P returned in kv_transfer_params, minus those of its own prefix
        # hit: a suffix of that list, in its order. Anything else (the request's own blocks
        # reordered, repeated, or a middle slice) would put KV at the wrong token positions.
        n = len(msg.block_ids)
        if n > len(held.block_ids) or (n and list(msg.block_ids) != held.block_ids[-n:]):
            return ErrorReply(
                code="bad_blocks",
                message=f"request {msg.request_id!r}: the block ids asked for are not the last "
                        f"{n} of the {len(held.block_ids)} it holds, in order (they must be "
                        "the remote_block_ids P returned, minus D's cached prefix)")
        held.readers_expected = max(1, msg.num_readers)
        self.held.renew(msg.request_id)
        return ClaimOK(lease_s=self.cfg.lease_ttl_s)

    def _on_done(self, msg: Done) -> Message:
        held = self.held.get(msg.request_id)
        if held is None:
            self.recorder.inc("p2p_late_completions")
            return DoneAck(valid=False)
        held.readers_expected = max(held.readers_expected, msg.num_readers)
        held.readers_done.add(msg.reader)
        if len(held.readers_done) < held.readers_expected:
            return DoneAck(valid=msg.request_id in self.held)
        if self.held.complete(msg.request_id) is None:
            return DoneAck(valid=False)  # expired between the two calls
        self._release(msg.request_id)
        if msg.success:
            self.recorder.inc("p2p_requests_served")
        return DoneAck(valid=True)

    def _release(self, request_id: str) -> None:
        with self._send_lock:
            self._finished_sending.add(request_id)
            self._released[request_id] = None
            while len(self._released) > _RELEASED_MEMORY:
                self._released.popitem(last=False)

    def _collect_sending(self) -> set[str]:
        for rid, _held in self.held.expire():
            logger.warning("request %s: no Done from D within the %.1fs lease; freeing its "
                           "blocks", rid, self.cfg.lease_ttl_s)
            self.recorder.inc("p2p_expired_leases")
            self._release(rid)
        self.recorder.set("p2p_held_requests", len(self.held))
        with self._send_lock:
            out, self._finished_sending = self._finished_sending, set()
        return out

    # ================================================================ D side
    def start_load_kv(self, metadata: MooncakeConnectorMetadata) -> None:
        """Register P's new held requests and start D's pulls."""
        for send in metadata.requests_to_send.values():
            try:
                # held for the D instance(s) the request goes to; which D is known only
                # once it claims, so the owner names the request's readers
                self.held.add(send.request_id, Held(list(send.block_ids)),
                              owner=f"readers of {send.request_id}")
            except KeyError:
                logger.warning("request %s is already held; ignoring a duplicate",
                               send.request_id)
        if metadata.requests_to_send:
            with self._held_cv:
                self._held_cv.notify_all()
        now = time.monotonic()
        for meta in metadata.requests.values():
            if meta.release_only:
                if meta.remote is not None:
                    self._pool.submit(self._release_remote, meta)
                continue
            with self._recv_lock:
                self._pending[meta.request_id] = Pending(meta, now + self.cfg.load_timeout_s)
            if meta.error is not None or meta.remote is None:
                self._fail(meta, f"bad kv_transfer_params: {meta.error}", cause="bad_params")
                continue
            self._pool.submit(self._pull, meta)

    def _end_locked(self, meta: RecvMeta, *, ok: bool) -> bool:
        """Hand the request back to vLLM (caller holds ``_recv_lock``); False if it already
        ended."""
        if self._pending.pop(meta.request_id, None) is None:
            return False  # already ended (deadline passed, or a duplicate): ignore
        self._done_recving.add(meta.request_id)
        if not ok:
            self._failed_blocks.update(meta.local_block_ids)
        self._recv_ended.notify_all()
        return True

    def wait_loads(self, request_ids: Iterable[str], timeout: float | None = None) -> bool:
        """Block until none of ``request_ids`` (already passed to :meth:`start_load_kv`) is
        still loading: each ended, loaded or failed, and the next :meth:`get_finished` reports
        it. False on timeout. For benchmarks and tests; vLLM polls ``get_finished``."""
        ids = list(request_ids)
        with self._recv_ended:
            return self._recv_ended.wait_for(
                lambda: not any(r in self._pending for r in ids), timeout)

    def _finish(self, meta: RecvMeta, *, ok: bool, reason: str = "", cause: str = "") -> None:
        """End a load exactly once (success or failure); later calls are ignored."""
        with self._recv_lock:
            if not self._end_locked(meta, ok=ok):
                return
        self._report_end(meta, ok=ok, reason=reason, cause=cause)

    def _report_end(self, meta: RecvMeta, *, ok: bool, reason: str, cause: str) -> None:
        if ok:
            self.recorder.inc("p2p_requests_loaded")
        else:
            self.recorder.inc("p2p_failures", cause=cause or "error")
            logger.error("request %s: KV load from P failed (%s): %s; its %d blocks are "
                         "reported for recompute/failure", meta.request_id, cause, reason,
                         len(meta.local_block_ids))

    def _fail(self, meta: RecvMeta, reason: str, *, cause: str) -> None:
        self._finish(meta, ok=False, reason=reason, cause=cause)

    def remote_meta(self, host: str, port: int, *, expect_tp: int) -> AgentMeta:
        """P rank's metadata, fetched once and checked against this instance."""
        return self._peer_meta(host, port, peer="P", problem_of=lambda m: (
            self.compatibility_problem(m, expect_tp=expect_tp)))

    def compatibility_problem(self, remote: AgentMeta, *, expect_tp: int) -> str:
        """Why P's cache cannot be read into ours, naming both sides' values; '' if it can."""
        assert self.meta is not None
        return compatibility_problem(self.meta, remote, expect_tp=expect_tp,
                                     configured_tp=self.cfg.prefill.tp_size)

    def _pull(self, meta: RecvMeta) -> None:
        """Load one request (pool thread). Every path ends in :meth:`_finish`.

        With :attr:`overlap_claims` the claims and the read overlap: each P rank's
        ``Claim`` goes out on a claim thread while this thread reads (the transfer engine
        releases the GIL while it moves bytes); otherwise every claim is accepted before
        the read starts, as the first check below requires anyway. Why the data of a read
        that may have started before its claims were answered can be trusted, and when it
        cannot:

        * P's scheduler holds the request's blocks continuously from the moment P
          finished the request (before its ``kv_transfer_params`` reached D, so before
          this read started) until D's ``Done`` or a lapsed lease; only then does P
          free them (and remember the id as released).
        * A claim accepted at its first try proves P still held the blocks for that
          request when it answered (request ids are unique, and P accepts only block ids
          it holds for that request), so they were held from before the read started until
          the answer, and the answer renewed the lease to a full ``lease_ttl_s`` from a
          moment after the claim was sent. A read that ended before
          ``sent_at + lease_ttl_s / 2`` (checked below, as before the overlap) therefore
          read the request's KV.
        * A claim that was refused, or answered "unknown request" and accepted only on a
          retry, proves nothing about the time of the read ("unknown" also means a P that
          restarted or forgot the id): that read's data is never used. A failed claim
          fails the request (P's error decides the cause); a claim accepted after a retry
          makes this thread read again, after every claim was accepted.
        * The claims are always awaited before the request ends, so every rank that
          accepted one gets ``Done(success=False)`` on failure, and ``_begin_read`` /
          ``_end_read`` keep the blocks from vLLM while any read into them can land.
        """
        assert meta.remote is not None and self.layout is not None and self.te is not None
        remote = meta.remote
        start = time.perf_counter()
        claimed: list[int] = []
        readers: Mapping[int, int] = {}
        p_ranks: list[int] = []
        loaded = False
        try:
            plan, readers = self._tp_plan(remote.tp_size)
            p_ranks = sorted({s.p_rank for s in plan})
            metas = {r: self.remote_meta(remote.host, self._port_of(remote, r),
                                         expect_tp=remote.tp_size) for r in p_ranks}
            overlapped = self.overlap_claims
            claims = self._start_claims(meta, p_ranks, readers, overlapped=overlapped)
            nbytes = 0
            try:
                if not any(f.done() and f.exception() is not None for f in claims.values()):
                    nbytes = self._read_all(meta, metas, plan, p_ranks)
            finally:
                # Never end with a claim in flight; a claim error replaces a read error
                # (P's refusal says more than the failed read of blocks it does not hold).
                first_try, claimed_at = self._await_claims(claims, claimed)
            if overlapped and not first_try:
                logger.info("request %s: a claim was accepted only after a retry; reading "
                            "again under the accepted claims", meta.request_id)
                nbytes = self._read_all(meta, metas, plan, p_ranks)
            if time.monotonic() - claimed_at < self.cfg.lease_ttl_s / 2:
                # The leases were held for the whole read: the data is the request's. P
                # learns it can free the blocks off the critical path, once the load was
                # reported (below).
                claimed.clear()
                valid = loaded = True
            else:
                # A slow read: only P can tell whether the lease outlived it.
                valid = all(self._done(meta, r, readers[r], success=True) for r in p_ranks)
                claimed.clear()
            if not valid:
                raise RemoteKVUnavailable("P freed the blocks before the read finished (lease "
                                          "lapsed); the data read cannot be trusted",
                                          code="lease_lapsed")
        except HandshakeMismatchError as exc:
            self._fail(meta, str(exc), cause="handshake_mismatch")
        except RemoteKVUnavailable as exc:
            self._fail(meta, str(exc), cause=exc.code)
        except PeerTimeoutError as exc:
            self._fail(meta, f"P did not answer: {exc}", cause="peer_timeout")
        except TransferError as exc:
            self._fail(meta, str(exc), cause="transfer")
        except Exception as exc:  # never leave a request waiting forever
            logger.exception("request %s: unexpected error while pulling KV", meta.request_id)
            self._fail(meta, f"{type(exc).__name__}: {exc}", cause="internal")
        else:
            elapsed = time.perf_counter() - start
            self.recorder.inc("p2p_transfer_bytes", nbytes)
            self.recorder.observe("p2p_transfer_seconds", elapsed)
            self.recorder.observe("p2p_transfer_request_bytes", nbytes)
            self._finish(meta, ok=True)
            if loaded:
                self._notify.submit(self._done_quietly, meta, p_ranks, readers)
        finally:
            for r in claimed:  # give P its blocks back early after a failure
                try:
                    self._done(meta, r, readers.get(r, 1), success=False)
                except KVTransferError:
                    pass
            self._release_unread(meta)

    def _tp_plan(self, p_tp: int) -> tuple[tuple[PullSlice, ...], Mapping[int, int]]:
        """This rank's slices to read from a P instance of TP size ``p_tp``, and how many D
        ranks read each P rank; computed once per P TP size (shared: never modify)."""
        is_mla = bool(self.layout and self.layout.is_mla)
        key = (p_tp, is_mla)
        cached = self._plans.get(key)
        if cached is None:
            plan = tuple(plan_pulls(self.total_kv_heads, p_tp, self.tp_size, self.tp_rank,
                                    is_mla=is_mla))
            readers = readers_per_p_rank(self.total_kv_heads, p_tp, self.tp_size, is_mla=is_mla)
            cached = self._plans[key] = (plan, readers)
        return cached

    def _start_claims(self, meta: RecvMeta, p_ranks: list[int], readers: Mapping[int, int], *,
                      overlapped: bool) -> dict[int, Future[Claimed]]:
        """Claim the request on every P rank: on the claim threads (``overlapped``), or here,
        one after the other, stopping at the first that fails."""
        if overlapped:
            return {r: self._claims.submit(self._claim, meta, r, readers[r]) for r in p_ranks}
        out: dict[int, Future[Claimed]] = {}
        for r in p_ranks:
            fut: Future[Claimed] = Future()
            out[r] = fut
            try:
                fut.set_result(self._claim(meta, r, readers[r]))
            except Exception as exc:  # raised by _await_claims
                fut.set_exception(exc)
                break
        return out

    def _read_all(self, meta: RecvMeta, metas: dict[int, AgentMeta],
                  plan: Sequence[PullSlice], p_ranks: list[int]) -> int:
        """Read every P rank's slices into the local blocks; returns bytes. The blocks are
        written by the transfer engine: they must not go back to vLLM while a read into them
        can still land (see :meth:`_collect_recving`)."""
        if not self._begin_read(meta):
            raise RemoteKVUnavailable("the load ended (deadline) before its read started",
                                      code="deadline")
        nbytes = 0
        try:
            for r in p_ranks:
                nbytes += self._read(meta, metas[r], [s for s in plan if s.p_rank == r])
        finally:
            wanted = self._end_read(meta)
        if not wanted:
            raise RemoteKVUnavailable("the deadline passed during the read", code="deadline")
        return nbytes

    def _await_claims(self, claims: dict[int, Future[Claimed]],
                      claimed: list[int]) -> tuple[bool, float]:
        """Wait for every claim; ranks that accepted go to ``claimed`` (they are owed a
        ``Done``). Returns whether every claim was accepted at its first try, and when the
        earliest accepted claim was sent. Raises the first claim's error."""
        error: Exception | None = None
        first_try, sent_at = True, math.inf
        for r, fut in claims.items():
            try:
                answer = fut.result()
            except Exception as exc:  # re-raised below, once every claim is in
                error = error or exc
                continue
            claimed.append(r)
            first_try = first_try and answer.first_try
            sent_at = min(sent_at, answer.sent_at)
        if error is not None:
            raise error
        return first_try, sent_at if claimed else time.monotonic()

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
        "unknown request" (its metadata may not have arrived yet), within the deadline."""
        remote = meta.remote
        assert remote is not None
        client = self._client(remote.host, self._port_of(remote, p_rank))
        msg = Claim(request_id=remote.request_id, block_ids=meta.remote_block_ids,
                    reader=self.agent_id, num_readers=num_readers)
        give_up = time.monotonic() + CLAIM_RETRY_S
        delay = 0.01
        first_try = True
        while True:
            sent_at = time.monotonic()
            try:
                reply = client.call(msg)
            except RemoteError as exc:
                if exc.code == "unknown_request" and time.monotonic() < min(
                        give_up, self._deadline(meta)):
                    time.sleep(delay)
                    delay = min(delay * 2, 0.5)
                    first_try = False
                    continue
                raise RemoteKVUnavailable(f"P rank {p_rank} refused the claim: {exc}",
                                          code=exc.code) from exc
            if not isinstance(reply, ClaimOK):
                raise RemoteKVUnavailable(f"unexpected claim reply {type(reply).__name__}")
            return Claimed(first_try=first_try, sent_at=sent_at)

    def _begin_read(self, meta: RecvMeta) -> bool:
        """Mark a read into the request's blocks as in flight; False when the load already
        ended (its blocks may belong to another request by now: never read into them)."""
        with self._recv_lock:
            pending = self._pending.get(meta.request_id)
            if pending is None or pending.expired:
                return False
            pending.reading = True
            return True

    def _end_read(self, meta: RecvMeta) -> bool:
        """The read returned; True when the load is still wanted. A load whose deadline
        passed during the read ends now, as failed at its deadline."""
        with self._recv_lock:
            pending = self._pending.get(meta.request_id)
            if pending is None:
                return False
            pending.reading = False
            if not pending.expired:
                return True
            self._end_locked(meta, ok=False)
        self._report_end(meta, ok=False, cause="deadline",
                         reason=f"no KV within the {self.cfg.load_timeout_s:.1f}s deadline "
                                "(released once the read in flight at the deadline returned)")
        return False

    def _deadline(self, meta: RecvMeta) -> float:
        with self._recv_lock:
            pending = self._pending.get(meta.request_id)
        return pending.deadline if pending else 0.0

    def _done(self, meta: RecvMeta, p_rank: int, num_readers: int, *, success: bool) -> bool:
        remote = meta.remote
        assert remote is not None
        client = self._client(remote.host, self._port_of(remote, p_rank))
        reply = client.call(Done(request_id=remote.request_id, reader=self.agent_id,
                                 success=success, num_readers=num_readers))
        return isinstance(reply, DoneAck) and reply.valid

    def _read(self, meta: RecvMeta, remote: AgentMeta, slices: list[PullSlice]) -> int:
        """Read this rank's slices of P rank ``remote`` into the local blocks; returns bytes."""
        assert self.layout is not None and self.te is not None
        local_regions = self.layout.regions
        if len(remote.region_addrs) != len(local_regions):
            raise HandshakeMismatchError(
                f"P has {len(remote.region_addrs)} KV regions, D has {len(local_regions)}")
        self.layout.check_block_ids(meta.local_block_ids, what="local block ids")
        p_blocks = remote.layout.num_blocks
        for b in meta.remote_block_ids:
            if not 0 <= b < p_blocks:
                raise RemoteKVUnavailable(f"remote block id {b} is outside P's cache "
                                          f"[0, {p_blocks})", code="bad_blocks")
        local_addrs: list[int] = []
        remote_addrs: list[int] = []
        lengths: list[int] = []
        staged: list[tuple[int, PullSlice]] = []
        for i, region in enumerate(local_regions):
            r_len = remote.layout.block_lens[i]
            r_base, r_stride = remote.region_addrs[i], remote.region_strides[i]
            for sl in slices:
                if region.head_axis is None or (sl.num_heads == heads_in_block(region)
                                                and r_len == region.block_len):
                    off_l = off_r = 0
                    length = region.block_len
                elif region.head_axis == 0:
                    per_head = region.block_len // heads_in_block(region)
                    off_l, off_r = sl.local_offset * per_head, sl.remote_offset * per_head
                    length = sl.num_heads * per_head
                else:
                    staged.append((i, sl))
                    continue
                for lb, rb in zip(meta.local_block_ids, meta.remote_block_ids, strict=True):
                    local_addrs.append(region.base_addr + lb * region.block_stride + off_l)
                    remote_addrs.append(r_base + rb * r_stride + off_r)
                    lengths.append(length)
        moved = self.te.read(remote.session, local_addrs, remote_addrs, lengths)
        if staged:
            moved += self._read_staged(meta, remote, staged)
        return moved

    def _read_staged(self, meta: RecvMeta, remote: AgentMeta,
                     staged: list[tuple[int, PullSlice]]) -> int:
        """Heads that are not contiguous in a block (NPU layout): read P's whole blocks into a
        staging buffer, then copy the head slices into the local blocks."""
        assert self.layout is not None and self.te is not None
        regions = self.layout.regions
        n = len(meta.local_block_ids)
        moved = 0
        local_ids = torch.tensor(meta.local_block_ids, dtype=torch.long)
        for i, sl in staged:
            region = regions[i]
            heads_p = remote.layout.block_lens[i] // (region.block_len // heads_in_block(region))
            shape = list(region.block_shape)
            shape[region.head_axis or 0] = heads_p
            buf = torch.empty((n, *shape), dtype=region.tensor.dtype, device=region.tensor.device)
            nbytes = buf[0].numel() * buf.element_size()
            self.te.register_memory(buf.data_ptr(), buf.numel() * buf.element_size())
            try:
                moved += self.te.read(
                    remote.session, [buf.data_ptr() + k * nbytes for k in range(n)],
                    [remote.region_addrs[i] + rb * remote.region_strides[i]
                     for rb in meta.remote_block_ids], [nbytes] * n)
            finally:
                self.te.unregister_memory(buf.data_ptr())
            # head resharding with ascend-kernels' block ops (NPU fast paths on NPU): the
            # local blocks out, this P rank's head slice in, the blocks back
            axis = (region.head_axis or 0) + 1
            src = buf.narrow(axis, sl.remote_offset, sl.num_heads)
            dst = gather_blocks(region.tensor, local_ids)
            dst.narrow(axis, sl.local_offset, sl.num_heads).copy_(src)
            scatter_blocks(dst, region.tensor, local_ids)
        return moved

    def _release_remote(self, meta: RecvMeta) -> None:
        """Tell every P rank it can free a request D will not read (best effort)."""
        remote = meta.remote
        assert remote is not None
        plan, readers = self._tp_plan(remote.tp_size)
        for r in sorted({s.p_rank for s in plan}):
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
        _plan, readers = self._tp_plan(remote.tp_size)
        for r in range(remote.tp_size):
            if r in readers or r % self.tp_size != self.tp_rank:
                continue
            try:
                self._done(meta, r, 1, success=True)
            except KVTransferError as exc:
                logger.info("could not release request %s on unread P rank %d: %s",
                            remote.request_id, r, exc)

    def _collect_recving(self) -> set[str]:
        now = time.monotonic()
        ended: list[Pending] = []
        reading: list[Pending] = []
        with self._recv_lock:
            for p in list(self._pending.values()):
                if p.deadline > now or p.expired:
                    continue
                if p.reading:
                    # The transfer engine cannot cancel a read, and a stalled one can still
                    # complete (a network that comes back): the blocks stay with the request
                    # until the read returns, then it fails (_end_read). Mooncake bounds the
                    # stall by MC_TCP_PROGRESS_TIMEOUT_SEC.
                    p.expired = True
                    reading.append(p)
                elif self._end_locked(p.meta, ok=False):
                    # a pull that has not started reading never will (_begin_read)
                    ended.append(p)
        if ended or reading:
            self.recorder.inc("p2p_load_deadlines", len(ended) + len(reading))
        for p in ended:
            self._report_end(p.meta, ok=False, cause="deadline",
                             reason=f"no KV within the {self.cfg.load_timeout_s:.1f}s deadline")
        for p in reading:
            logger.warning("request %s: no KV within the %.1fs deadline; a read is still in "
                           "flight, the request fails once it returned", p.meta.request_id,
                           self.cfg.load_timeout_s)
        with self._recv_lock:
            out, self._done_recving = self._done_recving, set()
            self.recorder.set("p2p_pending_loads", len(self._pending))
        return out

    # ================================================================ vLLM hooks
    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        sending = self._collect_sending() if self.is_producer else set()
        recving = self._collect_recving() if self.is_consumer else set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._recv_lock:
            out, self._failed_blocks = self._failed_blocks, set()
        return out


