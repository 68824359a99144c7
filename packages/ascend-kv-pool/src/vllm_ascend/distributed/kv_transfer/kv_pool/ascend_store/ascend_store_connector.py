# SPDX-License-Identifier: Apache-2.0
"""``AscendStoreConnector``: prefix KV blocks saved to and loaded from a pool.

A thin connector: scheduler-side calls go to :class:`~.pool_scheduler.KVPoolScheduler`,
worker-side calls to :class:`~.pool_worker.KVPoolWorker`. The pool is the
embedded ``local`` backend unless ``kv_connector_extra_config`` names another
(``backend: mooncake`` or ``memcache``); every key is described by
``vllm-ascend-kv config AscendStoreConnector``.

``MooncakeConnectorStoreV1`` is the deprecated name of the same connector; it
logs a deprecation warning when created.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm_ascend.distributed.kv_transfer.core.vllm_compat import require_vllm

require_vllm("AscendStoreConnector")

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from vllm_ascend.distributed.kv_transfer.core.config.pool import AscendStoreConfig  # noqa: E402
from vllm_ascend.distributed.kv_transfer.core.vllm_metrics import (  # noqa: E402
    KVPromMetrics,
    KVStats,
)

from .config_data import AscendConnectorMetadata  # noqa: E402
from .context import context_from_vllm  # noqa: E402
from .metrics import POOL_METRICS  # noqa: E402
from .pool_scheduler import KVPoolScheduler  # noqa: E402
from .pool_worker import KVPoolWorker  # noqa: E402

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


class AscendStoreConnector(KVConnectorBase_V1):
    """KV pool connector (vLLM-Ascend's ``AscendStoreConnector``)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kv_config = vllm_config.kv_transfer_config
        self.pool_config = AscendStoreConfig.from_dict(
            kv_config.kv_connector_extra_config,
            source=f"{type(self).__name__} kv_connector_extra_config")
        self.ctx = context_from_vllm(vllm_config)
        self.use_layerwise = self.pool_config.use_layerwise
        self.connector_scheduler: KVPoolScheduler | None = None
        self.connector_worker: KVPoolWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = KVPoolScheduler(self.ctx, self.pool_config)
        else:
            self.connector_worker = KVPoolWorker(self.ctx, self.pool_config,
                                                 parallel_config=vllm_config.parallel_config)

    @property
    def requires_kv_delivery(self) -> bool:
        """A cache: a dropped save is a later miss, never a lost hand-off."""
        return False

    # ============================================================== scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    # ============================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def handle_preemptions(self, kv_connector_metadata: Any = None) -> None:
        # vLLM 0.32+ passes the step's metadata; older versions a set of request ids.
        if self.connector_worker is None:
            return
        if isinstance(kv_connector_metadata, AscendConnectorMetadata):
            ids = kv_connector_metadata.preempted_req_ids
        elif isinstance(kv_connector_metadata, (set, frozenset, list)):
            ids = set(kv_connector_metadata)
        else:
            return
        self.connector_worker.handle_preemptions(set(ids))

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, AscendConnectorMetadata)
        self.connector_worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.use_layerwise and self.connector_worker is not None:
            self.connector_worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        if not self.use_layerwise or self.connector_worker is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, AscendConnectorMetadata)
        self.connector_worker.save_kv_layer(layer_name, meta)

    def wait_for_save(self) -> None:
        assert self.connector_worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, AscendConnectorMetadata)
        self.connector_worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        assert self.connector_worker is not None
        sending, recving = self.connector_worker.get_finished(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.connector_worker is None:
            return set()
        return self.connector_worker.get_block_ids_with_load_errors()

    # ============================================================== both sides
    def get_kv_connector_stats(self) -> KVStats | None:
        side = self.connector_worker or self.connector_scheduler
        return KVStats.from_recorder(side.recorder) if side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVStats:
        return KVStats(data=data) if data is not None else KVStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVPromMetrics:
        return KVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues,
                             specs=POOL_METRICS)

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
            self.connector_worker = None
        if self.connector_scheduler is not None:
            self.connector_scheduler.close()
            self.connector_scheduler = None


class MooncakeConnectorStoreV1(AscendStoreConnector):
    """Deprecated name of :class:`AscendStoreConnector`."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        logger.warning("kv_connector 'MooncakeConnectorStoreV1' is deprecated and will be "
                       "removed; use 'AscendStoreConnector' (same configuration)")
        super().__init__(vllm_config, role, kv_cache_config)
