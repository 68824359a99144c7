# SPDX-License-Identifier: Apache-2.0
"""P side of ``MooncakeLayerwiseConnector``: the sender of each step's layers.

For every step whose metadata names blocks to push, ``save_layer`` queues that
layer's writes as soon as the attention layer has written it; a sender thread
writes them into D's blocks with the transfer engine (through
:class:`~.layerwise.links.PushLinks`) while the forward pass goes on with the
next layer. Layers queued behind each other go out in one batch write.
``wait_for_save`` pushes any layer whose hook did not run, queues the
``PushDone`` of the requests whose prompt this step completed, and waits for the
step's pushes to end (bounded by ``save_wait_s``), so no write reads a block
after the step that owns it. P reports a request in ``finished_sending``
(freeing its blocks) once vLLM finished it and no queued write reads its blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_ascend.distributed.kv_transfer.core.device import device_of
from vllm_ascend.distributed.kv_transfer.core.errors import (
    KVTransferError,
    PeerTimeoutError,
    TransferError,
)
from vllm_ascend.distributed.kv_transfer.core.kv_groups import KVGroups
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeLayerwiseConfig

from ..errors import HandshakeMismatchError, RemoteKVUnavailable
from ..params import PushEndpoint, PushTarget
from ..protocol import worker_port
from ..worker_base import P2PWorkerBase
from .contract import MooncakeLayerwiseConnectorMetadata
from .links import PushLink, PushLinks, PushSession, StepItem

logger = logging.getLogger(__name__)

#: Layers of one step queued behind each other are pushed in one batch write, at most this
#: many (a write is one round of the transfer engine; the lease is checked before each).
MAX_MERGED_LAYERS = 64


@dataclass
class _LayerTask:
    #: index in :attr:`PushSender.slots`
    layer: int
    event: Any
    items: list[StepItem]


@dataclass
class _StepEnd:
    items: list[StepItem]
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _LeaseRefused:
    """The renewer saw D refuse a lease: the sender thread tells D (after any write)."""

    session: PushSession
    link: PushLink


@dataclass
class _FailNotice:
    """Tell D a request failed (no blocks are read)."""

    target: PushTarget | None
    endpoint: PushEndpoint | None
    reason: str
    #: D's capability for the request (with ``endpoint``; ``target`` carries its own)
    token: str = ""
    #: D ranks on other hosts (with ``endpoint``; ``target`` carries its own)
    rank_hosts: dict[int, str] = field(default_factory=dict)
    #: no write for the request failed in the transfer engine (``PushDone.settled``)
    settled: bool = True


class PushSender:
    """P's pushes: the step's layers queued by the hooks and the thread that writes them.

    Args:
        shared: the worker's identity, KV cache registration, peers and handshake.

    Attributes:
        links: the sessions, leases and writes (:class:`~.layerwise.links.PushLinks`).
        hooked_layer_pushes: layer pushes queued by the attention layer's
            ``save_kv_layer`` hook.
        fallback_layer_pushes: layer pushes queued by ``wait_for_save`` because the hook
            did not run (checks that the backend calls it).
    """

    def __init__(self, shared: P2PWorkerBase) -> None:
        assert isinstance(shared.cfg, MooncakeLayerwiseConfig)
        self.shared = shared
        self.cfg: MooncakeLayerwiseConfig = shared.cfg
        self.recorder = shared.recorder
        self.links = PushLinks(shared, lambda s, link: self._queue.put(_LeaseRefused(s, link)))
        #: what one layer hook pushes: the layout's layer (the memory) and the KV cache group
        #: whose blocks go (a layer of each group shares one tensor under vLLM's hybrid KV
        #: cache manager: each layer's hook pushes its own group's blocks of it)
        self.slots: list[tuple[int, int]] = []
        self._layer_index: dict[str, int] = {}
        self._finished_seen: set[str] = set()
        self._queue: queue.Queue[Any] = queue.Queue()
        #: a task the sender took while merging layers that belongs to the next turn
        self._carry: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._step_meta: Any = None
        self._step_items: list[StepItem] = []
        self._step_layers: set[int] = set()
        self.hooked_layer_pushes = 0
        self.fallback_layer_pushes = 0

    @property
    def sessions(self) -> dict[str, PushSession]:
        """The requests this rank pushes (or still holds blocks of), by request id."""
        return self.links.sessions

    def start(self) -> None:
        """Start the sender and renewer threads (once the KV cache is registered)."""
        assert self.shared.layout is not None
        self.slots, self._layer_index = layer_slots(self.shared.layout, self.shared.kv_groups)
        self._thread = threading.Thread(target=self._send_loop, name="layerwise-sender",
                                        daemon=True)
        self._thread.start()
        self.links.start()

    def stop(self) -> None:
        """Stop the sender and renewer threads."""
        self._stop.set()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(5)
        self.links.stop()

    # ================================================================ the step
    def begin_step(self, metadata: MooncakeLayerwiseConnectorMetadata | None) -> None:
        """Take this step's pushes from the metadata (once per step, whichever hook runs first)."""
        if metadata is None or metadata is self._step_meta:
            return
        self._step_meta = metadata
        self._step_items = []
        self._step_layers = set()
        links = self.links
        for rid, push in metadata.pushes.items():
            if push.abort is not None:
                self._queue.put(_FailNotice(push.target, push.endpoint, push.abort, push.token,
                                            push.rank_hosts))
                continue
            assert push.target is not None
            with links.lock:
                session = links.sessions.get(rid)
                if session is None:
                    session = links.open_session(rid, push.target)
                    links.sessions[rid] = session
                if push.positions or push.last:
                    session.pending += 1
            self._step_items.append(StepItem(session, list(push.positions),
                                             list(push.local_block_ids), push.last,
                                             list(push.groups)))

    def save_layer(self, metadata: MooncakeLayerwiseConnectorMetadata | None,
                   layer_name: str, kv_layer: Any) -> None:
        """Queue this layer's pushes (called right after the attention layer wrote its KV)."""
        self.begin_step(metadata)
        if not self._step_items:
            return
        layer = self._layer_index.get(layer_name)
        if layer is None or layer in self._step_layers:
            return
        self._step_layers.add(layer)
        event = None
        if isinstance(kv_layer, torch.Tensor) and kv_layer.device.type != "cpu":
            event = device_of(kv_layer).record_event()
        with self.links.lock:
            for item in self._step_items:
                item.session.pending += 1
        self.hooked_layer_pushes += 1
        self._queue.put(_LayerTask(layer, event, list(self._step_items)))

    def wait_for_save(self, metadata: MooncakeLayerwiseConnectorMetadata | None) -> None:
        """Push the layers whose hook did not run, close the step, wait for its pushes."""
        self.begin_step(metadata)
        layout = self.shared.layout
        items, self._step_items = self._step_items, []
        if not items or layout is None:
            return
        missing = [i for i in range(len(self.slots)) if i not in self._step_layers]
        if missing and len(missing) == len(self.slots):
            logger.debug("save_kv_layer was not called this step; pushing all layers now")
        event = None
        regions = layout.regions
        if regions and regions[0].tensor.device.type != "cpu":
            event = device_of(regions[0].tensor).record_event()
        with self.links.lock:
            for item in items:
                item.session.pending += len(missing)
        self.fallback_layer_pushes += len(missing)
        for layer in missing:
            self._queue.put(_LayerTask(layer, event, items))
        end = _StepEnd(items)
        self._queue.put(end)
        if not end.done.wait(self.cfg.save_wait_s):
            logger.warning("this step's pushes are still running after %.1fs; the engine goes on "
                           "and their requests keep their blocks until they end",
                           self.cfg.save_wait_s)

    def collect_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests vLLM finished whose blocks no queued push reads any more."""
        out: set[str] = set()
        notify: list[PushSession] = []
        links = self.links
        with links.lock:
            self._finished_seen |= finished_req_ids & links.sessions.keys()
            for rid in list(self._finished_seen):
                session = links.sessions[rid]
                if session.pending > 0:
                    continue  # a queued push still reads its blocks
                out.add(rid)
                self._finished_seen.discard(rid)
                del links.sessions[rid]
                if not session.closed:
                    notify.append(session)
            held = len(links.sessions)
        # requests whose blocks P holds for D: pushing, or finished while a push reads them
        self.recorder.set("p2p_held_requests", held)
        for session in notify:
            # P finished the request before its prompt was pushed (aborted): D must not wait
            self._queue.put(_FailNotice(
                session.target, None, "the request ended on the prefill instance before its "
                "prompt was pushed", settled=not any(lk.write_failed for lk in session.links)))
        return out

    # ================================================================ sender thread
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
                elif isinstance(task, _FailNotice):
                    self._run_notice(task)
                elif isinstance(task, _LeaseRefused):
                    self.links.close_revoked(task.session, task.link)
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
            layers = [self.slots[t.layer] for t in tasks]
            start = time.perf_counter()
            moved = 0
            for item in tasks[0].items:
                if not item.positions:
                    continue
                for link in item.session.links:
                    moved += self._push_layers(item, link, layers)
            if moved:
                share = (time.perf_counter() - start) / len(layers)
                for _layer in layers:
                    self.recorder.observe("p2p_layer_transfer_seconds", share)
                self.recorder.inc("p2p_transfer_bytes", moved)
        finally:
            with self.links.lock:
                for task in tasks:
                    for item in task.items:
                        item.session.pending -= 1

    def _push_layers(self, item: StepItem, link: PushLink, layers: list[tuple[int, int]]
                     ) -> int:
        """Write ``layers`` of ``item`` to one D rank (opening or renewing the lease first);
        a failure stops the link. Returns the bytes written."""
        links, session = self.links, item.session
        if link.state == "revoked":
            links.close_revoked(session, link)
        if link.state not in ("new", "granted"):
            return 0
        try:
            if link.state == "new":
                links.open_link(session, link)
            if time.monotonic() >= link.valid_until:
                links.renew_link(session, link)
            nbytes = links.write_layers(item, link, layers)
            link.nbytes += nbytes
            return nbytes
        except HandshakeMismatchError as exc:
            links.stop_link(session, link, str(exc), cause="handshake_mismatch")
        except RemoteKVUnavailable as exc:
            links.stop_link(session, link, str(exc), cause=exc.code)
        except PeerTimeoutError as exc:
            links.stop_link(session, link, f"D did not answer: {exc}", cause="peer_timeout")
        except TransferError as exc:
            links.stop_link(session, link, str(exc), cause="transfer")
        except (KVTransferError, IndexError, ValueError) as exc:
            links.stop_link(session, link, f"{type(exc).__name__}: {exc}", cause="internal")
        return 0

    def _run_step_end(self, task: _StepEnd) -> None:
        links = self.links
        try:
            for item in task.items:
                if not item.last:
                    continue
                session = item.session
                for link in session.links:
                    if link.state == "new":
                        # nothing left to write in the last chunk: begin anyway so that D
                        # counts this sender
                        self._begin_without_writes(session, link)
                    if link.state == "revoked":
                        links.close_revoked(session, link)
                    if link.state == "granted":
                        accepted = links.send_done(session.target, link, success=True,
                                                   nbytes=link.nbytes)
                        with links.lock:
                            link.state = "done"
                        if accepted:
                            self.recorder.inc("p2p_requests_served")
                        else:
                            self.recorder.inc("p2p_failures", cause="not_accepted")
                session.closed = True
        finally:
            with links.lock:
                for item in task.items:
                    if item.positions or item.last:
                        item.session.pending -= 1
            task.done.set()

    def _begin_without_writes(self, session: PushSession, link: PushLink) -> None:
        try:
            self.links.open_link(session, link)
        except (KVTransferError, IndexError, ValueError) as exc:
            self.links.stop_link(session, link, f"{type(exc).__name__}: {exc}", cause="begin")

    def _run_notice(self, task: _FailNotice) -> None:
        token, hosts = task.token, task.rank_hosts
        if task.target is not None:
            host, port, rid, d_tp, engine = (task.target.host, task.target.port,
                                             task.target.request_id, task.target.tp_size,
                                             task.target.engine_id)
            token, hosts = task.target.token, task.target.rank_hosts
        elif task.endpoint is not None:
            host, port, rid, d_tp, engine = task.endpoint
        else:
            logger.error("a layerwise request with unusable params cannot be reported to D "
                         "(%s); D fails it at its deadline", task.reason)
            return
        for d in range(d_tp):
            self.links.send_done_to(hosts.get(d, host),
                                    worker_port(port, tp_rank=d, tp_size=d_tp), rid,
                                    success=False, reason=task.reason, token=token,
                                    settled=task.settled, engine_id=engine)


def layer_slots(layout: Any, groups: KVGroups) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """What each layer hook pushes, and the slot of each vLLM layer name.

    A slot is ``(index in layout.layers, KV cache group)``: of one group, a slot a layer;
    under vLLM's hybrid KV cache manager, a layer that shares its tensor with another
    (``layout.aliases``) pushes its own group's blocks of that tensor, once it is computed.
    """
    group_of = groups.group_of()
    owner = {layer.name: i for i, layer in enumerate(layout.layers)}
    slots: list[tuple[int, int]] = []
    index: dict[str, int] = {}
    for name, i in [*owner.items(), *((a, owner[o]) for a, o in layout.aliases.items())]:
        index[name] = len(slots)
        slots.append((i, group_of.get(name, 0)))
    return slots, index
