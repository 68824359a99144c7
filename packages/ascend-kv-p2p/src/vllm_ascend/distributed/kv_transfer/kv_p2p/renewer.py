# SPDX-License-Identifier: Apache-2.0
"""Lease renewal for requests P holds for D: one ``Renew`` per P worker and round.

Used by D's scheduler (the requests it has seen) and by the P/D proxy (the requests it
handed to D and still waits on). Needs neither vLLM nor the transfer engine.
:class:`SideBySide` is how every renewing thread (these, and the layerwise P's renewals
of its write leases on D) reaches its peers.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Hashable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Generic, TypeVar

from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.errors import KVTransferError

from .params import RemotePrefill
from .protocol import CODEC, Renew, worker_port

logger = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
#: a P worker renewed: its side channel's endpoint and its instance's engine id
Peer = tuple[str, str]


class SideBySide(Generic[K]):
    """One round of calls to many peers at once, at most one call in flight per peer.

    A renewing thread sends a round every interval whatever the answers: one after the
    other, or waiting for the slowest before the next round, a peer slow to answer (a
    starved process, a side channel waiting on another call) put up to its call's timeout
    between every other peer's renewals, longer than a short lease. A peer whose call of an
    earlier round is still in flight is skipped (called again once it answered or timed
    out), so it never gets a pile of calls.

    Args:
        max_parallel: most calls running at the same time (threads, started on demand).
        name: the threads' name prefix.
    """

    def __init__(self, max_parallel: int, name: str) -> None:
        self._max_parallel = max_parallel
        self._name = name
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: dict[K, Future[None]] = {}
        self._stopped = False

    def send(self, calls: Mapping[K, Callable[[], None]]) -> list[Future[None]]:
        """Start ``calls[peer]()`` for every peer without a call in flight; returns the calls
        started (without waiting for them; none once :meth:`stop` ran)."""
        with self._lock:
            if self._stopped:
                return []
            if self._pool is None and calls:
                self._pool = ThreadPoolExecutor(self._max_parallel,
                                                thread_name_prefix=self._name)
            sent: list[Future[None]] = []
            for peer, call in calls.items():
                previous = self._inflight.get(peer)
                if previous is not None and not previous.done():
                    continue  # still waiting for that peer: a later round calls it
                assert self._pool is not None
                future = self._pool.submit(call)
                self._inflight[peer] = future
                sent.append(future)
            for peer in [p for p, f in self._inflight.items() if f.done() and p not in calls]:
                del self._inflight[peer]
            return sent

    def busy(self) -> set[K]:
        """The peers with a call in flight."""
        with self._lock:
            return {p for p, f in self._inflight.items() if not f.done()}

    def stop(self) -> None:
        """Start no more calls; calls not started yet are dropped, running ones end on
        their own (their timeouts)."""
        with self._lock:
            self._stopped = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


class LeaseRenewer:
    """Renews P's leases on requests that someone still waits for (a daemon thread).

    D's scheduler renews the requests it has seen; the P/D proxy renews every request it
    has handed to D and still waits on, which covers a request queued behind a full batch
    on D that D's scheduler has not looked at yet.

    The P workers of a round are renewed side by side (:class:`SideBySide`), and the rounds
    keep their interval whatever the answers, so one P slow to answer (a starved P, a side
    channel waiting on a claim) delays no other: one after the other, a round over two Ps
    answering within 1 s each took up to interval + 2 s, a 3 s lease's worth.
    """

    #: most P workers renewed at the same time
    MAX_PARALLEL = 16

    def __init__(self, interval_s: float, timeout_s: float) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._tracked: dict[str, RemotePrefill] = {}
        #: (P worker's endpoint, P's engine id) -> its client (frames bound to both)
        self._clients: dict[Peer, RpcClient[Any]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._calls: SideBySide[Peer] = SideBySide(self.MAX_PARALLEL, "p2p-lease-renew")

    def track(self, request_id: str, remote: RemotePrefill) -> None:
        with self._lock:
            self._tracked[request_id] = remote
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="p2p-lease-renewer",
                                                daemon=True)
                self._thread.start()

    def untrack(self, request_id: str) -> None:
        with self._lock:
            self._tracked.pop(request_id, None)

    def stop(self) -> None:
        self._stop.set()
        self._calls.stop()
        with self._lock:
            busy = self._calls.busy()
            # a client in a call is closed by its own thread when the call returns
            for peer in [e for e in self._clients if e not in busy]:
                self._clients.pop(peer).close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._send_round()

    def renew_once(self) -> None:
        """Send one round of ``Renew`` messages (one per P worker, side by side); returns
        when each was answered or timed out."""
        wait(self._send_round(), timeout=self.timeout_s + 1.0)

    def _send_round(self) -> list[Future[None]]:
        """Send a ``Renew`` to every P worker with tracked requests and no call in flight;
        returns the calls sent (without waiting for them)."""
        with self._lock:
            by_peer: dict[Peer, list[tuple[str, str]]] = {}
            for remote in self._tracked.values():
                for rank in range(remote.tp_size):
                    port = worker_port(remote.port, tp_rank=rank, tp_size=remote.tp_size)
                    peer = (tcp_endpoint(remote.host_of(rank), port), remote.engine_id)
                    by_peer.setdefault(peer, []).append((remote.request_id, remote.token))
            if self._stop.is_set():
                return []
        return self._calls.send({peer: functools.partial(self._renew, peer, held)
                                 for peer, held in by_peer.items()})

    def _renew(self, peer: Peer, held: list[tuple[str, str]]) -> None:
        """Renew ``held`` (request id, its capability token) at ``peer``."""
        endpoint, engine_id = peer
        with self._lock:
            client = self._clients.get(peer)
            if client is None:
                client = self._clients.setdefault(peer, RpcClient(
                    endpoint, CODEC, timeout_s=self.timeout_s, engine_id=engine_id))
        try:
            client.call(Renew(request_ids=[rid for rid, _ in held],
                              tokens=[token for _, token in held]))
        except KVTransferError as exc:
            logger.debug("lease renewal to %s failed: %s", endpoint, exc)
        finally:
            if self._stop.is_set():
                with self._lock:
                    if self._clients.get(peer) is client:
                        del self._clients[peer]
                client.close()
