# SPDX-License-Identifier: Apache-2.0
"""``CPUOffloadingConnector``: a host-memory prefix cache behind vLLM's device prefix cache.

Lifecycle (see the :mod:`.scheduler` and :mod:`.worker` modules for details):

* scheduler side - ``get_num_new_matched_tokens`` offers the blocks beyond the
  device's own prefix hit that host memory holds (pinning them),
  ``update_state_after_alloc`` plans their load, ``build_connector_meta``
  plans the saves of the blocks filled this step, ``request_finished`` holds
  a request's blocks until its saves are done;
* worker side - ``register_kv_caches`` joins the instance's shared host pool
  (rank 0 runs its metadata server), ``start_load_kv`` /
  ``wait_for_layer_load`` load layer by layer on a load stream,
  ``wait_for_save`` saves in the background on a save stream,
  ``get_finished`` reports requests whose saves are done.

It serves vLLM's hybrid KV cache manager (``SupportsHMA``) for full-attention and
sliding-window KV cache groups of one block size: a block of each group is a host block of
its own, a hit is the longest prefix every group serves, a window's group saves and loads
only the blocks vLLM keeps, and loads are asynchronous then (a failed one is reported by
request). Other group kinds (a state-space model's state) are refused at start-up.

Configuration: :class:`~vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.config.CPUOffloadConfig`
(``vllm-ascend-kv config CPUOffloadingConnector`` lists the keys)::

    --kv-transfer-config '{"kv_connector": "CPUOffloadingConnector", "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_swap_space_gb": 16}}'
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_ascend.distributed.kv_transfer.core.vllm_compat import require_vllm

require_vllm("CPUOffloadingConnector")

# ruff: noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.vllm_metrics import ConnectorStatsMixin
from vllm_ascend.distributed.kv_transfer.core.vllm_roles import SchedulerHooksMixin
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.config import CPUOffloadConfig

from .contract import CPUOffloadingConnectorMetadata
from .metrics import OFFLOAD_METRICS
from .scheduler import CPUOffloadScheduler
from .worker import CPUOffloadWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.request import Request

try:  # vLLM >= 0.32 labels external hits by tier
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _HOST_SOURCE: Any = CacheHitSource.HOST
except ImportError:  # pragma: no cover - older vLLM
    _HOST_SOURCE = None

__all__ = ["CPUOffloadingConnector", "CPUOffloadingConnectorMetadata"]


class CPUOffloadingConnector(ConnectorStatsMixin, SchedulerHooksMixin, KVConnectorBase_V1,
                             SupportsHMA):
    """Offload KV blocks to a host-memory prefix cache shared by the ranks of an instance."""

    metric_specs = OFFLOAD_METRICS

    if _HOST_SOURCE is not None:
        _cache_hit_source = _HOST_SOURCE

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config", None) or {}
        self.config = CPUOffloadConfig.from_dict(
            extra, source="kv_connector_extra_config of CPUOffloadingConnector")
        self.recorder = MetricsRecorder(OFFLOAD_METRICS)
        self.connector_scheduler: CPUOffloadScheduler | None = None
        self._worker: CPUOffloadWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = CPUOffloadScheduler(vllm_config, self.config,
                                                           kv_cache_config, self.recorder)
        else:
            self._worker = CPUOffloadWorker(vllm_config, self.config, kv_cache_config,
                                            self.recorder)

    @property
    def requires_kv_delivery(self) -> bool:
        """A best-effort cache: a dropped save is a future miss, never a lost hand-off."""
        return False

    # ==============================
    # Worker-side methods
    # ==============================
    def _meta(self) -> CPUOffloadingConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, CPUOffloadingConnectorMetadata), type(meta)
        return meta

    def _w(self) -> CPUOffloadWorker:
        assert self._worker is not None, "worker-side method called on the scheduler connector"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._w().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._w().start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._w().wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """Saves are whole blocks after the forward (``wait_for_save``), not per layer."""

    def wait_for_save(self) -> None:
        if self.has_connector_metadata():
            self._w().wait_for_save(self._meta())

    def handle_preemptions(self, kv_connector_metadata: Any) -> None:
        if isinstance(kv_connector_metadata, CPUOffloadingConnectorMetadata):
            self._w().handle_preemptions(kv_connector_metadata)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._w().get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`, and the requests whose asynchronous load failed (the hybrid
        KV cache manager: vLLM takes no block ids with several groups)."""
        sending, recving = self._w().get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()),
                                          failed_recving=self._w().take_failed_loads())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._w().get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()

    # ==============================
    # Scheduler-side methods
    # ==============================
    # get_num_new_matched_tokens, update_state_after_alloc, build_connector_meta and
    # request_finished hand over to the scheduler half: SchedulerHooksMixin
    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook with the hybrid KV cache manager on: the blocks of every group are
        held while the request's saves may read them, as with one group."""
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    def reset_cache(self) -> bool | None:
        if self.connector_scheduler is None:
            return None
        return self.connector_scheduler.reset_cache()

    # ==============================
    # Metrics
    # ==============================
