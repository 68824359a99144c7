# SPDX-License-Identifier: Apache-2.0
"""D's reads started on vLLM's thread (``inline_reads``) and polled to their end.

A read within P's read window (:mod:`.contract`) needs no claim: D can start it at
once. On the pull threads that costs two hand-offs between threads (to the pull thread,
and from it back to the one waiting for the load), each a wake-up and a turn of the GIL:
on the 2-CPU machine they were most of the gap between a one-block load and a raw read of
the same bytes. With ``inline_reads`` the worker's ``start_load_kv`` submits such a read
itself (:meth:`~vllm_ascend.distributed.kv_transfer.core.transfer_engine.MooncakeTransferEngine.submit_read`:
never blocks) and ``get_finished`` polls it; vLLM's engine step is never held by the
transfer, however long it stalls.

Only the plainest load takes this path, every other one goes to the pull threads
(:class:`~.reader.PullReader`, which starts these reads, polls them, and takes back those
that cannot end here), before or after its read:

* taken: P's metadata already known with its regions (an unkeyed P: a keyed P's blocks are
  where its claim's grant says, so its loads are claimed first), of the engine start
  that holds the request, inside the window now, every P rank read by some D rank, no
  pipeline stages, no heads to stage, the P rank not read from its memory on this host, and
  at most :data:`INLINE_MAX_RANGES` byte ranges once ranges adjacent on both sides are
  merged (small loads, or blocks consecutive on both P and D: where the hand-offs count);
* after the read: within the window, the load ends loaded (as a window read on the threads
  does); a read that ended after the window, or failed, is done again on the pull threads
  from the start (claimed first once the window is over), whose data replaces this one's
  (a failed read only where ``read_retry`` allows a retry: with ``attempts`` 1 the load
  fails, as a read on the pull threads would);
* the blocks stay with the load until every range of the read ended (``begin_read`` /
  ``end_read``), as on the threads; a load past its deadline ends then, failed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.errors import TransferError
from vllm_ascend.distributed.kv_transfer.core.transfer_engine import PendingTransfer

from ..worker_base import P2PWorkerBase
from .contract import RecvMeta, read_until, same_instance
from .loads import LoadTracker
from .peers import PeerRanks
from .transfer import AddressPlans, LoadBlocks, check_remote_blocks

logger = logging.getLogger(__name__)

#: a read of more byte ranges goes to the pull threads: each range is a transfer-engine
#: batch of its own (:mod:`~vllm_ascend.distributed.kv_transfer.core.transfer_polling` says
#: why), which costs vLLM's thread about 5 us to submit (8 ranges: 42-49 us on 2 CPUs), and
#: from a few blocks on the transfer dominates the load anyway (with 1,024 ranges, 128
#: blocks of 8 layers, the load measured 0.95-0.96 of the raw read inline against 0.97-0.98
#: on the pull threads)
INLINE_MAX_RANGES = 64
#: how long :meth:`~.reader.PullReader.wait_inline` sleeps between two polls (seconds). The kernel
#: adds the thread's timer slack (50 us by default) and a virtual machine its timer's cost:
#: ``time.sleep(50e-6)`` took 136 us on the 2-CPU machine (``sleep(0)`` 82 us), so a read's
#: end is seen up to that late on an idle step (``wait_loads`` polls without sleeping)
POLL_SLEEP_S = 50e-6


@dataclass
class InlineRead:
    """One load's read in flight."""

    meta: RecvMeta
    #: one per P rank read
    parts: list[PendingTransfer]
    #: the end of P's read window (``time.time()``)
    until: float
    p_ranks: list[int]
    readers: Mapping[int, int]
    started: float


@dataclass
class Ended:
    """The reads that ended at one :meth:`InlineReads.poll`, by what their caller does next
    (a load that ended failed here is counted only)."""

    #: ended within P's window: the load is loaded once its ``Done`` is owed to P
    loaded: list[InlineRead] = field(default_factory=list)
    #: to be pulled again, from the start, on the pull threads
    again: list[RecvMeta] = field(default_factory=list)
    #: reads that ended, all outcomes
    count: int = 0


class InlineReads:
    """The reads started on the caller's thread (vLLM's), and their ends.

    Args:
        shared: the worker's transfer engine, KV cache layout, config and metrics.
        loads: where each load's deadline and end are kept.
        peers: D's knowledge of P's ranks (head plans, metadata, regions): only what it has
            already is used here, no side-channel call.
        plans: where each P rank's slices go (the pull threads' plans, shared).
    """

    def __init__(self, shared: P2PWorkerBase, loads: LoadTracker, peers: PeerRanks,
                 plans: AddressPlans) -> None:
        self.shared = shared
        self.loads = loads
        self.peers = peers
        self.plans = plans
        self._lock = threading.Lock()
        self._inflight: dict[str, InlineRead] = {}

    def __len__(self) -> int:
        return len(self._inflight)

    # ------------------------------------------------------------ start
    def start(self, meta: RecvMeta) -> bool:
        """Start the load's read here if it takes this path (see the module); False: it
        goes to the pull threads (nothing was started). Never raises: this is vLLM's
        thread (what went wrong is the pull thread's to find and report)."""
        try:
            planned = self._plan(meta)
        except Exception:
            logger.debug("request %s: no inline read", meta.request_id, exc_info=True)
            return False
        if planned is None or not self.loads.begin_read(meta):
            return False  # begin_read: ended already (the pull thread finds that out too)
        until, p_ranks, readers, ranges = planned
        te = self.shared.te
        assert te is not None
        started = time.perf_counter()
        parts: list[PendingTransfer] = []
        why = ""
        for session, loc, rem, lens in ranges:
            try:
                part = te.submit_read(session, loc, rem, lens, merged=True)
            except Exception as exc:  # nothing of this range went out
                part, why = None, f"{type(exc).__name__}: {exc}"
            if part is None:
                break
            parts.append(part)
        if not parts:  # nothing in flight: the pull thread reads it all
            self.loads.end_read(meta)
            return False
        if len(parts) < len(ranges):  # some went out: end it as a failed read
            parts.append(_failed(te, why or "the transfer engine took only part of the read"))
        self.shared.recorder.inc("p2p_inline_reads")
        with self._lock:
            self._inflight[meta.request_id] = InlineRead(meta, parts, until, p_ranks, readers,
                                                         started)
        return True

    def _plan(self, meta: RecvMeta) -> tuple[float, list[int], Mapping[int, int], list[
            tuple[str, list[int], list[int], list[int]]]] | None:
        """The window's end, the P ranks, their readers and the ranges (session, local,
        remote, lengths; merged) of each P rank, if the load takes this path; ``None``
        otherwise. Raises on what the pull thread reports (a head plan that does not fit,
        block ids outside a cache).

        P's window tag is not checked here: D's scheduler checked it when it parsed the
        params and its verdict, the window's end, comes in ``meta.window_until``
        (:func:`~.contract.read_until`; checked here only for a load the scheduler did not
        judge). A verdict can only be stale by time, never by params (it depends on the
        params alone): the window's end is compared with the clock here, before the read
        goes out, and again when it ended (:meth:`_end`); a read that ends after it is
        claimed and read again on the pull threads, as before.
        """
        s = self.shared
        remote = meta.remote
        if (remote is None or meta.claimed_ahead or s.te is None or s.layout is None
                or getattr(s, "p_stages", None)
                or len(meta.local_block_ids) != len(meta.remote_block_ids)):
            return None
        until = read_until(remote, meta.window_until)
        if time.time() >= until:
            return None
        plan, readers = self.peers.head_plan(remote.tp_size)
        p_ranks = sorted({sl.remote_rank for sl in plan})
        if len(readers) < remote.tp_size * s.cfg.prefill.pp_size:
            return None  # a P rank nobody reads is released by the pull thread
        metas = self.peers.cached_metas(remote, p_ranks)
        if metas is None:
            return None
        early = self.peers.known_regions(metas)
        if early is None or not same_instance(remote, early):
            return None
        blocks = LoadBlocks(meta.local_block_ids, meta.remote_block_ids)
        # blocks consecutive on both sides make one range a region where a range is a whole
        # block: a cheap count of runs first (a bound from below), the ranges after
        if len(blocks.runs) * len(s.layout.regions) * len(early) > INLINE_MAX_RANGES:
            return None
        s.layout.check_block_ids(meta.local_block_ids, what="local block ids")
        ranges: list[tuple[str, list[int], list[int], list[int]]] = []
        count = 0
        for rank, m in early.items():
            if s.te.is_local_peer(m.session):
                return None
            check_remote_blocks(meta, m)  # raises: the pull thread reports it
            rank_plan = self.plans.get(s.layout, m, rank, plan, None)
            count += rank_plan.direct.count(blocks)
            if rank_plan.staged or count > INLINE_MAX_RANGES:
                return None
            ranges.append((m.session, *rank_plan.direct.ranges(blocks)))
        return until, p_ranks, readers, ranges

    # ------------------------------------------------------------ poll
    def poll(self) -> Ended:
        """The reads that ended since the last call: a read that failed past a retry
        (``read_retry``) ends its load here, failed; the others are the caller's to end
        (:class:`Ended`)."""
        out = Ended()
        if not self._inflight:
            return out
        ended: list[tuple[InlineRead, int, Exception | None]] = []
        with self._lock:
            for rid, read in list(self._inflight.items()):
                nbytes, error = 0, None  # type: int, TransferError | None
                for part in read.parts:
                    try:
                        got = part.poll()
                    except TransferError as exc:
                        error = error or exc
                        continue
                    if got is None:
                        break
                    nbytes += got
                else:
                    del self._inflight[rid]
                    ended.append((read, nbytes, error))
        for read, nbytes, err in ended:
            self._end(read, nbytes, err, out)
        out.count = len(ended)
        return out

    def _end(self, read: InlineRead, nbytes: int, error: Exception | None,
             out: Ended) -> None:
        meta = read.meta
        if not self.loads.end_read(meta):
            return  # its deadline passed during the read: ended as failed by end_read
        if error is None and time.time() <= read.until:
            # read within the window: P held the blocks for the whole read (no claim)
            rec = self.shared.recorder
            rec.inc("p2p_window_reads")
            rec.inc("p2p_transfer_bytes", nbytes)
            rec.observe("p2p_transfer_seconds", time.perf_counter() - read.started)
            rec.observe("p2p_transfer_request_bytes", nbytes)
            out.loaded.append(read)
            return
        if error is not None:
            if self.shared.cfg.read_retry.retries == 0:
                self.loads.fail(meta, f"KV read from P failed ({error}); read_retry allows no "
                                      "retry", cause="transfer")
                return
            self.shared.recorder.inc("p2p_read_retries", reason="transfer")
            logger.warning("request %s: KV read from P failed (%s); pulled again on a pull "
                           "thread", meta.request_id, error)
        else:
            logger.info("request %s: its read ended after P's read window; claimed and read "
                        "again on a pull thread", meta.request_id)
        out.again.append(meta)


def block_runs(meta: RecvMeta) -> int:
    """How many runs of blocks consecutive on both sides (local and P's ids each one more
    than the last, in local order) the load's blocks make: its ranges a region once
    coalesced, where a range is a whole block."""
    return len(LoadBlocks(meta.local_block_ids, meta.remote_block_ids).runs)


def _failed(te: Any, why: str) -> PendingTransfer:
    """A read that failed before anything of it went out."""
    part = PendingTransfer(te, "", 0)
    part.error = why
    return part
