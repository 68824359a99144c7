# SPDX-License-Identifier: Apache-2.0
"""Worker side of ``MooncakeLayerwiseConnector`` (prefill pushes layer by layer).

P worker (``kv_producer``): for every step whose metadata names blocks to
push, ``save_kv_layer`` queues that layer's writes as soon as the attention
layer has written it; a sender thread writes them into D's blocks with the
transfer engine while the forward pass goes on with the next layer.
``wait_for_save`` pushes any layer whose hook did not run, queues a
``PushDone`` for the requests whose prompt this step completed, and waits for
the step's pushes to end (bounded by ``save_wait_s``), so no write reads a
block after the step that owns it. Before its first write to a D rank, P
checks D's cache description (``GetMeta``) and asks D for a write lease on
exactly the blocks D allocated (``PushBegin``); a renewer thread keeps the
leases alive. A D that died, refused, or revoked the lease stops the pushes
of that request, which P reports to D (``PushDone(success=False)``) when it can.
P reports a request in ``finished_sending`` (freeing its blocks) once vLLM
finished it and no queued write reads its blocks.

D worker (``kv_consumer``): serves the side channel. Each request waits under
a deadline; it completes when every P rank that pushes to this rank said
``PushDone``, and fails at once when a sender failed, when a sender that
began stops renewing its lease (P died), or at the deadline; a failing request
is only reported once no sender can still write into its blocks (each lease
ended or lapsed). Failed requests' blocks go to
``get_block_ids_with_load_errors``. A virtual request (``do_virtual``) is
reported finished at once, with no transfer.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from vllm_ascend.distributed.kernels import gather_blocks, scatter_blocks
from vllm_ascend.distributed.kv_transfer.core.channel import RpcServer, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeLayerwiseConfig
from vllm_ascend.distributed.kv_transfer.core.device import device_of
from vllm_ascend.distributed.kv_transfer.core.errors import (
    KVTransferError,
    PeerTimeoutError,
    RemoteError,
    TransferError,
)
from vllm_ascend.distributed.kv_transfer.core.layout import KVRegion
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.wire import ErrorReply, Message

from .errors import HandshakeMismatchError, RemoteKVUnavailable
from .layerwise_scheduler import MooncakeLayerwiseConnectorMetadata, ReqMeta
from .params import PushTarget
from .protocol import (
    LAYERWISE_CODEC,
    LAYERWISE_PROTOCOL_VERSION,
    AgentMeta,
    GetMeta,
    PushBegin,
    PushDone,
    PushDoneAck,
    PushGrant,
    PushRenew,
    PushRenewReply,
    compatibility_problem,
    worker_port,
)
from .tp_plan import PullSlice, plan_pulls
from .worker_base import P2PWorkerBase, heads_in_block

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

#: How long P retries a PushBegin that D answers "unknown request" (D's worker learns of
#: the request with the step after its scheduler posted it to the metaserver).
BEGIN_RETRY_S = 10.0
#: How long D's side channel waits for a request's registration before answering "unknown".
BEGIN_WAIT_S = 0.2
#: P stops writing this fraction of a lease before it runs out (D measures its lease from a
#: later instant, so P's view always ends first).
LEASE_MARGIN = 0.2
#: Layers of one step queued behind each other are pushed in one batch write, at most this
#: many (a write is one round of the transfer engine; the lease is checked before each).
MAX_MERGED_LAYERS = 64
#: How many ended request ids D remembers (to tell "ended" from "never had").
_ENDED_MEMORY = 16384


# ================================================================================ D state
@dataclass
class _Sender:
    """One P rank writing into one D request."""

    p_rank: int
    lease_until: float
    done: bool = False
    success: bool = False
    nbytes: int = 0
    #: per region: P's whole blocks, for regions whose heads D merges itself
    staging: list[torch.Tensor | None] = field(default_factory=list)


@dataclass
class _Incoming:
    """A D request waiting for its KV."""

    meta: ReqMeta
    started: float
    deadline: float
    #: D blocks P writes: those past D's cached prefix
    push_blocks: list[int]
    p_tp: int | None = None
    expected: set[int] | None = None
    senders: dict[str, _Sender] = field(default_factory=dict)
    failure: str | None = None
    cause: str = ""

    def active(self, now: float) -> bool:
        """Some sender may still be writing (lease held, not done)."""
        return any(not s.done and s.lease_until > now for s in self.senders.values())

    def complete(self) -> bool:
        ok = {s.p_rank for s in self.senders.values() if s.done and s.success}
        return self.expected is not None and self.expected <= ok


# ================================================================================ P state
@dataclass
class _Link:
    """Pushes of one request from this P rank to one D rank."""

    d_rank: int
    port: int
    slices: list[PullSlice]
    #: new -> granted -> done; granted -> revoked (the renewer was refused) -> done;
    #: any -> broken (the sender gave up and told D) -> done
    state: str = "new"
    reason: str = ""
    meta: AgentMeta | None = None
    valid_until: float = 0.0
    lease_s: float = 0.0
    staging_addrs: list[int] = field(default_factory=list)
    staging_strides: list[int] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class _Outgoing:
    """A P request whose KV this rank pushes."""

    request_id: str
    target: PushTarget
    links: list[_Link]
    #: first block position P pushes (D's cached prefix ends there)
    first_position: int
    #: queued layer tasks that read this request's blocks
    pending: int = 0
    closed: bool = False


@dataclass
class _StepItem:
    out: _Outgoing
    positions: list[int]
    local_block_ids: list[int]
    last: bool


@dataclass
class _LayerTask:
    layer: int
    event: Any
    items: list[_StepItem]


@dataclass
class _StepEnd:
    items: list[_StepItem]
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _LinkFailed:
    """The renewer saw D refuse a lease: the sender thread tells D (after any write)."""

    out: _Outgoing
    link: _Link


@dataclass
class _Notify:
    """Tell D a request failed (no blocks are read)."""

    target: PushTarget | None
    endpoint: tuple[str, int, str, int] | None
    reason: str


class LayerwiseWorker(P2PWorkerBase):
    """Worker-side logic of the layerwise connector (both roles)."""

    cfg: MooncakeLayerwiseConfig

    def __init__(self, vllm_config: VllmConfig, cfg: MooncakeLayerwiseConfig, engine_id: str,
                 recorder: MetricsRecorder, *, tp_rank: int | None = None,
                 pp_rank: int | None = None) -> None:
        super().__init__(vllm_config, cfg, engine_id, recorder, codec=LAYERWISE_CODEC,
                         tp_rank=tp_rank, pp_rank=pp_rank)
        self._layer_index: dict[str, int] = {}
        # ---- D state
        self.server: RpcServer[Message] | None = None
        self._incoming: dict[str, _Incoming] = {}
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._cv = threading.Condition()
        #: virtual requests started this step, reported finished by the next get_finished
        self.virtual_request: set[str] = set()
        self._done_recving: set[str] = set()
        self._failed_blocks: set[int] = set()
        # ---- P state
        self._sessions: dict[str, _Outgoing] = {}
        self._finished_seen: set[str] = set()
        self._plock = threading.Lock()
        self._queue: queue.Queue[Any] = queue.Queue()
        #: a task the sender took while merging layers that belongs to the next turn
        self._carry: Any = None
        self._sender: threading.Thread | None = None
        self._renewer: threading.Thread | None = None
        self._stop = threading.Event()
        self._step_meta: Any = None
        self._step_items: list[_StepItem] = []
        self._step_layers: set[int] = set()
        #: layer pushes queued by the attention layer's save_kv_layer hook, and by
        #: wait_for_save because the hook did not run (checks that the backend calls it)
        self.hooked_layer_pushes = 0
        self.fallback_layer_pushes = 0

    # ================================================================ set-up
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Describe the cache, register it with the transfer engine, start serving/sending."""
        layout = self._register_kv_memory(kv_caches)
        self._layer_index = {layer.name: i for i, layer in enumerate(layout.layers)}
        assert self.te is not None
        if self.is_consumer and self._write_window_end(0.0, self.cfg.lease_ttl_s) < (
                self.cfg.lease_ttl_s / 2):
            logger.warning(
                "lease_ttl_s=%.1f is short for the transfer engine's stall bound of %.0f s "
                "(MC_TCP_PROGRESS_TIMEOUT_SEC): P may start writes only during %.1f s of each "
                "lease; raise lease_ttl_s or lower the stall bound", self.cfg.lease_ttl_s,
                self.te.stall_bound_s, self._write_window_end(0.0, self.cfg.lease_ttl_s))
        if self.is_consumer:
            self.server = RpcServer(tcp_endpoint(self.host, self.port), LAYERWISE_CODEC,
                                    self._handle, name=f"layerwise-side-channel-{self.port}"
                                    ).start()
            logger.info("D side channel on %s (engine %s, %d layers, %d blocks)",
                        self.server.endpoint, self.engine_id, layout.num_layers,
                        layout.num_blocks)
        if self.is_producer:
            self._sender = threading.Thread(target=self._send_loop, name="layerwise-sender",
                                            daemon=True)
            self._sender.start()
            self._renewer = threading.Thread(target=self._renew_loop, name="layerwise-renewer",
                                             daemon=True)
            self._renewer.start()

    def shutdown(self) -> None:
        """Stop serving and sending, release the registered memory."""
        self._stop.set()
        if self._sender is not None:
            self._queue.put(None)
            self._sender.join(5)
        if self._renewer is not None:
            self._renewer.join(5)
        if self.server is not None:
            self.server.stop()
            self.server = None
        with self._cv:
            for inc in self._incoming.values():
                self._release_staging(inc)
        self._release_resources()

    # ================================================================ D side
    def _handle(self, msg: Message) -> Message:
        """Side-channel handler (runs on the server thread)."""
        if isinstance(msg, GetMeta):
            assert self.meta is not None
            return self.meta
        if isinstance(msg, PushBegin):
            return self._on_begin(msg)
        if isinstance(msg, PushRenew):
            return self._on_renew(msg)
        if isinstance(msg, PushDone):
            return self._on_done(msg)
        return ErrorReply(code="unsupported", message=f"{type(msg).__name__} is not a request")

    def _on_begin(self, msg: PushBegin) -> Message:
        assert self.layout is not None
        if msg.protocol_version != LAYERWISE_PROTOCOL_VERSION:
            return ErrorReply(code="mismatch", message=f"layerwise protocol version "
                              f"{msg.protocol_version}, this D speaks "
                              f"{LAYERWISE_PROTOCOL_VERSION}")
        deadline = time.monotonic() + BEGIN_WAIT_S
        with self._cv:
            inc = self._incoming.get(msg.request_id)
            while inc is None and time.monotonic() < deadline:
                # D's worker may not have this step's metadata yet
                self._cv.wait(max(0.0, deadline - time.monotonic()))
                inc = self._incoming.get(msg.request_id)
            if inc is None:
                if msg.request_id in self._ended:
                    return ErrorReply(code="closed", message=f"request {msg.request_id!r} "
                                      "already ended on D")
                return ErrorReply(code="unknown_request",
                                  message=f"D is not waiting for request {msg.request_id!r}")
            if inc.failure is not None:
                return ErrorReply(code="closed", message=f"request {msg.request_id!r} is "
                                  f"failing on D: {inc.failure}")
            if msg.block_ids != inc.push_blocks:
                return ErrorReply(code="bad_blocks", message=f"request {msg.request_id!r} "
                                  f"waits in blocks {inc.push_blocks[:8]}, not "
                                  f"{msg.block_ids[:8]}")
            try:
                plan = plan_pulls(self.total_kv_heads, msg.p_tp_size, self.tp_size,
                                  self.tp_rank, is_mla=self.layout.is_mla)
            except (HandshakeMismatchError, ValueError) as exc:
                return ErrorReply(code="mismatch", message=str(exc))
            ranks = {s.p_rank for s in plan}
            if inc.p_tp is not None and inc.p_tp != msg.p_tp_size:
                return ErrorReply(code="mismatch", message=f"P TP size {msg.p_tp_size} differs "
                                  f"from another sender's {inc.p_tp}")
            if msg.p_rank not in ranks:
                return ErrorReply(code="not_a_sender", message=f"P rank {msg.p_rank} holds none "
                                  f"of the heads of D rank {self.tp_rank}")
            if len(msg.block_lens) != len(self.layout.regions):
                return ErrorReply(code="mismatch", message=f"P has {len(msg.block_lens)} KV "
                                  f"regions, D has {len(self.layout.regions)}")
            inc.p_tp, inc.expected = msg.p_tp_size, ranks
            now = time.monotonic()
            sender = inc.senders.get(msg.sender)
            if sender is None:
                try:
                    staging = self._staging_for(msg, [s for s in plan if s.p_rank == msg.p_rank],
                                                len(inc.push_blocks))
                except (TransferError, RuntimeError) as exc:
                    return ErrorReply(code="staging", message=f"cannot stage the pushes: {exc}")
                sender = _Sender(msg.p_rank, now + self.cfg.lease_ttl_s, staging=staging)
                inc.senders[msg.sender] = sender
            elif sender.done:
                return ErrorReply(code="closed", message=f"{msg.sender} already finished "
                                  f"request {msg.request_id!r}")
            sender.lease_until = now + self.cfg.lease_ttl_s
            return PushGrant(
                lease_s=self.cfg.lease_ttl_s, num_senders=len(ranks),
                staging_addrs=[t.data_ptr() if t is not None else 0 for t in sender.staging],
                staging_strides=[t[0].numel() * t.element_size() if t is not None else 0
                                 for t in sender.staging])

    def _staging_for(self, msg: PushBegin, slices: list[PullSlice],
                     n_blocks: int) -> list[torch.Tensor | None]:
        """Staging buffers of the regions this sender cannot write into D's blocks directly."""
        assert self.layout is not None and self.te is not None
        out: list[torch.Tensor | None] = []
        for region, p_len in zip(self.layout.regions, msg.block_lens, strict=True):
            if _direct(region, slices, p_len):
                out.append(None)
                continue
            heads_p = p_len // (region.block_len // heads_in_block(region))
            shape = list(region.block_shape)
            shape[region.head_axis or 0] = heads_p
            buf = torch.empty((n_blocks, *shape), dtype=region.tensor.dtype,
                              device=region.tensor.device)
            self.te.register_memory(buf.data_ptr(), buf.numel() * buf.element_size())
            out.append(buf)
        return out

    def _release_staging(self, inc: _Incoming) -> None:
        if self.te is None:
            return
        for sender in inc.senders.values():
            for buf in sender.staging:
                if buf is not None:
                    self.te.unregister_memory(buf.data_ptr())
            sender.staging = []

    def _on_renew(self, msg: PushRenew) -> Message:
        granted = []
        now = time.monotonic()
        with self._cv:
            for rid in msg.request_ids:
                inc = self._incoming.get(rid)
                sender = inc.senders.get(msg.sender) if inc is not None else None
                if inc is None or sender is None or sender.done or inc.failure is not None:
                    continue
                sender.lease_until = now + self.cfg.lease_ttl_s
                granted.append(rid)
        return PushRenewReply(granted=granted)

    def _on_done(self, msg: PushDone) -> Message:
        with self._cv:
            inc = self._incoming.get(msg.request_id)
            if inc is None:
                self.recorder.inc("p2p_late_completions")
                return PushDoneAck(accepted=False)
            sender = inc.senders.get(msg.sender)
            if sender is None:
                if msg.success:
                    return PushDoneAck(accepted=False)  # success without a grant: ignore
                # P gave up before its first write: the count can never be reached
                if inc.failure is None:
                    inc.failure, inc.cause = f"P gave up: {msg.reason}", "p_failed"
                return PushDoneAck(accepted=True)
            if sender.done:
                return PushDoneAck(accepted=False)
            sender.done, sender.success, sender.nbytes = True, msg.success, msg.nbytes
            if not msg.success and inc.failure is None:
                inc.failure, inc.cause = f"P {msg.sender} failed: {msg.reason}", "p_failed"
            return PushDoneAck(accepted=True)

    def start_load_kv(self, metadata: MooncakeLayerwiseConnectorMetadata) -> None:
        """D: register this step's incoming requests; P: make sure the step is prepared."""
        self._begin_step(metadata)
        if not self.is_consumer:
            return
        now = time.monotonic()
        with self._cv:
            for meta in metadata.requests.values():
                if meta.do_virtual:
                    # Virtual push: nothing is transferred, the request is ready at once.
                    self.virtual_request.add(meta.request_id)
                    continue
                first = meta.cached_tokens // self.block_size
                inc = _Incoming(meta, now, now + self.cfg.load_timeout_s,
                                list(meta.local_block_ids[first:]))
                if meta.error is not None:
                    inc.failure, inc.cause = f"bad kv_transfer_params: {meta.error}", "bad_params"
                self._incoming[meta.request_id] = inc
            for rid, reason in metadata.failed_posts.items():
                self.recorder.inc("p2p_failed_posts")
                waiting = self._incoming.get(rid)
                if waiting is not None and waiting.failure is None:
                    waiting.failure = f"metaserver post failed: {reason}"
                    waiting.cause = "metaserver"
            self._cv.notify_all()

    def _collect_recving(self, finished_req_ids: set[str]) -> set[str]:
        now = time.monotonic()
        ended: list[tuple[_Incoming, bool]] = []
        with self._cv:
            for rid, inc in self._incoming.items():
                if inc.failure is None:
                    if rid in finished_req_ids:
                        inc.failure, inc.cause = "the request ended on D", "aborted"
                    elif now >= inc.deadline:
                        inc.failure, inc.cause = (f"no KV within the {self.cfg.load_timeout_s:.1f}s"
                                                  " deadline", "deadline")
                        self.recorder.inc("p2p_load_deadlines")
                    elif any(not s.done and s.lease_until <= now for s in inc.senders.values()):
                        inc.failure, inc.cause = ("a P rank stopped renewing its write lease "
                                                  "(P presumed dead)", "peer_lost")
                if inc.failure is None and inc.complete():
                    ended.append((inc, True))
                elif inc.failure is not None and not inc.active(now):
                    # nobody can write into these blocks any more: safe to hand them back
                    ended.append((inc, False))
            for inc, _ok in ended:
                rid = inc.meta.request_id
                del self._incoming[rid]
                self._ended[rid] = None
                while len(self._ended) > _ENDED_MEMORY:
                    self._ended.popitem(last=False)
            pending = len(self._incoming)
        for inc, ok in ended:
            self._end(inc, ok=ok)
        self.recorder.set("p2p_pending_loads", pending)
        out, self._done_recving = self._done_recving, set()
        if self.virtual_request:
            self.recorder.inc("p2p_virtual_requests", len(self.virtual_request))
            out |= self.virtual_request
            self.virtual_request = set()
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
        self.recorder.inc("p2p_failures", cause=inc.cause or "error")
        logger.error("request %s: layerwise KV load failed (%s): %s; its %d blocks are reported "
                     "for recompute/failure", rid, inc.cause, inc.failure, len(inc.push_blocks))

    def _merge_staging(self, inc: _Incoming) -> None:
        """Copy each sender's staged heads into this rank's blocks."""
        assert self.layout is not None
        if not any(t is not None for s in inc.senders.values() for t in s.staging):
            return
        assert inc.p_tp is not None
        plan = plan_pulls(self.total_kv_heads, inc.p_tp, self.tp_size, self.tp_rank,
                          is_mla=self.layout.is_mla)
        regions = self.layout.regions
        for sender in inc.senders.values():
            for i, buf in enumerate(sender.staging):
                if buf is None:
                    continue
                region = regions[i]
                # head resharding with ascend-kernels' block ops (NPU fast paths on NPU)
                ids = inc.push_blocks
                axis = (region.head_axis or 0) + 1
                dst = gather_blocks(region.tensor, ids)
                for sl in plan:
                    if sl.p_rank != sender.p_rank:
                        continue
                    dst.narrow(axis, sl.local_offset, sl.num_heads).copy_(
                        buf.narrow(axis, sl.remote_offset, sl.num_heads))
                scatter_blocks(dst, region.tensor, ids)

    # ================================================================ P side
    def _begin_step(self, metadata: MooncakeLayerwiseConnectorMetadata | None) -> None:
        """Take this step's pushes from the metadata (once per step, whichever hook runs first)."""
        if metadata is None or metadata is self._step_meta or not self.is_producer:
            return
        self._step_meta = metadata
        self._step_items = []
        self._step_layers = set()
        for rid, push in metadata.pushes.items():
            if push.abort is not None:
                self._queue.put(_Notify(push.target, push.endpoint, push.abort))
                continue
            assert push.target is not None
            with self._plock:
                out = self._sessions.get(rid)
                if out is None:
                    out = self._open_session(rid, push.target)
                    self._sessions[rid] = out
                if push.positions or push.last:
                    out.pending += 1
            self._step_items.append(_StepItem(out, list(push.positions),
                                              list(push.local_block_ids), push.last))

    def _open_session(self, rid: str, target: PushTarget) -> _Outgoing:
        assert self.layout is not None
        links: list[_Link] = []
        reason = ""
        try:
            for d in range(target.tp_size):
                mine = [s for s in plan_pulls(self.total_kv_heads, self.tp_size, target.tp_size,
                                              d, is_mla=self.layout.is_mla)
                        if s.p_rank == self.tp_rank]
                if mine:
                    links.append(_Link(d, worker_port(target.port, tp_rank=d,
                                                      tp_size=target.tp_size), mine))
        except (HandshakeMismatchError, ValueError) as exc:
            reason = str(exc)
        out = _Outgoing(rid, target, links, target.cached_tokens // self.block_size)
        if reason:
            logger.error("request %s: cannot plan the push to D: %s", rid, reason)
            out.links = [_Link(d, worker_port(target.port, tp_rank=d, tp_size=target.tp_size),
                               [], state="broken", reason=reason)
                         for d in range(target.tp_size)]
        return out

    def save_kv_layer(self, metadata: MooncakeLayerwiseConnectorMetadata | None,
                      layer_name: str, kv_layer: Any) -> None:
        """Queue this layer's pushes (called right after the attention layer wrote its KV)."""
        self._begin_step(metadata)
        if not self._step_items:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None or layer in self._step_layers:
            return
        self._step_layers.add(layer)
        event = None
        if isinstance(kv_layer, torch.Tensor) and kv_layer.device.type != "cpu":
            event = device_of(kv_layer).record_event()
        with self._plock:
            for item in self._step_items:
                item.out.pending += 1
        self.hooked_layer_pushes += 1
        self._queue.put(_LayerTask(layer, event, list(self._step_items)))

    def wait_for_save(self, metadata: MooncakeLayerwiseConnectorMetadata | None) -> None:
        """Push the layers whose hook did not run, close the step, wait for its pushes."""
        self._begin_step(metadata)
        items, self._step_items = self._step_items, []
        if not items or self.layout is None:
            return
        missing = [i for i in range(self.layout.num_layers) if i not in self._step_layers]
        if missing and len(missing) == self.layout.num_layers:
            logger.debug("save_kv_layer was not called this step; pushing all layers now")
        event = None
        regions = self.layout.regions
        if regions and regions[0].tensor.device.type != "cpu":
            event = device_of(regions[0].tensor).record_event()
        with self._plock:
            for item in items:
                item.out.pending += len(missing)
        self.fallback_layer_pushes += len(missing)
        for layer in missing:
            self._queue.put(_LayerTask(layer, event, items))
        end = _StepEnd(items)
        self._queue.put(end)
        if not end.done.wait(self.cfg.save_wait_s):
            logger.warning("this step's pushes are still running after %.1fs; the engine goes on "
                           "and their requests keep their blocks until they end",
                           self.cfg.save_wait_s)

    # ---------------------------------------------------------------- sender thread
    def _next_layers(self, first: _LayerTask) -> list[_LayerTask]:
        """``first`` and the layer tasks of the same step queued right behind it.

        When layers are computed faster than the link moves them, they queue up; one batch
        write of all of them costs one round of the transfer engine instead of one a layer.
        The first task that does not join is kept for the next turn of the loop."""
        tasks = [first]
        key = [id(i) for i in first.items]
        while len(tasks) < MAX_MERGED_LAYERS:
            try:
                task = self._queue.get_nowait()
            except queue.Empty:
                break
            if not (isinstance(task, _LayerTask) and [id(i) for i in task.items] == key):
                self._carry = task
                break
            tasks.append(task)
        return tasks

    def _send_loop(self) -> None:
        while True:
            task, self._carry = (self._carry, None) if self._carry is not None else (
                self._queue.get(), None)
            if task is None or self._stop.is_set():
                return
            try:
                if isinstance(task, _LayerTask):
                    self._run_layers(self._next_layers(task))
                elif isinstance(task, _StepEnd):
                    self._run_step_end(task)
                elif isinstance(task, _Notify):
                    self._run_notify(task)
                elif isinstance(task, _LinkFailed):
                    self._close_failed(task.out, task.link)
            except Exception:  # the sender thread must outlive any one bad task
                logger.exception("layerwise sender: unexpected error")
                if isinstance(task, _StepEnd):
                    task.done.set()

    def _run_layers(self, tasks: list[_LayerTask]) -> None:
        """Push the layers of ``tasks`` (one step's, queued together) in one write per D
        rank; each layer's push time is its share of that write."""
        try:
            for task in tasks:
                if task.event is not None:
                    task.event.synchronize()
            layers = [t.layer for t in tasks]
            start = time.perf_counter()
            moved = 0
            for item in tasks[0].items:
                if not item.positions:
                    continue
                for link in item.out.links:
                    moved += self._push_layer(item, link, layers)
            if moved:
                share = (time.perf_counter() - start) / len(layers)
                for _layer in layers:
                    self.recorder.observe("p2p_layer_transfer_seconds", share)
                self.recorder.inc("p2p_transfer_bytes", moved)
        finally:
            with self._plock:
                for task in tasks:
                    for item in task.items:
                        item.out.pending -= 1

    def _push_layer(self, item: _StepItem, link: _Link, layers: list[int]) -> int:
        out = item.out
        if link.state == "revoked":
            self._close_failed(out, link)
        if link.state not in ("new", "granted"):
            return 0
        try:
            if link.state == "new":
                self._open_link(out, link)
            if time.monotonic() >= link.valid_until:
                self._renew_link(out, link)
            nbytes = self._write_layers(item, link, layers)
            link.nbytes += nbytes
            return nbytes
        except HandshakeMismatchError as exc:
            self._break(out, link, str(exc), cause="handshake_mismatch")
        except RemoteKVUnavailable as exc:
            self._break(out, link, str(exc), cause=exc.code)
        except PeerTimeoutError as exc:
            self._break(out, link, f"D did not answer: {exc}", cause="peer_timeout")
        except TransferError as exc:
            self._break(out, link, str(exc), cause="transfer")
        except (KVTransferError, IndexError, ValueError) as exc:
            self._break(out, link, f"{type(exc).__name__}: {exc}", cause="internal")
        return 0

    def _open_link(self, out: _Outgoing, link: _Link) -> None:
        """Handshake with the D rank, then ask for a write lease on the request's blocks."""
        assert self.layout is not None
        target = out.target
        link.meta = self.remote_meta(target.host, link.port, expect_tp=target.tp_size)
        msg = PushBegin(request_id=target.request_id, sender=self.agent_id,
                        p_rank=self.tp_rank, p_tp_size=self.tp_size,
                        block_ids=target.block_ids[out.first_position:],
                        block_lens=[r.block_len for r in self.layout.regions])
        client = self._client(target.host, link.port)
        give_up = time.monotonic() + BEGIN_RETRY_S
        delay = 0.01
        while True:
            sent = time.monotonic()
            try:
                reply = client.call(msg)
            except RemoteError as exc:
                if exc.code == "unknown_request" and time.monotonic() < give_up:
                    time.sleep(delay)
                    delay = min(delay * 2, 0.5)
                    continue
                raise RemoteKVUnavailable(f"D rank {link.d_rank} refused the push: {exc}",
                                          code=exc.code) from exc
            break
        if not isinstance(reply, PushGrant):
            raise RemoteKVUnavailable(f"unexpected PushBegin reply {type(reply).__name__}")
        with self._plock:
            link.state = "granted"
            link.lease_s = reply.lease_s
            link.valid_until = self._write_window_end(sent, reply.lease_s)
            link.staging_addrs = list(reply.staging_addrs)
            link.staging_strides = list(reply.staging_strides)

    def _write_window_end(self, sent: float, lease_s: float) -> float:
        """Until when P may start a write under a lease D granted after ``sent``.

        D's lease runs ``lease_s`` from a later instant. A write that starts in time can
        still stall in the transfer engine for up to its stall bound before it fails, so P
        stops starting writes that much (and at least ``LEASE_MARGIN`` of the lease) early.
        """
        bound = self.te.stall_bound_s if self.te is not None else 30.0
        return sent + max(0.0, lease_s - max(lease_s * LEASE_MARGIN, bound + 0.5))

    def _renew_link(self, out: _Outgoing, link: _Link) -> None:
        """Renew one lease now (the sender is about to write); raises if D refuses."""
        client = self._client(out.target.host, link.port)
        sent = time.monotonic()
        reply = client.call(PushRenew(request_ids=[out.target.request_id], sender=self.agent_id))
        if not (isinstance(reply, PushRenewReply) and out.target.request_id in reply.granted):
            raise RemoteKVUnavailable("D no longer grants the write lease (request ended or "
                                      "failing on D)", code="revoked")
        with self._plock:
            link.valid_until = self._write_window_end(sent, link.lease_s)

    def _write_layers(self, item: _StepItem, link: _Link, layers: list[int]) -> int:
        """Write ``layers`` of the step's blocks into the D rank, one batch; returns bytes."""
        assert self.layout is not None and self.te is not None and link.meta is not None
        d_meta = link.meta
        out = item.out
        regions = self.layout.regions
        p_blocks = self.layout.num_blocks
        d_blocks = d_meta.layout.num_blocks
        src: list[int] = []
        dst: list[int] = []
        lengths: list[int] = []
        region_ids: list[int] = []
        for layer in layers:
            first = sum(len(x.regions) for x in self.layout.layers[:layer])
            region_ids += range(first, first + len(self.layout.layers[layer].regions))
        for gi in region_ids:
            region = regions[gi]
            d_len = d_meta.layout.block_lens[gi]
            d_base, d_stride = d_meta.region_addrs[gi], d_meta.region_strides[gi]
            staged = bool(link.staging_addrs and link.staging_addrs[gi])
            d_heads = int(d_meta.layout.num_kv_heads)
            for pos, pb in zip(item.positions, item.local_block_ids, strict=True):
                if not 0 <= pb < p_blocks:
                    raise IndexError(f"local block id {pb} is outside [0, {p_blocks})")
                db = out.target.block_ids[pos]
                if not 0 <= db < d_blocks:
                    raise RemoteKVUnavailable(f"D block id {db} is outside D's cache "
                                              f"[0, {d_blocks})", code="bad_blocks")
                p_addr = region.base_addr + pb * region.block_stride
                if staged:
                    k = pos - out.first_position
                    src.append(p_addr)
                    dst.append(link.staging_addrs[gi] + k * link.staging_strides[gi])
                    lengths.append(region.block_len)
                    continue
                d_addr = d_base + db * d_stride
                for sl in link.slices:
                    if region.head_axis is None or (sl.num_heads == d_heads
                                                    and d_len == region.block_len):
                        src.append(p_addr)
                        dst.append(d_addr)
                        lengths.append(region.block_len)
                    elif region.head_axis == 0:
                        per_head = region.block_len // heads_in_block(region)
                        src.append(p_addr + sl.remote_offset * per_head)
                        dst.append(d_addr + sl.local_offset * per_head)
                        lengths.append(sl.num_heads * per_head)
                    else:
                        raise HandshakeMismatchError(
                            f"region {gi}: D rank {link.d_rank} gave no staging buffer for "
                            f"heads that are not contiguous in its blocks")
        with self._plock:
            # never write without a lease (the renewer may have been refused meanwhile)
            if link.state != "granted":
                raise RemoteKVUnavailable("D revoked the write lease", code="revoked")
            if time.monotonic() >= link.valid_until:
                raise RemoteKVUnavailable("the write lease ran out", code="lease_lapsed")
        return self.te.write(d_meta.session, src, dst, lengths)

    def _break(self, out: _Outgoing, link: _Link, reason: str, *, cause: str) -> None:
        """Stop pushing to this D rank and tell it (sender thread, best effort)."""
        with self._plock:
            if link.state in ("broken", "done"):
                return
            link.state, link.reason = "broken", reason
        self.recorder.inc("p2p_failures", cause=cause)
        logger.error("request %s: push to D rank %d stopped (%s): %s", out.request_id,
                     link.d_rank, cause, reason)
        self._send_done(out.target, link.port, success=False, reason=reason)
        with self._plock:
            link.state = "done"

    def _close_failed(self, out: _Outgoing, link: _Link) -> None:
        """Tell D this sender stopped after a refused renewal (sender thread)."""
        with self._plock:
            if link.state != "revoked":
                return
            link.state = "broken"
        self._send_done(out.target, link.port, success=False, reason=link.reason)
        with self._plock:
            link.state = "done"

    def _run_step_end(self, task: _StepEnd) -> None:
        try:
            for item in task.items:
                if not item.last:
                    continue
                out = item.out
                for link in out.links:
                    if link.state == "new":
                        # nothing left to write in the last chunk: begin anyway so that D
                        # counts this sender
                        self._push_layer_begin_only(out, link)
                    if link.state == "revoked":
                        self._close_failed(out, link)
                    if link.state == "granted":
                        accepted = self._send_done(out.target, link.port, success=True,
                                                   nbytes=link.nbytes)
                        with self._plock:
                            link.state = "done"
                        if accepted:
                            self.recorder.inc("p2p_requests_served")
                        else:
                            self.recorder.inc("p2p_failures", cause="not_accepted")
                out.closed = True
        finally:
            with self._plock:
                for item in task.items:
                    if item.positions or item.last:
                        item.out.pending -= 1
            task.done.set()

    def _push_layer_begin_only(self, out: _Outgoing, link: _Link) -> None:
        try:
            self._open_link(out, link)
        except (KVTransferError, IndexError, ValueError) as exc:
            self._break(out, link, f"{type(exc).__name__}: {exc}", cause="begin")

    def _run_notify(self, task: _Notify) -> None:
        if task.target is not None:
            host, port, rid, d_tp = (task.target.host, task.target.port, task.target.request_id,
                                     task.target.tp_size)
        elif task.endpoint is not None:
            host, port, rid, d_tp = task.endpoint
        else:
            logger.error("a layerwise request with unusable params cannot be reported to D "
                         "(%s); D fails it at its deadline", task.reason)
            return
        for d in range(d_tp):
            self._send_done_to(host, worker_port(port, tp_rank=d, tp_size=d_tp), rid,
                               success=False, reason=task.reason)

    def _send_done(self, target: PushTarget, port: int, *, success: bool, reason: str = "",
                   nbytes: int = 0) -> bool:
        return self._send_done_to(target.host, port, target.request_id, success=success,
                                  reason=reason, nbytes=nbytes)

    def _send_done_to(self, host: str, port: int, request_id: str, *, success: bool,
                      reason: str = "", nbytes: int = 0) -> bool:
        try:
            reply = self._client(host, port).call(PushDone(
                request_id=request_id, sender=self.agent_id, success=success,
                reason=reason[:2000], nbytes=nbytes))
        except KVTransferError as exc:
            logger.warning("could not tell D %s:%d that request %s is %s: %s", host, port,
                           request_id, "complete" if success else "failed", exc)
            return False
        return isinstance(reply, PushDoneAck) and reply.accepted

    # ---------------------------------------------------------------- renewer thread
    def _renew_loop(self) -> None:
        interval = max(0.05, self.cfg.lease_ttl_s / 3)
        while not self._stop.wait(interval):
            try:
                self.renew_once()
            except Exception:  # keep renewing whatever one round hit
                logger.exception("layerwise lease renewal failed")

    def renew_once(self) -> None:
        """Renew every granted write lease (one ``PushRenew`` per D rank)."""
        by_port: dict[tuple[str, int], list[tuple[_Outgoing, _Link]]] = {}
        with self._plock:
            for out in self._sessions.values():
                for link in out.links:
                    if link.state == "granted":
                        by_port.setdefault((out.target.host, link.port), []).append((out, link))
        for (host, port), pairs in by_port.items():
            sent = time.monotonic()
            try:
                reply = self._client(host, port).call(PushRenew(
                    request_ids=[o.target.request_id for o, _ in pairs], sender=self.agent_id))
            except KVTransferError as exc:
                logger.debug("lease renewal to %s:%d failed: %s", host, port, exc)
                continue  # writes stop by themselves when the lease runs out
            granted = set(reply.granted) if isinstance(reply, PushRenewReply) else set()
            for out, link in pairs:
                with self._plock:
                    if link.state != "granted":
                        continue
                    if out.target.request_id in granted:
                        link.valid_until = self._write_window_end(sent, link.lease_s)
                        continue
                    link.state, link.reason = "revoked", "D revoked the write lease"
                self.recorder.inc("p2p_failures", cause="revoked")
                self._queue.put(_LinkFailed(out, link))

    # ---------------------------------------------------------------- handshake
    def remote_meta(self, host: str, port: int, *, expect_tp: int) -> AgentMeta:
        """D rank's metadata, fetched once and checked against this instance."""
        assert self.meta is not None
        mine = self.meta
        return self._peer_meta(host, port, peer="D", problem_of=lambda m: compatibility_problem(
            mine, m, expect_tp=expect_tp, configured_tp=self.cfg.decode.tp_size, me="P",
            them="D", verb="receive the KV cache of"))

    # ================================================================ vLLM hooks
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        sending = self._collect_sending(finished_req_ids) if self.is_producer else set()
        recving = self._collect_recving(finished_req_ids) if self.is_consumer else set()
        return sending or None, recving or None

    def _collect_sending(self, finished_req_ids: set[str]) -> set[str]:
        out: set[str] = set()
        notify: list[_Outgoing] = []
        with self._plock:
            self._finished_seen |= finished_req_ids & self._sessions.keys()
            for rid in list(self._finished_seen):
                sess = self._sessions[rid]
                if sess.pending > 0:
                    continue  # a queued push still reads its blocks
                out.add(rid)
                self._finished_seen.discard(rid)
                del self._sessions[rid]
                if not sess.closed:
                    notify.append(sess)
        for sess in notify:
            # P finished the request before its prompt was pushed (aborted): D must not wait
            self._queue.put(_Notify(sess.target, None, "the request ended on the prefill "
                                    "instance before its prompt was pushed"))
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out


def _direct(region: KVRegion, slices: list[PullSlice], p_len: int) -> bool:
    """Whether a P rank's slices of D's ``region`` can be written straight into D's blocks.

    True for MLA (no head axis), for head-major blocks (a slice of heads is one byte
    range), and when the slice is D's whole block and P's block is the same size;
    otherwise P writes its whole blocks into a staging buffer and D merges the heads.
    """
    if region.head_axis is None or region.head_axis == 0:
        return True
    return all(s.num_heads == heads_in_block(region) and p_len == region.block_len for s in slices)

