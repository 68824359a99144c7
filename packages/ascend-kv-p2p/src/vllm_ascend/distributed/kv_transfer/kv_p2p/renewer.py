# SPDX-License-Identifier: Apache-2.0
"""Lease renewal for requests P holds for D: one ``Renew`` per P worker and round.

Used by D's scheduler (the requests it has seen) and by the P/D proxy (the requests it
handed to D and still waits on). Needs neither vLLM nor the transfer engine.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.errors import KVTransferError

from .params import RemotePrefill
from .protocol import CODEC, Renew, worker_port

logger = logging.getLogger(__name__)


class LeaseRenewer:
    """Renews P's leases on requests that someone still waits for (a daemon thread).

    D's scheduler renews the requests it has seen; the P/D proxy renews every request it
    has handed to D and still waits on, which covers a request queued behind a full batch
    on D that D's scheduler has not looked at yet.

    The P workers of a round are renewed side by side, and the rounds keep their interval
    whatever the answers, so one P slow to answer (a starved P, a side channel waiting on a
    claim) delays no other: one after the other, a round over two Ps answering within 1 s
    each took up to interval + 2 s, a 3 s lease's worth; waiting for the slowest P before
    the next round, a P that did not answer put the call's timeout between every other P's
    renewals. A call still in flight from an earlier round is not doubled (that P is
    renewed again once it answered or timed out).
    """

    #: most P workers renewed at the same time
    MAX_PARALLEL = 16

    def __init__(self, interval_s: float, timeout_s: float) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._tracked: dict[str, RemotePrefill] = {}
        self._clients: dict[str, RpcClient[Any]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: dict[str, Future[None]] = {}

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
        with self._lock:
            pool, self._pool = self._pool, None
            busy = {e for e, f in self._inflight.items() if not f.done()}
            # a client in a call is closed by its own thread when the call returns
            for endpoint in [e for e in self._clients if e not in busy]:
                self._clients.pop(endpoint).close()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

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
            by_endpoint: dict[str, list[str]] = {}
            for remote in self._tracked.values():
                for rank in range(remote.tp_size):
                    port = worker_port(remote.port, tp_rank=rank, tp_size=remote.tp_size)
                    by_endpoint.setdefault(tcp_endpoint(remote.host_of(rank), port), []).append(
                        remote.request_id)
            if self._stop.is_set():
                return []
            if self._pool is None and by_endpoint:
                self._pool = ThreadPoolExecutor(self.MAX_PARALLEL,
                                                thread_name_prefix="p2p-lease-renew")
            pool = self._pool
            sent: list[Future[None]] = []
            for endpoint, ids in by_endpoint.items():
                previous = self._inflight.get(endpoint)
                if previous is not None and not previous.done():
                    continue  # still waiting for that P: the next round renews it
                assert pool is not None
                try:
                    future = pool.submit(self._renew, endpoint, ids)
                except RuntimeError:  # stopped meanwhile
                    return sent
                self._inflight[endpoint] = future
                sent.append(future)
            for endpoint in [e for e, f in self._inflight.items() if f.done()]:
                if endpoint not in by_endpoint:
                    del self._inflight[endpoint]
        return sent

    def _renew(self, endpoint: str, ids: list[str]) -> None:
        with self._lock:
            client = self._clients.get(endpoint)
            if client is None:
                client = self._clients.setdefault(
                    endpoint, RpcClient(endpoint, CODEC, timeout_s=self.timeout_s))
        try:
            client.call(Renew(request_ids=ids))
        except KVTransferError as exc:
            logger.debug("lease renewal to %s failed: %s", endpoint, exc)
        finally:
            if self._stop.is_set():
                with self._lock:
                    if self._clients.get(endpoint) is client:
                        del self._clients[endpoint]
                client.close()
