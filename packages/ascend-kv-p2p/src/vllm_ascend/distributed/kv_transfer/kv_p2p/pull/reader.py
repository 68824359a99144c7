# SPDX-License-Identifier: Apache-2.0
"""D side of ``MooncakeConnectorV1``: the puller.

D pulls each request on a thread pool: handshake with every P rank it needs
(cached, with the compatibility check), ``Claim``, one batched read through the
transfer engine (:mod:`.transfer`), ``Done``. What D knows of P's ranks and the calls to
their side channel are :class:`~.peers.PeerRanks`'. With enough CPUs the claims go
out on claim threads while the pull thread reads; the read's data is then used
only when every claim was accepted at its first try, otherwise it is read again
under the accepted claims (see :meth:`PullReader._pull`). How each load ends is
kept by :class:`~.loads.LoadTracker`. A keyed P's load is claimed before it is read: its
blocks' addresses come with the claim's grant only (or with the answer of the claim D's
scheduler sent ahead).

A read that stalls or drops (Mooncake's TCP transport fails a transfer without progress
for ``MC_TCP_PROGRESS_TIMEOUT_SEC``: rc=-1), or a side-channel call to a P starved of CPU
that times out, does not fail the request while its deadline leaves time: the pull is
tried again (as ``read_retry`` says: 8 times at most, with back-off) on a fresh session: P's
metadata fetched again, every P rank claimed again before the read (which renews the
lease and proves P still holds the blocks), and the read issued as a new transfer (a
new connection: the transport dropped the stalled one). Only a deadline, a lease P let go
(the claim is refused) or the last retry fail the request.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from vllm_ascend.distributed.kernels.heads import HeadSlice
from vllm_ascend.distributed.kv_transfer.core.device import usable_cpus
from vllm_ascend.distributed.kv_transfer.core.errors import (
    KVTransferError,
    PeerTimeoutError,
    TransferError,
)

from ..errors import HandshakeMismatchError, RemoteKVUnavailable
from ..protocol import AgentMeta
from ..worker_base import P2PWorkerBase
from .contract import ClaimInbox, RecvMeta, read_until, same_instance
from .inline import POLL_SLEEP_S, InlineReads
from .loads import LoadTracker
from .peers import Claimed, PeerRanks, accepted_ahead, grants_moved, refused_ahead
from .transfer import AddressPlans, read_request

logger = logging.getLogger(__name__)

#: CPUs this process may run on from which D overlaps its claims with the read. The
#: transfer engine's synchronous read busy-waits for completion on the pull thread (one
#: CPU), the transport moves the bytes on its own threads (and, over TCP, the kernel copies
#: them), and the claim needs a thread and ZeroMQ's I/O thread: with fewer CPUs the claim
#: only slows the read down (measured on 2 CPUs: 1-block loads ~10% slower overlapped).
OVERLAP_MIN_CPUS = 4
#: How long a pull of a request claimed ahead waits for the answers that carry a keyed P's
#: block addresses (else it claims before it reads), or, with fewer
#: than :data:`OVERLAP_MIN_CPUS`, for an answer from a scheduler in this process, before it
#: reads (and claims itself after the read if the answer is still not in).
AHEAD_WAIT_S = 0.05


class PullReader:
    """D's pulls: claims on P's ranks, reads, retries, and the ``Done`` that frees P.

    Args:
        shared: the worker's identity, KV cache registration, peers and handshake.
        loads: where each load's deadline and end are kept.

    Attributes:
        peers: what D knows of P's ranks, and the calls to them.
        plans: where each P rank's slices go (kept per P rank's metadata and head plan).
        inbox: the answers of the claims D's scheduler sent ahead.
        inline: window reads started on the caller's thread (``inline_reads``; ``None``:
            off).
    """

    def __init__(self, shared: P2PWorkerBase, loads: LoadTracker) -> None:
        self.shared = shared
        self.loads = loads
        cfg = shared.cfg
        self._pool = ThreadPoolExecutor(max_workers=cfg.num_recv_workers,
                                        thread_name_prefix="p2p-pull")
        # Done messages sent after a load was reported (keeps them off the pull threads)
        self._notify = ThreadPoolExecutor(max_workers=1, thread_name_prefix="p2p-done")
        # the Done owed for each load that ended loaded, sent once vLLM collected the load
        # (send_owed): sent at its end, its thread held the GIL while vLLM's woke for it
        self._owed: deque[tuple[RecvMeta, list[int], Mapping[int, int]]] = deque()
        #: send the claims on claim threads while the pull thread reads (else claim first)
        self.overlap_claims = usable_cpus() >= OVERLAP_MIN_CPUS
        # the claim threads (started on demand)
        self._claims = ThreadPoolExecutor(max_workers=4 * cfg.num_recv_workers,
                                          thread_name_prefix="p2p-claim")
        self.peers = PeerRanks(shared, loads)
        self.inbox = ClaimInbox(shared.engine_id)
        self.plans = AddressPlans()
        self.inline: InlineReads | None = self.new_inline_reads() if cfg.inline_reads else None

    def new_inline_reads(self) -> InlineReads:
        """Reads started on the caller's thread over this reader's P ranks and plans
        (:mod:`.inline`; polled by :meth:`poll_inline`)."""
        return InlineReads(self.shared, self.loads, self.peers, self.plans)

    def start(self, requests: Iterable[RecvMeta]) -> None:
        """Start the pulls (and the releases) of the scheduler's new requests."""
        now = time.monotonic()
        for meta in requests:
            if meta.release_only:
                if meta.remote is not None:
                    self._pool.submit(self.peers.release_remote, meta)
                continue
            self.loads.add(meta, now)
            if meta.error is not None or meta.remote is None:
                self.loads.fail(meta, f"bad kv_transfer_params: {meta.error}", cause="bad_params")
                if meta.release_on_error and meta.remote is not None:
                    self._pool.submit(self.peers.release_remote, meta)
                continue
            if self.inline is not None and self.inline.start(meta):
                continue
            if meta.claimed_ahead:
                self.inbox.expect(meta.request_id, meta.early_claims)
            self._pool.submit(self._pull, meta)

    def pull_later(self, meta: RecvMeta) -> None:
        """Pull a load on the pull threads from the start (an inline read that failed or
        ended after P's read window: :mod:`.inline`)."""
        self._pool.submit(self._pull, meta)

    # ------------------------------------------------------------ inline reads
    def poll_inline(self) -> int:
        """End the reads started on the caller's thread that ended since the last call
        (``inline_reads``: vLLM's thread, in ``get_finished``): a read within P's window
        ends its load loaded (its ``Done`` owed), another goes to the pull threads; how
        many ended."""
        if self.inline is None or not len(self.inline):
            return 0
        ended = self.inline.poll()
        for read in ended.loaded:
            self.owe_done(read.meta, read.p_ranks, read.readers)
            self.loads.finish(read.meta, ok=True)
        for meta in ended.again:
            self.pull_later(meta)
        return ended.count

    def wait_inline(self, timeout: float, stop: Callable[[], bool]) -> None:
        """Poll the inline reads for up to ``timeout`` seconds, until ``stop()`` (checked
        after each poll), sleeping :data:`~.inline.POLL_SLEEP_S` between polls (an idle
        engine step's wait)."""
        end = time.monotonic() + timeout
        while self.inline is not None and len(self.inline):
            self.poll_inline()
            if stop() or time.monotonic() >= end:
                return
            time.sleep(POLL_SLEEP_S)

    def _drain_inline(self, timeout: float) -> None:
        """Wait for every inline read in flight to end (shutdown: the memory it reads into
        stays registered until then); logs what is still in flight after ``timeout``."""
        end = time.monotonic() + timeout
        while self.inline is not None and len(self.inline) and time.monotonic() < end:
            self.poll_inline()
            time.sleep(POLL_SLEEP_S)
        if self.inline is not None and len(self.inline):
            logger.warning("%d reads still in flight at shutdown after %.1fs",
                           len(self.inline), timeout)

    def owe_done(self, meta: RecvMeta, p_ranks: list[int], readers: Mapping[int, int]) -> None:
        """A load ended loaded: its ``Done`` goes out once vLLM collected it."""
        self._owed.append((meta, p_ranks, readers))

    def send_owed(self) -> None:
        """Send, off this thread, the ``Done`` of every load that ended loaded so far
        (called once vLLM collected the loads: :meth:`PullWorker.get_finished`)."""
        batch = []
        while self._owed:
            batch.append(self._owed.popleft())
        if batch:
            self._notify.submit(self._send_owed, batch)

    def _send_owed(self, batch: list[tuple[RecvMeta, list[int], Mapping[int, int]]]) -> None:
        for meta, p_ranks, readers in batch:
            self.peers.done_quietly(meta, p_ranks, readers)

    def done_sent(self, timeout: float = 10.0) -> None:
        """Send the ``Done`` still owed and wait until every one went out (benchmarks: the
        next measurement does not share the machine with them)."""
        self.send_owed()
        self._notify.submit(lambda: None).result(timeout)

    def shutdown(self) -> None:
        """Stop pulling (queued pulls are dropped); the ``Done`` still owed go out."""
        self.inbox.close()
        if self.inline is not None and self.shared.te is not None:
            self._drain_inline(self.shared.te.stall_bound_s + 5.0)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.send_owed()
        self._claims.shutdown(wait=True)
        self._notify.shutdown(wait=True)

    def _pull(self, meta: RecvMeta) -> None:
        """Load one request (pool thread). Every path ends the load in :attr:`loads`.

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
        * A keyed P names the addresses of the claimed blocks only in a claim's grant, and D
          keeps none past its request: its load is claimed first (no overlap, no window
          read), or read under the answers of the claims sent ahead. Should an accepted
          claim's grant name other addresses than the read used, that read's data (or
          failure) is dropped and the blocks are read again under the grant.
        * The claims are always awaited before the request ends, so every rank that
          accepted one gets ``Done(success=False)`` on failure, and ``begin_read`` /
          ``end_read`` keep the blocks from vLLM while any read into them can land.
        * A request D's scheduler claimed ahead (its ``ClaimAhead``): its accepted answers
          are these claims (sent earlier, so trusted for less of the read); ranks without
          one are claimed after the read, which proves as much (held at that answer and
          continuously since before the read); a refusal means claiming as before.
        * Within P's read window (:mod:`.contract`): read at once; a read ending within
          it needs no claim (P keeps the blocks), a later one is claimed after it, as above.
        * A pull that failed on a stalled or dropped read, or on a side-channel timeout,
          is tried again while the deadline leaves time (:meth:`_retry_delay`): claims
          first, never overlapped, so each retry's read starts under claims P accepted
          after the failure.
        """
        assert meta.remote is not None
        remote = meta.remote
        start = time.perf_counter()
        started = time.monotonic()
        claimed: list[int] = []
        readers: Mapping[int, int] = {}
        p_ranks: list[int] = []
        loaded = False
        try:
            plan, readers = self.peers.head_plan(remote.tp_size)
            p_ranks = sorted({s.remote_rank for s in plan})
            retries = 0
            while True:
                try:
                    nbytes, loaded = self._attempt(meta, plan, readers, p_ranks, claimed,
                                                   fresh=retries > 0)
                    break
                except (TransferError, PeerTimeoutError) as exc:
                    delay = self._retry_delay(meta, retries, started)
                    if delay is None or self.peers.p_gone(remote, p_ranks):
                        raise
                    retries += 1
                    reason = "transfer" if isinstance(exc, TransferError) else "peer_timeout"
                    self.shared.recorder.inc("p2p_read_retries", reason=reason)
                    most = self.shared.cfg.read_retry.retries
                    logger.warning("request %s: KV pull from P failed (%s: %s); retry %d/%s on "
                                   "a fresh session in %.2fs (%.1fs left of the load deadline)",
                                   meta.request_id, reason, exc, retries,
                                   "-" if most is None else most, delay,
                                   self.loads.deadline(meta) - time.monotonic())
                    time.sleep(delay)
                    self.peers.forget_session(remote, p_ranks)
        except HandshakeMismatchError as exc:
            self.loads.fail(meta, str(exc), cause="handshake_mismatch")
        except RemoteKVUnavailable as exc:
            self.loads.fail(meta, str(exc), cause=exc.code)
        except PeerTimeoutError as exc:
            self.loads.fail(meta, f"P did not answer: {exc}", cause="peer_timeout")
        except TransferError as exc:
            self.loads.fail(meta, str(exc), cause="transfer")
        except Exception as exc:  # never leave a request waiting forever
            logger.exception("request %s: unexpected error while pulling KV", meta.request_id)
            self.loads.fail(meta, f"{type(exc).__name__}: {exc}", cause="internal")
        else:
            elapsed = time.perf_counter() - start
            self.shared.recorder.inc("p2p_transfer_bytes", nbytes)
            self.shared.recorder.observe("p2p_transfer_seconds", elapsed)
            self.shared.recorder.observe("p2p_transfer_request_bytes", nbytes)
            if loaded:  # the read is over: the Done may go out any time from now
                self.owe_done(meta, p_ranks, readers)
            self.loads.finish(meta, ok=True)
        finally:
            self.inbox.drop(meta.request_id)
            for r in dict.fromkeys(claimed):  # give P its blocks back early after a failure
                try:
                    self.peers.done(meta, r, readers.get(r, 1), success=False)
                except KVTransferError:
                    pass
            self.peers.release_unread(meta)

    def _attempt(self, meta: RecvMeta, plan: Sequence[HeadSlice], readers: Mapping[int, int],
                 p_ranks: list[int], claimed: list[int], *, fresh: bool) -> tuple[int, bool]:
        """One try of a pull (see :meth:`_pull`): P's metadata, the claims, the read and the
        check that the leases outlived it. Ranks whose claim was accepted go to ``claimed``
        (they are owed a ``Done``; it is emptied once none is). Returns the bytes read and
        whether ``Done`` is still to be sent (the load is reported first).

        Args:
            fresh: a retry: claim every P rank before the read, never overlapped.
        """
        remote = meta.remote
        assert remote is not None
        peers = self.peers
        metas = peers.metas(remote, p_ranks)
        # where to read before the claims are answered (None: a keyed P, whose blocks'
        # addresses come only with the grants; early_grants: those of claims sent ahead)
        early = peers.known_regions(metas)
        early_grants: dict[int, np.ndarray] = {}
        # within P's read window (contract): read at once, claim only a read ending after
        # (P's tag checked once, by D's scheduler: its verdict comes in meta.window_until)
        until = (read_until(remote, meta.window_until)
                 if not (fresh or meta.claimed_ahead) and early is not None
                 and same_instance(remote, early) else -math.inf)
        if time.time() >= until:  # over already: claimed as any other request
            until = -math.inf
        # claimed by D's scheduler (ClaimAhead): read at once, claim only what it could not
        ahead = (meta.claimed_ahead or until > -math.inf) and not fresh
        if meta.claimed_ahead and ahead and not self.overlap_claims and self.inbox.local:
            # few CPUs: a claim answered during the read slows it down; the answer comes
            # from the scheduler in this process within a round trip of its sending
            self.inbox.get(meta.request_id, AHEAD_WAIT_S)
        ahead = ahead and not refused_ahead(self.inbox.get(meta.request_id))
        if ahead and early is None:  # a keyed P: its grants are with the answers
            answers = accepted_ahead(self.inbox.get(meta.request_id, AHEAD_WAIT_S), p_ranks)
            if answers is not None and len(answers) == len(p_ranks):
                try:
                    early_grants, early = peers.grants(meta, metas, answers), metas
                except RemoteKVUnavailable:  # claimed again: that claim's grant decides
                    early_grants = {}
            ahead = early is not None
        overlapped = early is not None and not fresh and (ahead or self.overlap_claims)
        claims = ({} if ahead else
                  self._start_claims(meta, p_ranks, readers, overlapped=overlapped))
        nbytes = 0
        early_error: TransferError | None = None
        read_ok = False
        try:
            if not any(f.done() and f.exception() is not None for f in claims.values()):
                try:
                    # not overlapped: every claim was answered, the grants are in
                    nbytes = (self._read_all(meta, early, plan, early_grants)
                              if overlapped and early is not None else
                              self._read_all(meta, metas, plan,
                                             peers.grants(meta, metas, claims)))
                except TransferError as exc:
                    if not overlapped:
                        raise
                    early_error = exc  # raised below unless the grant moved the regions
            read_ok = True
        finally:
            if ahead:
                # the answers in now; the other ranks are claimed after the read (which
                # proves as much as a claim during it), but only if it did not fail
                claims = accepted_ahead(self.inbox.get(meta.request_id), p_ranks) or {}
                missing = [r for r in p_ranks if r not in claims]
                if read_ok and early_error is None and not claims and time.time() <= until:
                    missing = []  # read within the window: P still held the blocks
                    self.shared.recorder.inc("p2p_window_reads")
                if missing and read_ok:
                    claims.update(self._start_claims(meta, missing, readers, overlapped=False))
            # Never end with a claim in flight; a claim error replaces a read error
            # (P's refusal says more than the failed read of blocks it does not hold).
            first_try, claimed_at = self._await_claims(claims, claimed)
        if overlapped:
            # no claims: read within the window, under the addresses it used
            granted = peers.grants(meta, metas, claims) if claims else early_grants
            moved = grants_moved(early_grants, granted)
            if early_error is not None and not moved:
                raise early_error
            if not first_try or moved:
                logger.info("request %s: a claim was accepted only after a retry, or P's "
                            "grant named other addresses than the read used; reading again "
                            "under the accepted claims", meta.request_id)
                nbytes = self._read_all(meta, metas, plan, granted)
        if time.monotonic() - claimed_at < self.shared.cfg.lease_ttl_s / 2:
            # The leases were held for the whole read: the data is the request's. P
            # learns it can free the blocks off the critical path, once the load was
            # reported (by the caller).
            claimed.clear()
            return nbytes, True
        # A slow read: only P can tell whether the lease outlived it.
        valid = all(peers.done(meta, r, readers[r], success=True) for r in p_ranks)
        claimed.clear()
        if not valid:
            raise RemoteKVUnavailable("P freed the blocks before the read finished (lease "
                                      "lapsed); the data read cannot be trusted",
                                      code="lease_lapsed")
        return nbytes, False

    def _retry_delay(self, meta: RecvMeta, retries: int, started: float) -> float | None:
        """How long to wait before retrying a pull first tried at ``started`` that failed
        after ``retries`` retries; ``None`` when it is not retried (``read_retry``): its
        attempts used up, its deadline passed, or the load's deadline would pass before (or
        right after) the retry starts, or the load already ended."""
        return self.shared.cfg.read_retry.next_delay(
            retries, started=started, until=self.loads.deadline(meta), fit=True)

    def _start_claims(self, meta: RecvMeta, p_ranks: list[int], readers: Mapping[int, int], *,
                      overlapped: bool) -> dict[int, Future[Claimed]]:
        """Claim the request on every P rank: on the claim threads (``overlapped``), or here,
        one after the other, stopping at the first that fails."""
        if overlapped:
            return {r: self._claims.submit(self.peers.claim, meta, r, readers[r])
                    for r in p_ranks}
        out: dict[int, Future[Claimed]] = {}
        for r in p_ranks:
            fut: Future[Claimed] = Future()
            out[r] = fut
            try:
                fut.set_result(self.peers.claim(meta, r, readers[r]))
            except Exception as exc:  # raised by _await_claims
                fut.set_exception(exc)
                break
        return out

    def _read_all(self, meta: RecvMeta, metas: dict[int, AgentMeta],
                  plan: Sequence[HeadSlice], grants: Mapping[int, np.ndarray]) -> int:
        """Read every P rank's slices into the local blocks (a keyed P rank's at its grant's
        addresses, ``grants``); returns bytes. The blocks are
        written by the transfer engine: they must not go back to vLLM while a read into them
        can still land (see :meth:`~.loads.LoadTracker.collect_finished`)."""
        if not self.loads.begin_read(meta):
            raise RemoteKVUnavailable("the load ended (deadline) before its read started",
                                      code="deadline")
        try:
            nbytes = self._read(meta, metas, plan, grants)
        finally:
            wanted = self.loads.end_read(meta)
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

    def _read(self, meta: RecvMeta, remotes: dict[int, AgentMeta],
              plan: Sequence[HeadSlice], grants: Mapping[int, np.ndarray] | None = None) -> int:
        """Read this rank's head slices of every P rank in ``remotes`` into the local blocks
        (a keyed P rank's at the addresses of its grant in ``grants``); returns bytes. (One
        call a read of the request: the fault tests hook it.)"""
        s = self.shared
        assert s.layout is not None and s.te is not None
        return read_request(s.te, s.layout, meta, remotes, plan,
                            stages=getattr(s, "p_stages", None), plans=self.plans,
                            grants=grants)

