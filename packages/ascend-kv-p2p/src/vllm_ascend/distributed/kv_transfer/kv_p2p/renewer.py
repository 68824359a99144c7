# SPDX-License-Identifier: Apache-2.0
"""Lease renewal for requests P holds for D: one ``Renew`` per P worker and round.

Used by D's scheduler (the requests it has seen) and by the P/D proxy (the requests it
handed to D and still waits on). Needs neither vLLM nor the transfer engine.
"""

from __future__ import annotations

import logging
import threading
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
    """

    def __init__(self, interval_s: float, timeout_s: float) -> None:
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._tracked: dict[str, RemotePrefill] = {}
        self._clients: dict[str, RpcClient[Any]] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

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
            for client in self._clients.values():
                client.close()
            self._clients.clear()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.renew_once()

    def renew_once(self) -> None:
        """Send one round of ``Renew`` messages (one per P worker)."""
        with self._lock:
            by_endpoint: dict[str, list[str]] = {}
            for remote in self._tracked.values():
                for rank in range(remote.tp_size):
                    port = worker_port(remote.port, tp_rank=rank, tp_size=remote.tp_size)
                    by_endpoint.setdefault(tcp_endpoint(remote.host_of(rank), port), []).append(
                        remote.request_id)
        for endpoint, ids in by_endpoint.items():
            client = self._clients.get(endpoint)
            if client is None:
                client = self._clients.setdefault(
                    endpoint, RpcClient(endpoint, CODEC, timeout_s=self.timeout_s))
            try:
                client.call(Renew(request_ids=ids))
            except KVTransferError as exc:
                logger.debug("lease renewal to %s failed: %s", endpoint, exc)
