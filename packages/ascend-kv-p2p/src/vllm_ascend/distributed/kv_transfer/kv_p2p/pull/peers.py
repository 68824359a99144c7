# SPDX-License-Identifier: Apache-2.0
"""D side of ``MooncakeConnectorV1``: what D knows of P's ranks, and its calls to them.

:class:`PeerRanks` owns that knowledge: where each P rank listens, which of its heads this D
rank reads (the head plan, over P's pipeline stages), its ``AgentMeta`` (fetched once,
checked for compatibility, fetched again after P restarted), and where its KV cache is (an
unkeyed P's metadata, or the grants of this request's claims). And the calls, for one request: ``Claim``,
``Done``, the releases of a request D will not read (or whose P ranks no D rank reads), and
the probe that tells a P that is gone from one that is slow.

:class:`~.reader.PullReader` (the pull threads) and :class:`~.inline.InlineReads` (reads
started on vLLM's thread) both go through its public methods; the fault and window tests
hook :meth:`PeerRanks.claim`. The answers of the claims D's scheduler sent ahead stand in for
D's own claims through :func:`accepted_ahead`.

A P with a deployment key tells no one its region addresses: a claim's grant
(:class:`~..protocol.ClaimGrant`) names the address of each claimed block in each region
(:mod:`..grants`), and D reads exactly those (:meth:`PeerRanks.grants`). D keeps no grant
past its request, so a keyed load is claimed before it is read (or read under the answers
of the claims its scheduler sent ahead); a grant of another size than the claim is refused
(``bad_grant``: the load fails and is recomputed, the claimed ranks are released).
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_ascend.distributed.kernels.heads import HeadSlice
from vllm_ascend.distributed.kv_transfer.core.errors import KVTransferError, RemoteError

from ..errors import RemoteKVUnavailable, unknown_request
from ..grants import granted_table
from ..protocol import (
    AgentMeta,
    Claim,
    ClaimGrant,
    ClaimOK,
    Done,
    DoneAck,
    compatibility_problem,
    worker_port,
)
from ..worker_base import P2PWorkerBase, head_partners, head_slices
from .contract import CLOCK_SKEW_S, EarlyClaim, RecvMeta, expand_over_stages, same_instance
from .loads import LoadTracker

logger = logging.getLogger(__name__)

#: How long D waits for a TCP connection to P's side channel when it checks, before a
#: retry, whether P is still there.
PROBE_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class Claimed:
    """P rank's answer to a claim D sent."""

    #: P accepted the first ``Claim`` sent (no "unknown request" retry)
    first_try: bool
    #: ``time.monotonic()`` when the accepted ``Claim`` was sent; P renewed the lease to a
    #: full ``lease_ttl_s`` when it answered, which is later
    sent_at: float
    #: where the claimed blocks are, from a keyed P's grant (``None``: an unkeyed P's
    #: ``ClaimOK``; its ``AgentMeta`` has its regions)
    grant: ClaimGrant | None = None


class PeerRanks:
    """D's knowledge of P's ranks and its side-channel calls to them.

    Args:
        shared: the worker's identity, KV cache registration, peers and handshake.
        loads: where each load's deadline is kept (a claim is retried only before it).
    """

    def __init__(self, shared: P2PWorkerBase, loads: LoadTracker) -> None:
        self.shared = shared
        self.loads = loads
        # (P's TP size, MLA) -> this rank's head plan and the readers of each P rank
        self._plans: dict[tuple[int, bool], tuple[tuple[HeadSlice, ...], Mapping[int, int]]] = {}
        # (P endpoint, engine start) whose metadata was fetched again for that start
        self._refetched: set[tuple[tuple[str, int], str]] = set()

    # ------------------------------------------------------------ where, which heads
    def port_of(self, remote: Any, p_rank: int) -> int:
        """P rank ``p_rank``'s side-channel port."""
        return worker_port(remote.port, tp_rank=p_rank, tp_size=remote.tp_size)

    def head_plan(self, p_tp: int) -> tuple[tuple[HeadSlice, ...], Mapping[int, int]]:
        """This rank's head slices to read from a P instance of TP size ``p_tp``, and how
        many D ranks read each P rank; computed once per P TP size (shared: never modify).

        Raises:
            HandshakeMismatchError: the KV heads do not split over one of the TP sizes.
        """
        s = self.shared
        is_mla = bool(s.layout and s.layout.is_mla)
        key = (p_tp, is_mla)
        cached = self._plans.get(key)
        if cached is None:
            plan = tuple(head_slices(s.total_kv_heads, p_tp, s.tp_size, s.tp_rank,
                                     is_mla=is_mla))
            readers = head_partners(s.total_kv_heads, p_tp, s.tp_size, is_mla=is_mla)
            cached = self._plans[key] = expand_over_stages(  # P ranks of every stage
                plan, readers, tp_size=p_tp, pp_size=s.cfg.prefill.pp_size)
        return cached

    # ------------------------------------------------------------ metadata, regions
    def remote_meta(self, host: str, port: int, *, expect_tp: int,
                    engine_id: str = "") -> AgentMeta:
        """P rank's metadata, fetched once and checked against this instance."""
        return self.shared.peer_meta(
            host, port, peer="P", engine_id=engine_id,
            problem_of=lambda m: self.compatibility_problem(m, expect_tp=expect_tp))

    def compatibility_problem(self, remote: AgentMeta, *, expect_tp: int) -> str:
        """Why P's cache cannot be read into ours, naming both sides' values; '' if it can."""
        assert self.shared.meta is not None
        return compatibility_problem(self.shared.meta, remote, expect_tp=expect_tp,
                                     configured_tp=self.shared.cfg.prefill.tp_size)

    def metas(self, remote: Any, p_ranks: list[int]) -> dict[int, AgentMeta]:
        """P ranks' metadata (cached), fetched again once when the request names another
        engine start of P than the cached one (P restarted at the same address)."""
        for again in (False, True):
            metas = {r: self.remote_meta(remote.host_of(r), self.port_of(remote, r),
                                         expect_tp=remote.tp_size, engine_id=remote.engine_id)
                     for r in p_ranks}
            seen = (remote.endpoint_key(), remote.instance)
            if again or not remote.instance or same_instance(remote, metas) or (
                    seen in self._refetched):
                break
            self._refetched.add(seen)
            self.forget_session(remote, p_ranks)
        return metas

    def cached_metas(self, remote: Any, p_ranks: Iterable[int]) -> dict[int, AgentMeta] | None:
        """P ranks' metadata if D has every one already (no call: vLLM's thread), else
        ``None``."""
        out = {}
        for r in p_ranks:
            m = self.shared.cached_peer_meta(remote.host_of(r), self.port_of(remote, r))
            if m is None:
                return None
            out[r] = m
        return out

    def forget_session(self, remote: Any, p_ranks: Iterable[int]) -> None:
        """Drop what D cached of these P ranks (their ``AgentMeta``), so a
        retry fetches it again: a P rank that restarted its transfer engine has a new
        session and new regions. (Mooncake's Python engine keeps its segment handle per
        session name and offers no way to close it; the read itself goes out as a new
        transfer on a new connection, the stalled one having been dropped.)"""
        for r in p_ranks:
            self.shared.forget_peer_meta(remote.host_of(r), self.port_of(remote, r))

    @staticmethod
    def known_regions(metas: Mapping[int, AgentMeta]) -> dict[int, AgentMeta] | None:
        """P ranks' metadata if it says where their KV caches are before this request's
        claims (an unkeyed P's ``GetMeta``); ``None`` for a keyed P (its grants say where
        the request's blocks are, and only they)."""
        return dict(metas) if all(m.region_addrs for m in metas.values()) else None

    @staticmethod
    def grants(meta: RecvMeta, metas: Mapping[int, AgentMeta],
               claims: Mapping[int, Future[Claimed]]) -> dict[int, np.ndarray]:
        """The block addresses of this request's grants, by P rank (every claim in
        ``claims`` has been accepted): a row per P region, a column per block of
        ``meta.remote_block_ids`` (the claim's). An unkeyed P's ``ClaimOK`` has none (its
        metadata has its regions).

        Raises:
            RemoteKVUnavailable: ``bad_grant``: a grant does not name the claimed blocks of
                each of P's regions (:func:`~..grants.granted_table`); ``no_regions``: a P
                rank told D neither its regions nor the blocks' addresses.
        """
        out: dict[int, np.ndarray] = {}
        for r, fut in claims.items():
            grant = fut.result().grant
            m = metas[r]
            if grant is None:
                if not m.region_addrs:
                    raise RemoteKVUnavailable(
                        f"P rank {r} accepted the claim without saying where its KV cache is "
                        "(no region addresses in GetMeta, no grant)", code="no_regions")
                continue
            out[r] = granted_table(grant.block_addrs, grant.num_regions,
                                   regions=len(m.layout.block_lens),
                                   blocks=len(meta.remote_block_ids), who=f"P rank {r}")
        return out

    # ------------------------------------------------------------ calls
    def p_gone(self, remote: Any, p_ranks: Iterable[int]) -> bool:
        """Whether a P rank's side-channel port refuses connections: the process is gone (a
        retry would only wait for timeouts). A P starved of CPU, or stopped, still has its
        connections accepted by the kernel; a cut network times out: both are retried."""
        for r in p_ranks:
            try:
                with socket.create_connection((remote.host_of(r), self.port_of(remote, r)),
                                              timeout=PROBE_TIMEOUT_S):
                    pass
            except ConnectionRefusedError:
                logger.info("P rank %d of request %s refuses connections: not retried", r,
                            remote.request_id)
                return True
            except OSError:
                return False  # no answer (a cut network): the other ranks will not say more
        return False

    def claim(self, meta: RecvMeta, p_rank: int, num_readers: int) -> Claimed:
        """Claim the request's blocks on one P rank; retries while P answers "unknown
        request" (its metadata may not have arrived yet), as ``claim_retry`` says, within
        the load's deadline."""
        remote = meta.remote
        assert remote is not None
        client = self.shared.client(remote.host_of(p_rank), self.port_of(remote, p_rank),
                                    remote.engine_id)
        msg = Claim(request_id=remote.request_id, block_ids=meta.remote_block_ids,
                    reader=self.shared.agent_id, num_readers=num_readers, token=remote.token)
        try:
            got = self.shared.cfg.claim_retry.call(lambda: client.call(msg),
                                                   retry_if=unknown_request,
                                                   until=self.loads.deadline(meta))
        except RemoteError as exc:
            raise RemoteKVUnavailable(f"P rank {p_rank} refused the claim: {exc}",
                                      code=exc.code) from exc
        reply, first_try = got.result, got.retries == 0
        if isinstance(reply, ClaimGrant):
            return Claimed(first_try=first_try, sent_at=got.sent_at, grant=reply)
        if not isinstance(reply, ClaimOK):
            raise RemoteKVUnavailable(f"unexpected claim reply {type(reply).__name__}")
        return Claimed(first_try=first_try, sent_at=got.sent_at)

    def done(self, meta: RecvMeta, p_rank: int, num_readers: int, *, success: bool) -> bool:
        """Tell P rank ``p_rank`` D is done with the request; whether P says its lease held."""
        remote = meta.remote
        assert remote is not None
        client = self.shared.client(remote.host_of(p_rank), self.port_of(remote, p_rank),
                                    remote.engine_id)
        reply = client.call(Done(request_id=remote.request_id, reader=self.shared.agent_id,
                                 success=success, num_readers=num_readers, token=remote.token))
        return isinstance(reply, DoneAck) and reply.valid

    def done_quietly(self, meta: RecvMeta, p_ranks: list[int],
                     readers: Mapping[int, int]) -> None:
        """``Done`` to every P rank read from, after a load already reported loaded."""
        for r in p_ranks:
            try:
                self.done(meta, r, readers[r], success=True)
            except KVTransferError as exc:
                logger.info("Done for request %s to P rank %d failed: %s (its lease will lapse)",
                            meta.request_id, r, exc)

    def release_remote(self, meta: RecvMeta) -> None:
        """Tell every P rank it can free a request D will not read (best effort)."""
        remote = meta.remote
        assert remote is not None
        plan, readers = self.head_plan(remote.tp_size)
        for r in sorted({s.remote_rank for s in plan}):
            try:
                self.done(meta, r, readers[r], success=False)
            except KVTransferError as exc:
                logger.info("could not release request %s on P rank %d: %s (its lease will "
                            "lapse)", remote.request_id, r, exc)
        self.release_unread(meta)

    def release_unread(self, meta: RecvMeta) -> None:
        """P ranks no D rank reads (MLA, replicated heads) still hold the request: the D rank
        ``p_rank % d_tp`` releases each of them."""
        remote = meta.remote
        assert remote is not None
        _plan, readers = self.head_plan(remote.tp_size)
        for r in range(remote.tp_size * self.shared.cfg.prefill.pp_size):
            if r in readers or r % self.shared.tp_size != self.shared.tp_rank:
                continue
            try:
                self.done(meta, r, 1, success=True)
            except KVTransferError as exc:
                logger.info("could not release request %s on unread P rank %d: %s",
                            remote.request_id, r, exc)


def grants_moved(read: Mapping[int, np.ndarray], granted: Mapping[int, np.ndarray]) -> bool:
    """Whether the block addresses a read used differ from those of the request's grants."""
    return read.keys() != granted.keys() or any(
        not np.array_equal(read[r], g) for r, g in granted.items())


def claim_sent_at(answer: EarlyClaim, *, now_mono: float | None = None,
                  now_wall: float | None = None) -> float:
    """When (this process's ``time.monotonic()``, at the earliest) an accepted answer's
    claim was sent: :data:`~.contract.CLOCK_SKEW_S` earlier than the clocks say, so a skew or
    a small step of either clock shortens the time a read is trusted instead of stretching
    it; ``-inf`` (never trusted) when the scheduler's clock seems further ahead of ours."""
    now_mono = time.monotonic() if now_mono is None else now_mono
    now_wall = time.time() if now_wall is None else now_wall
    age = now_wall - answer.sent_wall
    if age < -CLOCK_SKEW_S:
        return -math.inf
    return now_mono - max(0.0, age) - CLOCK_SKEW_S


def refused_ahead(answers: Mapping[int, EarlyClaim] | None) -> bool:
    """Whether a claim sent ahead was not accepted (the pull then claims as before)."""
    return answers is not None and not all(a.ok for a in answers.values())


def accepted_ahead(answers: Mapping[int, EarlyClaim] | None,
                   p_ranks: Iterable[int]) -> dict[int, Future[Claimed]] | None:
    """The accepted answers among ``p_ranks``, as the pull's own claims would be (``None``
    while none is in)."""
    if answers is None:
        return None
    out: dict[int, Future[Claimed]] = {}
    for r in p_ranks:
        a = answers.get(r)
        if a is None or not a.ok:
            continue
        grant = (None if a.block_addrs is None else ClaimGrant(
            lease_s=0.0, block_addrs=a.block_addrs, num_regions=a.num_regions))
        fut: Future[Claimed] = Future()
        fut.set_result(Claimed(first_try=a.first_try, sent_at=claim_sent_at(a), grant=grant))
        out[r] = fut
    return out
