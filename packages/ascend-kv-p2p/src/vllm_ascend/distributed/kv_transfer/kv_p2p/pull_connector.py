# SPDX-License-Identifier: Apache-2.0
"""``MooncakeConnectorV1``: P/D disaggregation where the decode instance pulls.

Lifecycle (vLLM ``KVConnectorBase_V1``):

1. The proxy sends the request to P with ``kv_transfer_params =
   {"do_remote_decode": true}`` and ``max_tokens=1``. P prefills; when the
   request finishes, ``request_finished`` keeps its blocks (delayed free) and
   returns the params D needs (``remote_block_ids``, ``remote_engine_id``,
   ``remote_host``, ``remote_port``, ``remote_request_id``, TP sizes, ...).
2. The proxy sends the request to D with those params. D's
   ``get_num_new_matched_tokens`` reports the prompt as an asynchronous
   external hit; after allocation D's worker claims the blocks on P, reads
   them with the Mooncake transfer engine, and sends ``Done`` so P frees them.
3. Every block P holds has a lease that D renews; every D load has a
   deadline; failures go to ``get_block_ids_with_load_errors`` and vLLM's
   ``kv_load_failure_policy`` decides between failing and recomputing.

The class is thin: scheduler-side work is in :mod:`.pull_scheduler`,
worker-side work in :mod:`.pull_worker` (which composes the P-side
:mod:`.pull_holder` and the D-side :mod:`.pull_reader`); the records the
scheduler sends the worker are :mod:`.pull_contract`.

This module is a path only ascend-kv-p2p ships (vLLM-Ascend's wheel has none
here), so the name stays ours whatever is installed last; upstream's path
:mod:`.mooncake_connector` re-exports it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm_ascend.distributed.kv_transfer.core.vllm_compat import require_vllm

require_vllm("MooncakeConnectorV1")

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder  # noqa: E402
from vllm_ascend.distributed.kv_transfer.core.vllm_metrics import ConnectorStatsMixin  # noqa: E402
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig  # noqa: E402

from .p2p_metrics import P2P_METRICS  # noqa: E402
from .pull_contract import MooncakeConnectorMetadata, RecvMeta, SendMeta  # noqa: E402
from .pull_scheduler import PullScheduler  # noqa: E402
from .pull_worker import PullWorker  # noqa: E402
from .rank_hosts import RankAddress, hosts_of  # noqa: E402
from .worker_base import refuse_unsupported_shapes  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["MooncakeConnector", "MooncakeConnectorMetadata", "RecvMeta", "ReqMeta", "SendMeta"]

logger = logging.getLogger(__name__)

#: Upstream's name (``mooncake_connector.ReqMeta``) of the per-request record D pulls by;
#: kept as an alias of :class:`~.pull_contract.RecvMeta` for code written against upstream.
ReqMeta = RecvMeta


class MooncakeConnector(ConnectorStatsMixin, KVConnectorBase_V1):
    """P/D connector: the decode instance pulls the prefill instance's KV blocks."""

    metric_specs = P2P_METRICS

    config_class: type[MooncakeP2PConfig] = MooncakeP2PConfig

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        kvc = vllm_config.kv_transfer_config
        assert kvc is not None
        self.cfg = self.config_class.from_dict(
            kvc.kv_connector_extra_config,
            source=f"kv_connector_extra_config of {type(self).__name__}")
        refuse_unsupported_shapes(vllm_config, kv_cache_config, type(self).__name__)
        self.engine_id = str(kvc.engine_id)
        self.recorder = MetricsRecorder(P2P_METRICS)
        self.connector_scheduler: PullScheduler | None = None
        self.connector_worker: PullWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = PullScheduler(vllm_config, self.cfg, self.engine_id)
        else:
            self.connector_worker = PullWorker(vllm_config, self.cfg, self.engine_id,
                                               self.recorder)

    # ============================== Scheduler-side methods
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        assert self.connector_scheduler is not None
        self.connector_scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, block_ids)

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        """Where each of this instance's TP ranks listens (vLLM collects them from the
        workers' :meth:`get_handshake_metadata`); P names them in its params for D."""
        if self.connector_scheduler is not None:
            self.connector_scheduler.rank_hosts = hosts_of(metadata)

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]
                                             ) -> None:
        """Each ``(pipeline stage, TP rank)``'s address (vLLM's PP-aware form; its default
        refuses any stage above 0): a pipeline-parallel P's stages on one host name their
        TP ranks' host; stages on several hosts are refused, naming them."""
        if self.connector_scheduler is None:
            return
        by_stage: dict[int, dict[int, str]] = {}
        for (pp_rank, tp_rank), meta in metadata.items():
            by_stage.setdefault(int(pp_rank), {}).update(hosts_of({tp_rank: meta}))
        self.connector_scheduler.set_stage_hosts(by_stage)

    # ============================== Worker-side methods
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        assert self.connector_worker is not None
        self.connector_worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> Any:
        """This rank's side-channel address, for the scheduler (:mod:`.rank_hosts`)."""
        w = self.connector_worker
        if w is None:
            return None
        return RankAddress(host=w.host, port=w.port, tp_rank=w.tp_rank)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, MooncakeConnectorMetadata)
        self.connector_worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Loads are whole-request and asynchronous: nothing to wait for per layer."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        """P keeps its blocks in place; D pulls them: nothing to save."""

    def wait_for_save(self) -> None:
        """Nothing is saved."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        assert self.connector_worker is not None
        meta = self._connector_metadata  # bound while vLLM asks (None in a bare call)
        return self.connector_worker.get_finished(
            idle=isinstance(meta, MooncakeConnectorMetadata) and meta.idle)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self.connector_worker is None:
            return set()
        return self.connector_worker.get_block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.connector_worker is not None:
            self.connector_worker.shutdown()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()
