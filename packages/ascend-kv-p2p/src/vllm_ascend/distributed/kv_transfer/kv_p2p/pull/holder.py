# SPDX-License-Identifier: Apache-2.0
"""P side of ``MooncakeConnectorV1``: the blocks P holds for D, as leases.

P serves a side channel (one ZeroMQ socket a worker rank). Every request the
scheduler holds for D (a :class:`~.pull.contract.SendMeta`) is a lease: D's
``Claim`` and ``Renew`` (D's and the proxy's) extend it, D's ``Done`` (from every
expected reader) releases it, and a lease that lapses frees the blocks anyway, reported
exactly once through ``get_finished``. P only answers a ``Claim`` for blocks it holds for
that very request. No lease outlives ``max_hold_s`` from when P began holding the request:
a renewal extends it up to there and no further, and a claim after it is refused
(``expired``), so nobody keeps blocks held indefinitely.

Capabilities: the scheduler issues an unguessable token for each held request
(``remote_claim_token`` in the ``kv_transfer_params`` P returns). A ``Claim``, ``Done``
or ``Renew`` whose token does not match (constant-time compare) is refused (a renewal:
that request is not renewed) and changes nothing. With a deployment key configured
(:mod:`~vllm_ascend.distributed.kv_transfer.core.auth`) the token is required; without
one, a message without a token is served as before (old D instances, old params), while a
wrong token is still refused: without a key anyone who reaches the side channel can read
P's memory map anyway, so a mandatory token would buy no security there, only break
compatibility; it still catches misrouted or stale params.

Grants name only the claimed blocks: with a key, ``GetMeta`` (answered only to a keyed
peer) leaves out the base addresses of P's registered KV cache, and an accepted ``Claim``
is answered :class:`~.protocol.ClaimGrant`, which names the address of each claimed block
in each region (:mod:`..grants`), never a region's base or stride. So a D that presents a
held request's token learns where that request's blocks are, and nothing else of P's
memory. Without a key ``GetMeta`` and ``ClaimOK`` are the messages (and bytes) of before.

The read window: the scheduler stamps each request's params with the wall time it began
holding the blocks and ``read_window_s``; this worker keeps them at least that long from
when it registers the hold (a moment later), even when every reader's ``Done`` came
sooner (the release is then deferred, while a later ``Claim`` is refused as after any
release). So a D read that ends within the window of the stamp (:mod:`.contract`) read
the request's KV without a claim.
"""

from __future__ import annotations

import collections
import heapq
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec

from vllm_ascend.distributed.kv_transfer.core.auth import count_refusal, tokens_match
from vllm_ascend.distributed.kv_transfer.core.channel import RpcServer, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.leases import LeaseTable
from vllm_ascend.distributed.kv_transfer.core.wire import ErrorReply, Message

from ..grants import BlockAddresser
from ..protocol import (
    CODEC,
    AgentMeta,
    Claim,
    ClaimGrant,
    ClaimOK,
    Done,
    DoneAck,
    GetMeta,
    Renew,
    RenewReply,
    token_of,
)
from ..worker_base import P2PWorkerBase
from .contract import SendMeta

logger = logging.getLogger(__name__)

#: How many released request ids P remembers (to tell "freed" from "never had").
RELEASED_MEMORY = 16384
#: How long P's side channel waits for a request's registration before answering "unknown".
CLAIM_WAIT_S = 0.2


@dataclass
class Held:
    """Blocks P holds for one request."""

    block_ids: list[int]
    readers_expected: int = 1
    readers_done: set[str] = field(default_factory=set)
    #: the request's capability (``""``: issued none)
    token: str = ""
    #: ``time.monotonic()`` before which P does not free the blocks, D's ``Done`` or not
    #: (the read window, ``read_window_s``, from when this worker began holding them)
    keep_until: float = 0.0
    #: ``time.monotonic()`` past which no renewal or claim extends the lease
    #: (``max_hold_s`` from when this worker began holding them)
    hold_until: float = float("inf")
    #: several KV cache groups' runs (:attr:`~.pull.contract.SendMeta.in_order`)
    in_order: bool = False


class LeaseHolder:
    """P's leases on held blocks and the side channel D claims them through.

    Args:
        shared: the worker's identity, KV cache registration and metrics (its
            ``meta`` answers ``GetMeta``).
    """

    def __init__(self, shared: P2PWorkerBase) -> None:
        self.shared = shared
        self.held: LeaseTable[str, Held] = LeaseTable(shared.cfg.lease_ttl_s, name="p2p-held")
        self._released: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._finished: set[str] = set()
        #: released requests whose blocks stay until their read window ends (monotonic)
        self._deferred: dict[str, float] = {}
        #: the same, in the order their windows end (an item whose entry left or changed
        #: is skipped): each step costs what is due, not what waits
        self._deferred_order: list[tuple[float, str]] = []
        #: Done messages of requests not registered yet (D read in the window)
        self._early_done: collections.OrderedDict[str, list[Done]] = collections.OrderedDict()
        self._lock = threading.Lock()
        # signalled when the scheduler's metadata registers new held requests
        self._held_cv = threading.Condition()
        self.server: RpcServer[Message] | None = None
        # the addresses of P's blocks for keyed grants, and the metadata they were made of
        self._addresser: tuple[AgentMeta, BlockAddresser] | None = None

    # ------------------------------------------------------------ life cycle
    def serve(self) -> None:
        """Start the side channel on this rank's port."""
        s = self.shared
        # under a key, requests must be sealed for this rank's port and this instance's
        # engine id (D takes it from the request's params: remote_engine_id)
        self.server = RpcServer(tcp_endpoint(s.host, s.port), CODEC, self.handle,
                                name=f"p2p-side-channel-{s.port}",
                                engine_id=getattr(s, "engine_id", "")).start()

    def stop(self) -> None:
        """Stop serving."""
        if self.server is not None:
            self.server.stop()
            self.server = None

    def hold(self, requests: Iterable[SendMeta]) -> None:
        """Hold the blocks of the scheduler's newly finished requests until D is done."""
        added = False
        cfg = self.shared.cfg
        window = cfg.hold_window_s
        for req in requests:
            added = True
            now = time.monotonic()
            keep = now + window if window > 0 else 0.0
            try:
                # held for the D instance(s) the request goes to; which D is known only
                # once it claims, so the owner names the request's readers
                self.held.add(req.request_id, Held(list(req.block_ids), token=req.token,
                                                   keep_until=keep,
                                                   hold_until=now + cfg.max_hold_s,
                                                   in_order=req.in_order),
                              owner=f"readers of {req.request_id}",
                              ttl=min(cfg.lease_ttl_s, cfg.max_hold_s))
            except KeyError:
                logger.warning("request %s is already held; ignoring a duplicate",
                               req.request_id)
                continue
            with self._lock:
                early = self._early_done.pop(req.request_id, [])
            for msg in early:  # D read in the window and was done before this step
                self._apply_done(msg)
        if added:
            with self._held_cv:
                self._held_cv.notify_all()

    # ------------------------------------------------------------ side channel
    def handle(self, msg: Message) -> Message:
        """Side-channel handler (runs on the server thread)."""
        if isinstance(msg, GetMeta):
            return self._public_meta()
        if isinstance(msg, Claim):
            return self._on_claim(msg)
        if isinstance(msg, Renew):
            return self._on_renew(msg)
        if isinstance(msg, Done):
            return self._on_done(msg)
        return ErrorReply(code="unsupported", message=f"{type(msg).__name__} is not a request")

    @property
    def _keyed(self) -> bool:
        return self.server is not None and self.server.auth is not None

    def _public_meta(self) -> AgentMeta:
        """``GetMeta``'s answer: with a key, without the region addresses (they go with
        each claim's grant)."""
        meta = self.shared.meta
        assert meta is not None
        if not self._keyed:
            return meta
        return msgspec.structs.replace(meta, region_addrs=[])

    def _token_ok(self, held: Held, presented: str) -> bool:
        """Whether a Claim/Done may act on ``held`` (see the module docstring)."""
        if not presented and not self._keyed:
            return True
        ok = bool(held.token) and tokens_match(held.token, presented)
        if not ok:
            count_refusal(self.server.name if self.server else "p2p-side-channel", "bad_token")
        return ok

    def _extend(self, request_id: str, held: Held) -> float:
        """Renew ``request_id``'s lease up to its hold limit; the seconds it now runs (0.0:
        past the limit, or no longer held: not renewed)."""
        lease_s = min(self.shared.cfg.lease_ttl_s, held.hold_until - time.monotonic())
        if lease_s <= 0 or not self.held.renew(request_id, ttl=lease_s):
            return 0.0
        return lease_s

    def _on_renew(self, msg: Renew) -> Message:
        """Renew each request whose token matches, up to its hold limit; the reply lists
        those renewed."""
        renewed = []
        for i, rid in enumerate(msg.request_ids):
            held = self.held.get(rid)
            if held is None or not self._token_ok(held, token_of(msg.tokens, i)):
                continue
            if self._extend(rid, held) > 0:
                renewed.append(rid)
        return RenewReply(held=renewed)

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
            with self._lock:
                released = msg.request_id in self._released
            code = "released" if released else "unknown_request"
            why = ("was already freed (read, released or its lease lapsed)" if released
                   else "is not held here")
            return ErrorReply(code=code, message=f"request {msg.request_id!r} {why}")
        if not self._token_ok(held, msg.token):
            return ErrorReply(code="bad_token", message=f"request {msg.request_id!r}: the claim "
                              "does not carry the request's token (remote_claim_token)")
        extra = sorted(set(msg.block_ids) - set(held.block_ids))
        if extra:
            return ErrorReply(code="bad_blocks",
                              message=f"request {msg.request_id!r} does not hold blocks {extra[:8]}"
                                      f"{'...' if len(extra) > 8 else ''}")
        # D reads the blocks P returned in kv_transfer_params, minus those of its own prefix
        # hit: a suffix of that list, in its order. Anything else (the request's own blocks
        # reordered, repeated, or a middle slice) would put KV at the wrong token positions.
        n = len(msg.block_ids)
        if held.in_order:
            # several KV cache groups: D reads, of each group's run, the blocks its manager
            # keeps (a window's tail) past its prefix hit; still P's own order
            if len(set(msg.block_ids)) != n or not _in_order(msg.block_ids, held.block_ids):
                return ErrorReply(
                    code="bad_blocks",
                    message=f"request {msg.request_id!r}: the block ids asked for repeat or "
                            f"are not in the order of the {len(held.block_ids)} it holds")
        elif n > len(held.block_ids) or (n and list(msg.block_ids) != held.block_ids[-n:]):
            return ErrorReply(
                code="bad_blocks",
                message=f"request {msg.request_id!r}: the block ids asked for are not the last "
                        f"{n} of the {len(held.block_ids)} it holds, in order (they must be "
                        "the remote_block_ids P returned, minus D's cached prefix)")
        lease_s = self._extend(msg.request_id, held)
        if lease_s <= 0:
            return ErrorReply(code="expired", message=f"request {msg.request_id!r} was held "
                              f"for its {self.shared.cfg.max_hold_s:g}s limit (max_hold_s): "
                              "no more claims")
        held.readers_expected = max(1, msg.num_readers)
        if not self._keyed:
            return ClaimOK(lease_s=lease_s)
        meta = self.shared.meta
        assert meta is not None
        made = self._addresser
        if made is None or made[0] is not meta:  # (a cache registered again: its regions)
            made = self._addresser = (meta, BlockAddresser(meta.region_addrs,
                                                           meta.region_strides))
        addresser = made[1]
        return ClaimGrant(lease_s=lease_s, block_addrs=addresser.of(msg.block_ids),
                          num_regions=addresser.num_regions)

    def _on_done(self, msg: Done) -> Message:
        if self.held.get(msg.request_id) is None:
            with self._lock:
                # a D that read in the window can be done before P's next engine step
                # registers the request: kept for hold() (which takes the lock after adding)
                early = self.held.get(msg.request_id) is None and (
                    msg.request_id not in self._released)
                if early:
                    self._early_done.setdefault(msg.request_id, []).append(msg)
                    while len(self._early_done) > RELEASED_MEMORY:
                        self._early_done.popitem(last=False)
            if early:
                return DoneAck(valid=False)
        return self._apply_done(msg)

    def _apply_done(self, msg: Done) -> Message:
        held = self.held.get(msg.request_id)
        if held is None:
            self.shared.recorder.inc("p2p_late_completions")
            return DoneAck(valid=False)
        if not self._token_ok(held, msg.token):
            return ErrorReply(code="bad_token", message=f"request {msg.request_id!r}: Done "
                              "does not carry the request's token (remote_claim_token)")
        held.readers_expected = max(held.readers_expected, msg.num_readers)
        held.readers_done.add(msg.reader)
        if len(held.readers_done) < held.readers_expected:
            return DoneAck(valid=msg.request_id in self.held)
        if self.held.complete(msg.request_id) is None:
            return DoneAck(valid=False)  # expired between the two calls
        self._release(msg.request_id, keep_until=held.keep_until)
        if msg.success:
            self.shared.recorder.inc("p2p_requests_served")
        return DoneAck(valid=True)

    def _release(self, request_id: str, keep_until: float = 0.0) -> None:
        """No longer held: refused from now on, its blocks given back to vLLM now or, within
        its read window, once the window ends."""
        with self._lock:
            if keep_until > time.monotonic():
                self._deferred[request_id] = keep_until
                heapq.heappush(self._deferred_order, (keep_until, request_id))
            else:
                self._finished.add(request_id)
            self._released[request_id] = None
            while len(self._released) > RELEASED_MEMORY:
                self._released.popitem(last=False)

    def _expired(self) -> list[tuple[str, Held]]:
        """Leases that lapsed, counting only time the side channel could hear renewals.

        When this process was held up (starved of CPU, as P and D sharing cores unpinned
        are; or the GIL held elsewhere), the ``Renew`` and ``Claim`` messages D and the
        proxy sent meanwhile still wait in the side channel's socket: a lease that lapsed
        during the stall lapses only once the side channel has caught up
        (``RpcServer.caught_up``: run steadily long enough to answer them). A lease overdue
        by a whole ``lease_ttl_s`` lapses regardless (a side channel that never settles
        frees blocks late, never not at all).
        """
        server = self.server
        if server is None:
            return self.held.expire()
        now = time.monotonic()
        lapse = server.lapse_clock(self.shared.cfg.lease_ttl_s, now)
        overdue = self.held.expire(now=lapse)
        if lapse < now and not overdue and len(self.held):
            logger.debug("side channel %s held up: lease expiry waits for it", server.name)
        return overdue

    # ------------------------------------------------------------ vLLM hooks
    def collect_finished(self) -> set[str]:
        """Requests whose blocks P may free now (D done, or the lease lapsed); each once."""
        recorder = self.shared.recorder
        for rid, _held in self._expired():
            logger.warning("request %s: no Done from D within the %.1fs lease; freeing its "
                           "blocks", rid, self.shared.cfg.lease_ttl_s)
            recorder.inc("p2p_expired_leases")
            self._release(rid)
        now = time.monotonic()
        with self._lock:
            due: list[str] = []
            order = self._deferred_order
            while order and order[0][0] <= now:
                until, rid = heapq.heappop(order)
                if self._deferred.get(rid) == until:
                    del self._deferred[rid]
                    due.append(rid)
            out, self._finished = self._finished | set(due), set()
            waiting = len(self._deferred)  # released, their blocks kept for the window
        recorder.set("p2p_held_requests", len(self.held) + waiting)
        return out


def _in_order(wanted: list[int], held: list[int]) -> bool:
    """Whether ``wanted`` is ``held`` with some blocks left out (same order)."""
    it = iter(held)
    return all(any(b == h for h in it) for b in wanted)
