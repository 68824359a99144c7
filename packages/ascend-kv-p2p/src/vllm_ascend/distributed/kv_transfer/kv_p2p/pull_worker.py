# SPDX-License-Identifier: Apache-2.0
"""Worker side of ``MooncakeConnectorV1`` (decode pulls): the roles, composed.

The worker keeps what both roles share (:class:`~.worker_base.P2PWorkerBase`:
identity, the KV cache registered with the transfer engine, peers and
handshake) and hands each role's work to its own object:

* P (``kv_producer``): :class:`~.pull_holder.LeaseHolder`, the blocks P holds for
  D as leases, and the side channel D claims them through;
* D (``kv_consumer``): :class:`~.pull_reader.PullReader`, the pulls (claims, reads,
  retries, ``Done``), with :class:`~.pull_loads.LoadTracker`, the loads in flight
  and how each ends, and :mod:`.pull_transfer`, the bytes of one request.

What the scheduler tells the worker is :mod:`.pull_contract`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig

from .protocol import CODEC
from .pull_contract import MooncakeConnectorMetadata
from .pull_holder import LeaseHolder
from .pull_loads import LoadTracker
from .pull_reader import PullReader
from .worker_base import P2PWorkerBase

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


class PullWorker(P2PWorkerBase):
    """Worker-side logic of the pull connector: a P holder and a D reader over shared state.

    Attributes:
        holder: P's leases and side channel (``None`` on a pure consumer).
        reader: D's pulls (``None`` on a pure producer).
        loads: D's loads in flight (``None`` on a pure producer).
    """

    def __init__(self, vllm_config: VllmConfig, cfg: MooncakeP2PConfig, engine_id: str,
                 recorder: MetricsRecorder, *, tp_rank: int | None = None,
                 pp_rank: int | None = None) -> None:
        super().__init__(vllm_config, cfg, engine_id, recorder, codec=CODEC, tp_rank=tp_rank,
                         pp_rank=pp_rank)
        self.holder = LeaseHolder(self) if self.is_producer else None
        self.loads = LoadTracker(recorder, cfg.load_timeout_s) if self.is_consumer else None
        self.reader = PullReader(self, self.loads) if self.loads is not None else None

    # ================================================================ set-up
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Describe the cache, register it with the transfer engine, start the side channel."""
        self._register_kv_memory(kv_caches)
        assert self.layout is not None
        if self.holder is not None:
            self.holder.serve()
            assert self.holder.server is not None
            logger.info("P side channel on %s (engine %s, %d layers, %d blocks)",
                        self.holder.server.endpoint, self.engine_id, self.layout.num_layers,
                        self.layout.num_blocks)

    def shutdown(self) -> None:
        """Stop serving, stop pulling, release the registered KV memory."""
        if self.holder is not None:
            self.holder.stop()
        if self.reader is not None:
            self.reader.shutdown()
        self._release_resources()

    # ================================================================ vLLM hooks
    def start_load_kv(self, metadata: MooncakeConnectorMetadata) -> None:
        """Hold P's newly finished requests and start D's pulls."""
        if metadata.requests_to_send:
            if self.holder is None:
                logger.warning("%d requests to hold on a worker that is no kv_producer: "
                               "ignored", len(metadata.requests_to_send))
            else:
                self.holder.hold(metadata.requests_to_send.values())
        if metadata.requests:
            if self.reader is None:
                logger.warning("%d requests to pull on a worker that is no kv_consumer: "
                               "ignored", len(metadata.requests))
            else:
                self.reader.start(metadata.requests.values())
        if metadata.claim_answers and self.reader is not None:
            # answers of claims D's scheduler sent ahead, for pulls started in earlier steps
            self.reader.inbox.deliver(metadata.claim_answers)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Requests P may free now, and requests D finished loading (each reported once)."""
        sending = self.holder.collect_finished() if self.holder is not None else set()
        recving = self.loads.collect_finished() if self.loads is not None else set()
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of D's failed loads since the last call."""
        return self.loads.take_load_errors() if self.loads is not None else set()

    def wait_loads(self, request_ids: Iterable[str], timeout: float | None = None) -> bool:
        """Block until none of ``request_ids`` (already passed to :meth:`start_load_kv`) is
        still loading: each ended, loaded or failed, and the next :meth:`get_finished` reports
        it. False on timeout. For benchmarks and tests; vLLM polls ``get_finished``."""
        return self.loads.wait(request_ids, timeout) if self.loads is not None else True

    # ================================================================ views
    @property
    def server(self) -> Any:
        """P's side-channel server (``None`` until :meth:`register_kv_caches`, or on D)."""
        return self.holder.server if self.holder is not None else None

    @property
    def overlap_claims(self) -> bool:
        """D sends its claims while it reads (else claims first); see :class:`PullReader`."""
        return self.reader is not None and self.reader.overlap_claims

    @overlap_claims.setter
    def overlap_claims(self, value: bool) -> None:
        assert self.reader is not None, "only a kv_consumer pulls"
        self.reader.overlap_claims = value
