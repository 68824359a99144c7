# SPDX-License-Identifier: Apache-2.0
"""D side of ``MooncakeLayerwiseConnector``: the receiver of P's pushes.

D serves the side channel P's ranks push through: ``GetMeta`` (D's cache
description), ``PushBegin`` (a write lease on exactly the blocks D allocated for
the request, with staging buffers where P's heads are not contiguous in D's
blocks, see :mod:`.layerwise.staging`), ``PushRenew`` and ``PushDone``.

Each request waits under a deadline; it completes when every P rank that pushes
to this rank said ``PushDone``, and fails at once when a sender failed, when a
sender that began stops renewing its lease (P died; counted only once this side channel
has caught up after a stall of D's own, see ``RpcServer.caught_up``), or at the deadline; a
failing request is only reported once no sender can still write into its blocks: each lease
ended or lapsed, and no write already on the way can land (P said so, or D fenced the
connections that could carry it, :mod:`.layerwise.fence`). Failed requests' blocks go to
``get_block_ids_with_load_errors``. A virtual request (``do_virtual``) is
reported finished at once, with no transfer.

Capabilities: D's scheduler issues an unguessable token for each request it posts
to the metaserver (``remote_push_token``, which the proxy hands to P with the rest
of the params). ``PushBegin``, ``PushRenew`` and ``PushDone`` must present it
(constant-time compare; refused as ``bad_token`` and counted otherwise: a renewal then
renews nothing for that request), so a peer that holds the deployment key but not the
request's params can neither write into its blocks, nor keep them, nor fail it. No write
lease is renewed at or past the request's deadline (``load_timeout_s``), so a lease ends
at most one ``lease_ttl_s`` after it. With a key the token is required, and ``GetMeta`` leaves out D's region
addresses: each grant (:class:`~.protocol.PushBlocksGrant`) names the address of each block
of its push in each region D lets P write (:mod:`..grants`), never a region's base. Without a key a message without a
token is served as before (older P instances), a wrong one is still refused.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import msgspec
import torch

from vllm_ascend.distributed.kv_transfer.core.auth import capability_ok
from vllm_ascend.distributed.kv_transfer.core.channel import RpcServer, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.errors import TransferError
from vllm_ascend.distributed.kv_transfer.core.wire import ErrorReply, Message

from ..errors import HandshakeMismatchError
from ..grants import BlockAddresser
from ..params import push_order
from ..protocol import (
    LAYERWISE_CODEC,
    LAYERWISE_PROTOCOL_VERSION,
    AgentMeta,
    GetMeta,
    PushBegin,
    PushBlocksGrant,
    PushDone,
    PushDoneAck,
    PushGrant,
    PushRenew,
    PushRenewReply,
    token_of,
)
from ..worker_base import P2PWorkerBase, head_slices
from .contract import RecvReq
from .fence import WriteFence, resolve_hosts
from .staging import allocate_staging, merge_staged_heads, release_staging

logger = logging.getLogger(__name__)

#: How long D's side channel waits for a request's registration before answering "unknown".
BEGIN_WAIT_S = 0.2
#: How many ended request ids D remembers (to tell "ended" from "never had").
_ENDED_MEMORY = 16384
#: The least a fence waits for the connections it shut down to be drained (it waits the
#: transfer engine's stall bound when that is longer).
FENCE_LIMIT_S = 5.0


@dataclass
class _RemoteSender:
    """One P rank writing into one D request."""

    p_rank: int
    lease_until: float
    done: bool = False
    success: bool = False
    nbytes: int = 0
    #: per region: P's whole blocks, for regions whose heads D merges itself
    staging: list[torch.Tensor | None] = field(default_factory=list)
    #: the host P's transfer engine writes from ("": not said)
    te_host: str = ""
    #: P said none of its writes can land any more (``PushDone.settled``, or success)
    settled: bool = False


@dataclass
class _Incoming:
    """A D request waiting for its KV."""

    meta: RecvReq
    started: float
    deadline: float
    #: D blocks P writes: those past D's cached prefix
    push_blocks: list[int]
    p_tp: int | None = None
    expected: set[int] | None = None
    senders: dict[str, _RemoteSender] = field(default_factory=dict)
    failure: str | None = None
    cause: str = ""
    #: fencing the connections that could carry a late write (failed requests only)
    fence: WriteFence | None = None

    def active(self, now: float) -> bool:
        """Some sender may still be writing (lease held, not done)."""
        return any(not s.done and s.lease_until > now for s in self.senders.values())

    def complete(self) -> bool:
        ok = {s.p_rank for s in self.senders.values() if s.done and s.success}
        return self.expected is not None and self.expected <= ok

    def unsettled_hosts(self) -> set[str] | None:
        """The hosts of the senders that got a lease and did not say that none of their writes
        can still land (empty: none; ``None``: one did not name its host)."""
        hosts = {s.te_host for s in self.senders.values() if not s.settled}
        return None if "" in hosts else hosts


class PushReceiver:
    """D's side channel, its requests waiting for pushes, and how each ends.

    Args:
        shared: the worker's identity, KV cache registration and handshake state.

    Attributes:
        server: the side-channel server (``None`` until :meth:`serve`).
        incoming: requests waiting for their KV, by request id.
        virtual_request: virtual requests started this step, reported finished by the
            next :meth:`collect_finished` (upstream's name).
    """

    def __init__(self, shared: P2PWorkerBase) -> None:
        self.shared = shared
        self.cfg = shared.cfg
        self.recorder = shared.recorder
        self.server: RpcServer[Message] | None = None
        self.incoming: dict[str, _Incoming] = {}
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._cv = threading.Condition()
        self.virtual_request: set[str] = set()
        # the addresses of D's blocks for keyed grants, and the metadata they were made of
        self._addresses: tuple[AgentMeta, BlockAddresser] | None = None
        self._done_recving: set[str] = set()
        self._failed_blocks: set[int] = set()
        #: requests that failed (not aborted) and are not reported yet
        self._failed_reqs: set[str] = set()

    # ================================================================ set-up
    def serve(self) -> None:
        """Start the side channel on this rank's port."""
        shared = self.shared
        # under a key, requests must be sealed for this rank's port and this instance's
        # engine id (P takes it from the params D posted: remote_engine_id)
        self.server = RpcServer(tcp_endpoint(shared.host, shared.port), LAYERWISE_CODEC,
                                self.handle, name=f"layerwise-side-channel-{shared.port}",
                                engine_id=getattr(shared, "engine_id", "")).start()

    def stop(self) -> None:
        """Stop serving and release every staging buffer."""
        if self.server is not None:
            self.server.stop()
            self.server = None
        with self._cv:
            for inc in self.incoming.values():
                self._release_staging(inc)

    # ================================================================ side channel
    def handle(self, msg: Message) -> Message:
        """Side-channel handler (runs on the server thread)."""
        if isinstance(msg, GetMeta):
            assert self.shared.meta is not None
            if self._keyed:  # the regions go with each request's grant only
                return msgspec.structs.replace(self.shared.meta, region_addrs=[])
            return self.shared.meta
        if isinstance(msg, PushBegin):
            return self._on_begin(msg)
        if isinstance(msg, PushRenew):
            return self._on_renew(msg)
        if isinstance(msg, PushDone):
            return self._on_done(msg)
        return ErrorReply(code="unsupported", message=f"{type(msg).__name__} is not a request")

    @property
    def _keyed(self) -> bool:
        return self.server is not None and self.server.auth is not None

    def _token_ok(self, inc: _Incoming, presented: str) -> bool:
        """Whether a ``PushBegin``/``PushDone`` may act on ``inc`` (module docstring)."""
        return capability_ok(inc.meta.push_token, presented, keyed=self._keyed,
                             socket=self.server.name if self.server else "layerwise-side-channel")

    def _on_begin(self, msg: PushBegin) -> Message:
        shared = self.shared
        layout = shared.layout
        assert layout is not None and shared.te is not None
        if msg.protocol_version != LAYERWISE_PROTOCOL_VERSION:
            return ErrorReply(code="mismatch", message=f"layerwise protocol version "
                              f"{msg.protocol_version}, this D speaks "
                              f"{LAYERWISE_PROTOCOL_VERSION}")
        deadline = time.monotonic() + BEGIN_WAIT_S
        with self._cv:
            inc = self.incoming.get(msg.request_id)
            while inc is None and time.monotonic() < deadline:
                # D's worker may not have this step's metadata yet
                self._cv.wait(max(0.0, deadline - time.monotonic()))
                inc = self.incoming.get(msg.request_id)
            if inc is None:
                if msg.request_id in self._ended:
                    return ErrorReply(code="closed", message=f"request {msg.request_id!r} "
                                      "already ended on D")
                return ErrorReply(code="unknown_request",
                                  message=f"D is not waiting for request {msg.request_id!r}")
            if not self._token_ok(inc, msg.token):
                return ErrorReply(code="bad_token", message=f"request {msg.request_id!r}: the "
                                  "push does not carry the request's token (remote_push_token)")
            if inc.failure is not None:
                return ErrorReply(code="closed", message=f"request {msg.request_id!r} is "
                                  f"failing on D: {inc.failure}")
            if msg.block_ids != inc.push_blocks:
                return ErrorReply(code="bad_blocks", message=f"request {msg.request_id!r} "
                                  f"waits in blocks {inc.push_blocks[:8]}, not "
                                  f"{msg.block_ids[:8]}")
            try:
                plan = head_slices(shared.total_kv_heads, msg.p_tp_size, shared.tp_size,
                                   shared.tp_rank, is_mla=layout.is_mla)
            except (HandshakeMismatchError, ValueError) as exc:
                return ErrorReply(code="mismatch", message=str(exc))
            ranks = {s.remote_rank for s in plan}
            if inc.p_tp is not None and inc.p_tp != msg.p_tp_size:
                return ErrorReply(code="mismatch", message=f"P TP size {msg.p_tp_size} differs "
                                  f"from another sender's {inc.p_tp}")
            if msg.p_rank not in ranks:
                return ErrorReply(code="not_a_sender", message=f"P rank {msg.p_rank} holds none "
                                  f"of the heads of D rank {shared.tp_rank}")
            if len(msg.block_lens) != len(layout.regions):
                return ErrorReply(code="mismatch", message=f"P has {len(msg.block_lens)} KV "
                                  f"regions, D has {len(layout.regions)}")
            inc.p_tp, inc.expected = msg.p_tp_size, ranks
            now = time.monotonic()
            sender = inc.senders.get(msg.sender)
            if sender is None:
                try:
                    staging = allocate_staging(
                        shared.te, layout.regions, msg.block_lens,
                        [s for s in plan if s.remote_rank == msg.p_rank], len(inc.push_blocks))
                except (TransferError, RuntimeError) as exc:
                    return ErrorReply(code="staging", message=f"cannot stage the pushes: {exc}")
                sender = _RemoteSender(msg.p_rank, now + self.cfg.lease_ttl_s, staging=staging,
                                       te_host=msg.te_host)
                inc.senders[msg.sender] = sender
            elif sender.done:
                return ErrorReply(code="closed", message=f"{msg.sender} already finished "
                                  f"request {msg.request_id!r}")
            sender.lease_until = now + self.cfg.lease_ttl_s
            grant = PushGrant(
                lease_s=self.cfg.lease_ttl_s, num_senders=len(ranks),
                staging_addrs=[t.data_ptr() if t is not None else 0 for t in sender.staging],
                staging_strides=[t[0].numel() * t.element_size() if t is not None else 0
                                 for t in sender.staging])
            if not self._keyed:
                return grant
            # a keyed D: where each block of the push is (none where P writes the staging)
            addresser = self._addresser()
            return PushBlocksGrant(
                **msgspec.structs.asdict(grant), num_regions=addresser.num_regions,
                block_addrs=addresser.of(inc.push_blocks,
                                         skip=[t is not None for t in sender.staging]))

    def _addresser(self) -> BlockAddresser:
        """The addresses of D's blocks for keyed grants (made once a registration)."""
        meta = self.shared.meta
        assert meta is not None
        made = self._addresses
        if made is None or made[0] is not meta:
            made = self._addresses = (meta, BlockAddresser(meta.region_addrs,
                                                           meta.region_strides))
        return made[1]

    def _on_renew(self, msg: PushRenew) -> Message:
        """Renew ``msg.sender``'s leases of the requests whose token matches, none at or past
        its request's deadline; the reply lists those renewed."""
        granted = []
        now = time.monotonic()
        with self._cv:
            for i, rid in enumerate(msg.request_ids):
                inc = self.incoming.get(rid)
                sender = inc.senders.get(msg.sender) if inc is not None else None
                if inc is None or sender is None or sender.done or inc.failure is not None:
                    continue
                if not self._token_ok(inc, token_of(msg.tokens, i)) or now >= inc.deadline:
                    continue
                sender.lease_until = now + self.cfg.lease_ttl_s
                granted.append(rid)
        return PushRenewReply(granted=granted)

    def _on_done(self, msg: PushDone) -> Message:
        with self._cv:
            inc = self.incoming.get(msg.request_id)
            if inc is None:
                self.recorder.inc("p2p_late_completions")
                return PushDoneAck(accepted=False)
            if not self._token_ok(inc, msg.token):
                return ErrorReply(code="bad_token", message=f"request {msg.request_id!r}: Done "
                                  "does not carry the request's token (remote_push_token)")
            sender = inc.senders.get(msg.sender)
            if sender is None:
                if msg.success:
                    return PushDoneAck(accepted=False)  # success without a grant: ignore
                # P gave up before its first write: the count can never be reached
                if inc.failure is None:
                    inc.failure, inc.cause = f"P gave up: {msg.reason}", "p_failed"
                self._cv.notify_all()  # wakes an idle step's wait_any
                return PushDoneAck(accepted=True)
            if sender.done:
                return PushDoneAck(accepted=False)
            sender.done, sender.success, sender.nbytes = True, msg.success, msg.nbytes
            sender.settled = msg.success or msg.settled
            if not msg.success and inc.failure is None:
                inc.failure, inc.cause = f"P {msg.sender} failed: {msg.reason}", "p_failed"
            self._cv.notify_all()  # wakes an idle step's wait_any
            return PushDoneAck(accepted=True)

    # ================================================================ the step
    def expect(self, requests: Iterable[RecvReq], failed_posts: dict[str, str]) -> None:
        """Register this step's requests (a virtual one is ready at once) and fail those
        whose metaserver post failed for good."""
        now = time.monotonic()
        block_size = self.shared.block_size
        with self._cv:
            for meta in requests:
                if meta.do_virtual:
                    # Virtual push: nothing is transferred, the request is ready at once.
                    self.virtual_request.add(meta.request_id)
                    continue
                first = meta.cached_tokens // block_size
                inc = _Incoming(meta, now, now + self.cfg.load_timeout_s,
                                [b for _, _, b in push_order(meta.local_block_ids,
                                                             meta.block_groups, first)])
                if meta.error is not None:
                    inc.failure, inc.cause = f"bad kv_transfer_params: {meta.error}", "bad_params"
                self.incoming[meta.request_id] = inc
            for rid, reason in failed_posts.items():
                self.recorder.inc("p2p_failed_posts")
                waiting = self.incoming.get(rid)
                if waiting is not None and waiting.failure is None:
                    waiting.failure = f"metaserver post failed: {reason}"
                    waiting.cause = "metaserver"
            self._cv.notify_all()

    def collect_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests that ended (received, failed or virtual) since the last call."""
        return self.collect_results(finished_req_ids)[0]

    def collect_results(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """As :meth:`collect_finished`, and those of them that failed for vLLM to recompute or
        fail (vLLM's ``failed_recving``; their blocks also go to :meth:`take_load_errors`)."""
        now = time.monotonic()
        # A P rank counts as gone when its write lease lapsed unrenewed. While this side
        # channel is held up (D starved of CPU), P's renewals wait in its socket: only a
        # lease overdue by a whole lease_ttl_s counts until the side channel caught up.
        server = self.server
        lapsed_by = now if server is None else server.lapse_clock(self.cfg.lease_ttl_s, now)
        ended: list[tuple[_Incoming, bool]] = []
        failing: list[_Incoming] = []
        with self._cv:
            for rid, inc in self.incoming.items():
                if inc.failure is None:
                    if rid in finished_req_ids:
                        inc.failure, inc.cause = "the request ended on D", "aborted"
                    elif now >= inc.deadline:
                        inc.failure, inc.cause = (f"no KV within the {self.cfg.load_timeout_s:.1f}s"
                                                  " deadline", "deadline")
                        self.recorder.inc("p2p_load_deadlines")
                    elif any(not s.done and s.lease_until <= lapsed_by
                             for s in inc.senders.values()):
                        inc.failure, inc.cause = ("a P rank stopped renewing its write lease "
                                                  "(P presumed dead)", "peer_lost")
                if inc.failure is None and inc.complete():
                    ended.append((inc, True))
                elif inc.failure is not None and not inc.active(now):
                    # no sender may start a write any more: once none on the way can land,
                    # the blocks can go back
                    failing.append(inc)
        # (outside the lock: a fence reads the kernel's socket table)
        ended += [(inc, False) for inc in failing if self._fenced(inc)]
        with self._cv:
            for inc, _ok in ended:
                rid = inc.meta.request_id
                del self.incoming[rid]
                self._ended[rid] = None
                while len(self._ended) > _ENDED_MEMORY:
                    self._ended.popitem(last=False)
            pending = len(self.incoming)
        for inc, ok in ended:
            self._end(inc, ok=ok)
        self.recorder.set("p2p_pending_loads", pending)
        out, self._done_recving = self._done_recving, set()
        failed, self._failed_reqs = self._failed_reqs & out, self._failed_reqs - out
        if self.virtual_request:
            self.recorder.inc("p2p_virtual_requests", len(self.virtual_request))
            out |= self.virtual_request
            self.virtual_request = set()
        return out, failed

    def _fenced(self, inc: _Incoming) -> bool:
        """Whether no write of ``inc``'s failed push can land any more: every sender said so,
        or the connections from the others' hosts were shut down and drained
        (:mod:`.layerwise.fence`)."""
        te = self.shared.te
        if inc.fence is None:
            hosts = inc.unsettled_hosts()
            ports: set[int] = getattr(te, "listen_ports", set())
            if hosts == set() or te is None or te.protocol != "tcp" or not ports:
                return True  # nothing on the way, or not the TCP transport (no replays)
            inc.fence = WriteFence(ports, None if hosts is None else resolve_hosts(hosts),
                                   limit_s=max(FENCE_LIMIT_S, te.stall_bound_s))
        fence = inc.fence
        if not fence.poll():
            return False
        self.recorder.inc("p2p_write_fences",
                          outcome="timeout" if fence.timed_out else "drained")
        self.recorder.inc("p2p_fenced_connections", fence.closed)
        log = logger.error if fence.timed_out else logger.info
        log("request %s: fenced its failed push (%d transfer-engine connections from %s "
            "shut down%s) before handing its blocks back", inc.meta.request_id, fence.closed,
            "every peer" if fence.hosts is None else ", ".join(sorted(fence.hosts)),
            ", NOT drained within the limit" if fence.timed_out else "")
        return True

    def wait_any(self, timeout: float) -> bool:
        """Block until some request waiting for its KV can end (received, failed, virtual),
        at most ``timeout`` seconds; at once when none waits. False on timeout (deadlines
        and lapsed leases are checked by :meth:`collect_finished`, not here)."""
        def ready() -> bool:
            return (not self.incoming or bool(self.virtual_request) or bool(self._done_recving)
                    or any(inc.failure is not None or inc.complete()
                           for inc in self.incoming.values()))
        with self._cv:
            return self._cv.wait_for(ready, timeout)

    def take_load_errors(self) -> set[int]:
        """Blocks of the requests that failed since the last call."""
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def _end(self, inc: _Incoming, *, ok: bool) -> None:
        rid = inc.meta.request_id
        if ok:
            try:
                self._merge_staging(inc)
            except Exception as exc:  # a broken merge must fail the request, not the engine
                logger.exception("request %s: merging staged heads failed", rid)
                ok, inc.failure, inc.cause = False, f"{type(exc).__name__}: {exc}", "internal"
        self._release_staging(inc)
        self._done_recving.add(rid)
        if ok:
            nbytes = sum(s.nbytes for s in inc.senders.values())
            self.recorder.inc("p2p_requests_loaded")
            self.recorder.observe("p2p_transfer_seconds", time.monotonic() - inc.started)
            self.recorder.observe("p2p_transfer_request_bytes", nbytes)
            return
        if inc.cause != "aborted":
            # (an aborted request is gone from vLLM's queues: no one to recompute for)
            self._failed_blocks.update(inc.push_blocks)
            self._failed_reqs.add(rid)
        self.recorder.inc("p2p_failures", cause=inc.cause or "error")
        logger.error("request %s: layerwise KV load failed (%s): %s; its %d blocks are reported "
                     "for recompute/failure", rid, inc.cause, inc.failure, len(inc.push_blocks))

    # ================================================================ staging
    def _merge_staging(self, inc: _Incoming) -> None:
        """Merge the senders' staged heads into this rank's blocks."""
        shared = self.shared
        assert shared.layout is not None
        if not any(t is not None for s in inc.senders.values() for t in s.staging):
            return
        assert inc.p_tp is not None
        plan = head_slices(shared.total_kv_heads, inc.p_tp, shared.tp_size, shared.tp_rank,
                           is_mla=shared.layout.is_mla)
        for i, region in enumerate(shared.layout.regions):
            staged: dict[int, torch.Tensor] = {}
            for sender in inc.senders.values():
                buf = sender.staging[i] if i < len(sender.staging) else None
                if buf is not None:
                    staged[sender.p_rank] = buf
            if staged:
                merge_staged_heads(region, staged, plan, inc.push_blocks)

    def _release_staging(self, inc: _Incoming) -> None:
        if self.shared.te is None:
            return
        for sender in inc.senders.values():
            release_staging(self.shared.te, sender.staging)
            sender.staging = []
