# SPDX-License-Identifier: Apache-2.0
"""Worker side of ``MooncakeLayerwiseConnector``: the P and D roles, composed.

The worker keeps what both roles share (:class:`~.worker_base.P2PWorkerBase`:
identity, the KV cache registered with the transfer engine, peers and handshake)
and hands each role's work to its own object:

* P (``kv_producer``): :class:`~.layerwise.sender.PushSender`, the step's layers
  queued by the hooks and the thread that writes them into D's blocks, over
  :class:`~.layerwise.links.PushLinks`, the sessions, write leases and writes of
  this rank to each D rank;
* D (``kv_consumer``): :class:`~.layerwise.receiver.PushReceiver`, the side channel
  P pushes through, the requests waiting for their KV and how each ends, with
  :mod:`.layerwise.staging` for heads that P cannot write into D's blocks directly.

What the scheduler tells the worker is :mod:`.layerwise.contract`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm_ascend.distributed.kv_transfer.core.kv_groups import KVGroups
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeLayerwiseConfig

from ..protocol import LAYERWISE_CODEC
from ..worker_base import P2PWorkerBase
from .contract import MooncakeLayerwiseConnectorMetadata
from .links import write_window_end
from .receiver import PushReceiver
from .sender import PushSender

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)


class LayerwiseWorker(P2PWorkerBase):
    """Worker-side logic of the layerwise connector: a P sender and a D receiver over
    shared state.

    Attributes:
        sender: P's pushes (``None`` on a pure consumer).
        receiver: D's side channel and waiting requests (``None`` on a pure producer).
    """

    cfg: MooncakeLayerwiseConfig

    def __init__(self, vllm_config: VllmConfig, cfg: MooncakeLayerwiseConfig, engine_id: str,
                 recorder: MetricsRecorder, *, tp_rank: int | None = None,
                 pp_rank: int | None = None, kv_groups: KVGroups | None = None) -> None:
        super().__init__(vllm_config, cfg, engine_id, recorder, codec=LAYERWISE_CODEC,
                         tp_rank=tp_rank, pp_rank=pp_rank, kv_groups=kv_groups)
        self.receiver = PushReceiver(self) if self.is_consumer else None
        self.sender = PushSender(self) if self.is_producer else None

    # ================================================================ set-up
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Describe the cache, register it with the transfer engine, start serving/sending."""
        layout = self._register_kv_memory(kv_caches)
        assert self.te is not None
        if self.receiver is not None:
            window = write_window_end(self.te, 0.0, self.cfg.lease_ttl_s)
            if window < self.cfg.lease_ttl_s / 2:
                logger.warning(
                    "lease_ttl_s=%.1f is short for the transfer engine's stall bound of %.0f s "
                    "(MC_TCP_PROGRESS_TIMEOUT_SEC): P may start writes only during %.1f s of "
                    "each lease; raise lease_ttl_s or lower the stall bound",
                    self.cfg.lease_ttl_s, self.te.stall_bound_s, window)
            self.receiver.serve()
            assert self.receiver.server is not None
            logger.info("D side channel on %s (engine %s, %d layers, %d blocks)",
                        self.receiver.server.endpoint, self.engine_id, layout.num_layers,
                        layout.num_blocks)
        if self.sender is not None:
            self.sender.start()

    def shutdown(self) -> None:
        """Stop serving and sending, release the registered memory."""
        if self.sender is not None:
            self.sender.stop()
        if self.receiver is not None:
            self.receiver.stop()
        self._release_resources()

    # ================================================================ vLLM hooks
    def start_load_kv(self, metadata: MooncakeLayerwiseConnectorMetadata) -> None:
        """D: register this step's incoming requests; P: make sure the step is prepared."""
        if self.sender is not None:
            self.sender.begin_step(metadata)
        if self.receiver is not None:
            self.receiver.expect(metadata.requests.values(), metadata.failed_posts)

    def save_kv_layer(self, metadata: MooncakeLayerwiseConnectorMetadata | None,
                      layer_name: str, kv_layer: Any) -> None:
        """P: queue this layer's pushes (right after the attention layer wrote its KV)."""
        if self.sender is not None:
            self.sender.save_layer(metadata, layer_name, kv_layer)

    def wait_for_save(self, metadata: MooncakeLayerwiseConnectorMetadata | None) -> None:
        """P: push the layers whose hook did not run, close the step, wait for its pushes."""
        if self.sender is not None:
            self.sender.wait_for_save(metadata)

    def get_finished(self, finished_req_ids: set[str], *, idle: bool = False
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Requests P may free now, and requests D finished receiving (each reported once).

        ``idle``: the step ran no token; with requests waiting for their KV, D waits up to
        ``idle_wait_s`` for one to end first (vLLM steps again at once: without the wait
        D's engine loop spins on a core while P computes and pushes)."""
        sending, recving, _ = self.transfer_results(finished_req_ids, idle=idle)
        return sending or None, recving or None

    def transfer_results(self, finished_req_ids: set[str], *, idle: bool = False
                         ) -> tuple[set[str], set[str], set[str]]:
        """As :meth:`get_finished`, and the requests of ``recving`` that failed (with several
        KV cache groups vLLM takes failures by request: their blocks are not in
        :meth:`get_block_ids_with_load_errors`)."""
        if idle and self.receiver is not None and self.cfg.idle_wait_s > 0:
            self.receiver.wait_any(self.cfg.idle_wait_s)
        sending = (self.sender.collect_finished(finished_req_ids) if self.sender is not None
                   else set())
        recving, failed = (self.receiver.collect_results(finished_req_ids)
                           if self.receiver is not None else (set(), set()))
        return sending, recving, failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of D's failed requests since the last call (none with several KV cache
        groups: vLLM takes those failures by request, :meth:`transfer_results`)."""
        blocks = self.receiver.take_load_errors() if self.receiver is not None else set()
        return set() if self.kv_groups.hybrid else blocks

    # ================================================================ views
    @property
    def server(self) -> Any:
        """D's side-channel server (``None`` until :meth:`register_kv_caches`, or on P)."""
        return self.receiver.server if self.receiver is not None else None

    @property
    def virtual_request(self) -> set[str]:
        """D's virtual requests not reported yet (upstream's name)."""
        return self.receiver.virtual_request if self.receiver is not None else set()

    @property
    def hooked_layer_pushes(self) -> int:
        """P: layer pushes queued by the attention layer's ``save_kv_layer`` hook."""
        return self.sender.hooked_layer_pushes if self.sender is not None else 0

    @property
    def fallback_layer_pushes(self) -> int:
        """P: layer pushes queued by ``wait_for_save`` because the hook did not run."""
        return self.sender.fallback_layer_pushes if self.sender is not None else 0
