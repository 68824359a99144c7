# SPDX-License-Identifier: Apache-2.0
"""P side of ``MooncakeLayerwiseConnector``: the links from this P rank to D's ranks.

A request this rank pushes is a :class:`PushSession` with one :class:`PushLink` per
D rank that holds some of this rank's heads (:func:`~.worker_base.head_slices`).
Before its first write to a D rank, P checks D's cache description (``GetMeta``)
and asks for a write lease on exactly the blocks D allocated (``PushBegin``); a
renewer thread keeps the leases alive (``PushRenew``, to every D rank side by side).
Every write starts inside the lease (:func:`write_window_end`). A D that died,
refused, or revoked the lease stops the link, which P reports to D
(``PushDone(success=False)``) when it can. The sender thread
(:mod:`.layerwise.sender`) drives all of this.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

from vllm_ascend.distributed.kernels.heads import HeadSlice
from vllm_ascend.distributed.kv_transfer.core import own_sockets
from vllm_ascend.distributed.kv_transfer.core.errors import (
    KVTransferError,
    RemoteError,
    TransferError,
)
from vllm_ascend.distributed.kv_transfer.core.transfer_engine import MooncakeTransferEngine
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeLayerwiseConfig

from ..errors import HandshakeMismatchError, RemoteKVUnavailable, unknown_request
from ..grants import granted_table
from ..params import PushTarget
from ..protocol import (
    AgentMeta,
    PushBegin,
    PushBlocksGrant,
    PushDone,
    PushDoneAck,
    PushGrant,
    PushRenew,
    PushRenewReply,
    compatibility_problem,
    worker_port,
)
from ..renewer import SideBySide
from ..worker_base import P2PWorkerBase, head_slices, heads_in_block
from .fence import resolve_hosts

logger = logging.getLogger(__name__)

#: P stops writing this fraction of a lease before it runs out (D measures its lease from a
#: later instant, so P's view always ends first).
LEASE_MARGIN = 0.2
#: After a write failed, how long P waits for its kernel to deliver what the transfer engine
#: left queued before it tells D the push's writes are not settled (D then fences).
SETTLE_WAIT_S = 0.5
#: Writes again after a write failed on a connection D shut, none of its bytes on the way
WRITE_RETRIES = 3


def write_window_end(te: MooncakeTransferEngine | None, sent: float, lease_s: float) -> float:
    """Until when P may start a write under a lease D granted after ``sent``.

    D's lease runs ``lease_s`` from a later instant. A write that starts in time can
    still stall in the transfer engine for up to its stall bound before it fails, so P
    stops starting writes that much (and at least ``LEASE_MARGIN`` of the lease) early.
    """
    bound = te.stall_bound_s if te is not None else 30.0
    return sent + max(0.0, lease_s - max(lease_s * LEASE_MARGIN, bound + 0.5))


@dataclass
class PushLink:
    """Pushes of one request from this P rank to one D rank.

    ``slices`` are this P rank's view (:class:`HeadSlice`: "local" is this P rank,
    "remote" the D rank): heads ``[local_offset, +num_heads)`` of P's blocks go to heads
    ``[remote_offset, ...)`` of D's blocks.
    """

    d_rank: int
    port: int
    slices: list[HeadSlice]
    #: new -> granted -> done; granted -> revoked (the renewer was refused) -> done;
    #: any -> broken (the sender gave up and told D) -> done
    state: str = "new"
    reason: str = ""
    meta: AgentMeta | None = None
    valid_until: float = 0.0
    lease_s: float = 0.0
    staging_addrs: list[int] = field(default_factory=list)
    staging_strides: list[int] = field(default_factory=list)
    #: an unkeyed D's region base addresses and strides (from its meta)
    region_addrs: list[int] = field(default_factory=list)
    region_strides: list[int] = field(default_factory=list)
    #: a keyed D's grant: the address of each block of the push (by its slot,
    #: ``PushSession.slot_of``) in each of D's regions; ``None``: an unkeyed D
    block_addrs: list[list[int]] | None = None
    nbytes: int = 0
    #: a write failed in the transfer engine: its bytes may still reach D (TCP delivers what
    #: the engine's closed connection had queued once the network is back)
    write_failed: bool = False


@dataclass
class PushSession:
    """A P request whose KV this rank pushes."""

    request_id: str
    target: PushTarget
    links: list[PushLink]
    #: first block position P pushes (D's cached prefix ends there)
    first_position: int
    #: queued layer tasks that read this request's blocks
    pending: int = 0
    closed: bool = False
    #: ``(group, position)`` -> index of D's block among those pushed (the order of
    #: ``PushBegin``'s blocks and of D's staging buffers)
    slot_of: dict[tuple[int, int], int] = field(default_factory=dict)


@dataclass
class StepItem:
    """One request's blocks of one step: P's ``local_block_ids`` at ``positions`` (of KV
    cache group ``groups[i]``; empty: one group)."""

    session: PushSession
    positions: list[int]
    local_block_ids: list[int]
    last: bool
    groups: list[int] = field(default_factory=list)


def p_side_slices(total_heads: int, p_tp: int, p_rank: int, d_tp: int, d_rank: int, *,
                  is_mla: bool) -> list[HeadSlice]:
    """The head slices P rank ``p_rank`` writes into D rank ``d_rank``, in P's view.

    D's plan (:func:`~.worker_base.head_slices` of the D rank) says which P rank each of
    its heads comes from; P keeps its own slices and swaps the offsets.

    Raises:
        HandshakeMismatchError: the heads do not split over one of the TP sizes.
    """
    return [HeadSlice(d_rank, s.remote_offset, s.local_offset, s.num_heads)
            for s in head_slices(total_heads, p_tp, d_tp, d_rank, is_mla=is_mla)
            if s.remote_rank == p_rank]


class PushLinks:
    """This P rank's push sessions, its leases on D's ranks, and the renewer thread.

    Args:
        shared: the worker's identity, KV cache registration, peers and handshake.
        on_revoked: called (on a renewal thread) when D refused to renew a granted
            lease; the link is ``"revoked"`` and the sender closes it after any write.

    Attributes:
        sessions: the requests this rank pushes, by request id (under ``lock``).
        lock: guards ``sessions`` and every link's state.
    """

    def __init__(self, shared: P2PWorkerBase,
                 on_revoked: Callable[[PushSession, PushLink], None]) -> None:
        assert isinstance(shared.cfg, MooncakeLayerwiseConfig)
        self.shared = shared
        self.cfg: MooncakeLayerwiseConfig = shared.cfg
        self.recorder = shared.recorder
        self.sessions: dict[str, PushSession] = {}
        self.lock = threading.Lock()
        self._on_revoked = on_revoked
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._calls: SideBySide[tuple[str, int, str]] = SideBySide(16, "layerwise-renew")

    def start(self) -> None:
        """Start the renewer thread."""
        self._renewer = threading.Thread(target=self._renew_loop, name="layerwise-renewer",
                                         daemon=True)
        self._renewer.start()

    def stop(self) -> None:
        """Stop the renewer thread."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(5)
        self._calls.stop()

    # ================================================================ sessions
    def open_session(self, rid: str, target: PushTarget) -> PushSession:
        """A new session: a link to each D rank that holds some of this rank's heads."""
        shared = self.shared
        assert shared.layout is not None
        links: list[PushLink] = []
        reason = ""
        try:
            for d in range(target.tp_size):
                mine = p_side_slices(shared.total_kv_heads, shared.tp_size, shared.tp_rank,
                                     target.tp_size, d, is_mla=shared.layout.is_mla)
                if mine:
                    links.append(PushLink(d, worker_port(target.port, tp_rank=d,
                                                         tp_size=target.tp_size), mine))
        except (HandshakeMismatchError, ValueError) as exc:
            reason = str(exc)
        first = target.cached_tokens // shared.block_size
        session = PushSession(rid, target, links, first, slot_of={
            (g, pos): k for k, (g, pos, _) in enumerate(target.pushed(first))})
        if reason:
            logger.error("request %s: cannot plan the push to D: %s", rid, reason)
            session.links = [PushLink(d, worker_port(target.port, tp_rank=d,
                                                     tp_size=target.tp_size),
                                      [], state="broken", reason=reason)
                             for d in range(target.tp_size)]
        return session

    # ================================================================ one link
    def remote_meta(self, host: str, port: int, *, expect_tp: int,
                    engine_id: str = "") -> AgentMeta:
        """D rank's metadata, fetched once and checked against this instance."""
        mine = self.shared.meta
        assert mine is not None
        return self.shared.peer_meta(host, port, peer="D", engine_id=engine_id,
                                     problem_of=lambda m: (
            compatibility_problem(mine, m, expect_tp=expect_tp,
                                  configured_tp=self.cfg.decode.tp_size, me="P", them="D",
                                  verb="receive the KV cache of")))

    def open_link(self, session: PushSession, link: PushLink) -> None:
        """Handshake with the D rank, then ask for a write lease on the request's blocks."""
        shared = self.shared
        assert shared.layout is not None
        target = session.target
        host = target.host_of(link.d_rank)
        link.meta = self.remote_meta(host, link.port, expect_tp=target.tp_size,
                                     engine_id=target.engine_id)
        msg = PushBegin(request_id=target.request_id, sender=shared.agent_id,
                        p_rank=shared.tp_rank, p_tp_size=shared.tp_size,
                        block_ids=[b for _, _, b in target.pushed(session.first_position)],
                        block_lens=[r.block_len for r in shared.layout.regions],
                        token=target.token,
                        te_host=shared.te.hostname if shared.te is not None else "")
        client = shared.client(host, link.port, target.engine_id)
        # D's worker learns of the request with the step after its scheduler posted it to
        # the metaserver: "unknown request" is retried as push_retry says
        try:
            got = self.cfg.push_retry.call(lambda: client.call(msg), retry_if=unknown_request)
        except RemoteError as exc:
            raise RemoteKVUnavailable(f"D rank {link.d_rank} refused the push: {exc}",
                                      code=exc.code) from exc
        reply, sent = got.result, got.sent_at
        if not isinstance(reply, PushGrant):
            raise RemoteKVUnavailable(f"unexpected PushBegin reply {type(reply).__name__}")
        with self.lock:
            link.state = "granted"
            link.lease_s = reply.lease_s
            link.valid_until = write_window_end(shared.te, sent, reply.lease_s)
            link.staging_addrs = list(reply.staging_addrs)
            link.staging_strides = list(reply.staging_strides)
            self._take_addresses(link, reply, len(msg.block_ids))

    def _take_addresses(self, link: PushLink, grant: PushGrant, blocks: int) -> None:
        """Where P writes into D rank ``link``: a keyed D's grant names the address of each
        of the push's ``blocks`` (:mod:`..grants`), an unkeyed D's metadata its regions.

        Raises:
            RemoteKVUnavailable: ``bad_grant``: a keyed D's grant names other addresses than
                those of the push's blocks in each region, or region bases; ``mismatch``: an
                unkeyed D's regions are not this cache's.
        """
        assert link.meta is not None and self.shared.layout is not None
        regions = len(self.shared.layout.regions)
        if isinstance(grant, PushBlocksGrant) or not link.meta.region_addrs:
            if not isinstance(grant, PushBlocksGrant) or grant.region_addrs:
                raise RemoteKVUnavailable(f"D rank {link.d_rank} has a deployment key but its "
                                          "grant does not name the push's blocks",
                                          code="bad_grant")
            link.block_addrs = granted_table(grant.block_addrs, grant.num_regions,
                                             regions=regions, blocks=blocks,
                                             who=f"D rank {link.d_rank}").tolist()
            return
        link.region_addrs = list(link.meta.region_addrs)
        link.region_strides = list(link.meta.region_strides)
        if len(link.region_addrs) != regions or len(link.region_strides) != regions:
            raise RemoteKVUnavailable(f"D rank {link.d_rank} gave {len(link.region_addrs)} "
                                      f"region addresses for {regions} regions",
                                      code="mismatch")

    def renew_link(self, session: PushSession, link: PushLink) -> None:
        """Renew one lease now (the sender is about to write); raises if D refuses."""
        client = self.shared.client(session.target.host_of(link.d_rank), link.port,
                                    session.target.engine_id)
        sent = time.monotonic()
        reply = client.call(PushRenew(request_ids=[session.target.request_id],
                                      sender=self.shared.agent_id,
                                      tokens=[session.target.token]))
        if not (isinstance(reply, PushRenewReply) and session.target.request_id in reply.granted):
            raise RemoteKVUnavailable("D no longer grants the write lease (request ended or "
                                      "failing on D)", code="revoked")
        with self.lock:
            link.valid_until = write_window_end(self.shared.te, sent, link.lease_s)

    def write_layers(self, item: StepItem, link: PushLink, layers: list[tuple[int, int]]) -> int:
        """Write ``layers`` (the layout's layer index and the KV cache group whose blocks of
        it go) of the step's blocks into the D rank, one batch; returns bytes."""
        layout, te = self.shared.layout, self.shared.te
        assert layout is not None and te is not None and link.meta is not None
        d_meta = link.meta
        session = item.session
        regions = layout.regions
        p_blocks = layout.num_blocks
        d_blocks = d_meta.layout.num_blocks
        src: list[int] = []
        dst: list[int] = []
        lengths: list[int] = []
        region_ids: list[tuple[int, int]] = []
        for layer, group in layers:
            first = sum(len(x.regions) for x in layout.layers[:layer])
            region_ids += [(gi, group)
                           for gi in range(first, first + len(layout.layers[layer].regions))]
        groups = item.groups or [0] * len(item.positions)
        for gi, group in region_ids:
            region = regions[gi]
            d_len = d_meta.layout.block_lens[gi]
            granted = link.block_addrs[gi] if link.block_addrs is not None else None
            d_base, d_stride = ((link.region_addrs[gi], link.region_strides[gi])
                                if granted is None else (0, 0))
            staged = bool(link.staging_addrs and link.staging_addrs[gi])
            d_heads = int(d_meta.layout.num_kv_heads)
            for pos, pb, g in zip(item.positions, item.local_block_ids, groups, strict=True):
                if g != group:
                    continue
                if not 0 <= pb < p_blocks:
                    raise IndexError(f"local block id {pb} is outside [0, {p_blocks})")
                db = session.target.d_block(g, pos)
                if db is None:
                    raise RemoteKVUnavailable(f"D keeps no block at position {pos} of KV cache "
                                              f"group {g}", code="bad_blocks")
                if not 0 <= db < d_blocks:
                    raise RemoteKVUnavailable(f"D block id {db} is outside D's cache "
                                              f"[0, {d_blocks})", code="bad_blocks")
                p_addr = region.base_addr + pb * region.block_stride
                if staged:
                    k = session.slot_of[(g, pos)]
                    src.append(p_addr)
                    dst.append(link.staging_addrs[gi] + k * link.staging_strides[gi])
                    lengths.append(region.block_len)
                    continue
                d_addr = (d_base + db * d_stride if granted is None
                          else granted[session.slot_of[(g, pos)]])
                for sl in link.slices:
                    if region.head_axis is None or (sl.num_heads == d_heads
                                                    and d_len == region.block_len):
                        src.append(p_addr)
                        dst.append(d_addr)
                        lengths.append(region.block_len)
                    elif region.head_axis == 0:
                        per_head = region.block_len // heads_in_block(region)
                        src.append(p_addr + sl.local_offset * per_head)
                        dst.append(d_addr + sl.remote_offset * per_head)
                        lengths.append(sl.num_heads * per_head)
                    else:
                        raise HandshakeMismatchError(
                            f"region {gi}: D rank {link.d_rank} gave no staging buffer for "
                            f"heads that are not contiguous in its blocks")
        with self.lock:
            # never write without a lease (the renewer may have been refused meanwhile)
            if link.state != "granted":
                raise RemoteKVUnavailable("D revoked the write lease", code="revoked")
            if time.monotonic() >= link.valid_until:
                raise RemoteKVUnavailable("the write lease ran out", code="lease_lapsed")
        # A connection D shut (its fence of another push, a restart) fails the write and the
        # reset drops its bytes: once P's kernel holds none for D, it goes again on a fresh
        # connection, if the lease still allows, up to WRITE_RETRIES times (a fence shuts
        # every connection from this host, and the transport may pick several of them).
        retries = 0
        while True:
            try:
                nbytes = te.write(d_meta.session, src, dst, lengths)
            except TransferError as exc:
                link.write_failed = True
                host = session.target.host_of(link.d_rank)
                if (retries == WRITE_RETRIES or not self.writes_settled(link, host)
                        or time.monotonic() >= link.valid_until):
                    raise
                logger.info("request %s: write to D rank %d failed (%s); none of its bytes is "
                            "left on the way, writing again", session.request_id, link.d_rank,
                            exc)
                retries += 1
                self.recorder.inc("p2p_write_retries")
                continue
            link.write_failed = False
            return nbytes

    def stop_link(self, session: PushSession, link: PushLink, reason: str, *,
                  cause: str) -> None:
        """Stop pushing to this D rank and tell it (sender thread, best effort)."""
        with self.lock:
            if link.state in ("broken", "done"):
                return
            link.state, link.reason = "broken", reason
        self.recorder.inc("p2p_failures", cause=cause)
        logger.error("request %s: push to D rank %d stopped (%s): %s", session.request_id,
                     link.d_rank, cause, reason)
        self.send_done(session.target, link, success=False, reason=reason)
        with self.lock:
            link.state = "done"

    def close_revoked(self, session: PushSession, link: PushLink) -> None:
        """Tell D this sender stopped after a refused renewal (sender thread)."""
        with self.lock:
            if link.state != "revoked":
                return
            link.state = "broken"
        self.send_done(session.target, link, success=False, reason=link.reason)
        with self.lock:
            link.state = "done"

    def send_done(self, target: PushTarget, link: PushLink, *, success: bool,
                  reason: str = "", nbytes: int = 0) -> bool:
        """Tell ``link``'s D rank that this sender completed or failed the request."""
        host = target.host_of(link.d_rank)
        return self.send_done_to(host, link.port, target.request_id,
                                 success=success, reason=reason, nbytes=nbytes,
                                 token=target.token, settled=self.writes_settled(link, host),
                                 engine_id=target.engine_id)

    def writes_settled(self, link: PushLink, host: str) -> bool:
        """Whether no write of ``link`` can land on D any more (its writes returned): none
        failed in the transfer engine, or this host's kernel holds no bytes for D on a
        connection the engine closed (on a working network those go out within
        :data:`SETTLE_WAIT_S`; on a cut one they wait, and D fences)."""
        if not link.write_failed:
            return True
        if not own_sockets.available():
            return False
        hosts = {host}
        if link.meta is not None:
            hosts.add(link.meta.session.rsplit(":", 1)[0])
        addrs = resolve_hosts(hosts)
        until = time.monotonic() + SETTLE_WAIT_S
        while own_sockets.orphaned_unsent(addrs) > 0:
            if time.monotonic() >= until:
                return False
            time.sleep(0.02)
        return True

    def send_done_to(self, host: str, port: int, request_id: str, *, success: bool,
                     reason: str = "", nbytes: int = 0, token: str = "",
                     settled: bool = True, engine_id: str = "") -> bool:
        """``PushDone`` to one D rank (of engine ``engine_id``); whether D accepted it (False
        if D is unreachable).

        Sent by the sender thread once this sender's writes for the request returned:
        ``settled`` says none of them failed in the transfer engine (so none can land later).
        """
        try:
            reply = self.shared.client(host, port, engine_id).call(PushDone(
                request_id=request_id, sender=self.shared.agent_id, success=success,
                reason=reason[:2000], nbytes=nbytes, token=token, settled=settled))
        except KVTransferError as exc:
            logger.warning("could not tell D %s:%d that request %s is %s: %s", host, port,
                           request_id, "complete" if success else "failed", exc)
            return False
        return isinstance(reply, PushDoneAck) and reply.accepted

    # ================================================================ renewer thread
    def _renew_loop(self) -> None:
        interval = max(0.05, self.cfg.lease_ttl_s / 3)
        while not self._stop.wait(interval):
            try:
                self._send_round()
            except Exception:  # keep renewing whatever one round hit
                logger.exception("layerwise lease renewal failed")

    def renew_once(self) -> None:
        """Renew every granted write lease (one ``PushRenew`` per D rank, side by side);
        returns when each was answered or timed out."""
        wait(self._send_round(), timeout=self.cfg.handshake_timeout_s + 1.0)

    def _send_round(self) -> list[Future[None]]:
        """Send a ``PushRenew`` to every D rank with granted leases and no renewal in flight
        (:class:`~.renewer.SideBySide`: a D rank slow to answer delays no other's); returns
        the calls sent."""
        by_port: dict[tuple[str, int, str], list[tuple[PushSession, PushLink]]] = {}
        with self.lock:
            for session in self.sessions.values():
                for link in session.links:
                    if link.state == "granted":
                        by_port.setdefault((session.target.host_of(link.d_rank), link.port,
                                            session.target.engine_id),
                                           []).append((session, link))
        return self._calls.send({peer: functools.partial(self._renew, peer, pairs)
                                 for peer, pairs in by_port.items()})

    def _renew(self, peer: tuple[str, int, str],
               pairs: list[tuple[PushSession, PushLink]]) -> None:
        """Renew this D rank's leases (a renewal thread)."""
        host, port, engine_id = peer
        try:
            sent = time.monotonic()
            try:
                reply = self.shared.client(host, port, engine_id).call(PushRenew(
                    request_ids=[s.target.request_id for s, _ in pairs],
                    sender=self.shared.agent_id, tokens=[s.target.token for s, _ in pairs]))
            except KVTransferError as exc:
                logger.debug("lease renewal to %s:%d failed: %s", host, port, exc)
                return  # writes stop by themselves when the lease runs out
            granted = set(reply.granted) if isinstance(reply, PushRenewReply) else set()
            for session, link in pairs:
                with self.lock:
                    if link.state != "granted":
                        continue
                    if session.target.request_id in granted:
                        link.valid_until = write_window_end(self.shared.te, sent, link.lease_s)
                        continue
                    link.state, link.reason = "revoked", "D revoked the write lease"
                self.recorder.inc("p2p_failures", cause="revoked")
                self._on_revoked(session, link)
        except Exception:  # keep renewing whatever one call hit
            logger.exception("layerwise lease renewal to %s:%d failed", host, port)
