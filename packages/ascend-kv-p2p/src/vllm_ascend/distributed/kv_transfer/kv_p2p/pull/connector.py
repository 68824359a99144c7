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

The class is thin: scheduler-side work is in :mod:`.pull.scheduler`,
worker-side work in :mod:`.pull.worker` (which composes the P-side
:mod:`.pull.holder` and the D-side :mod:`.pull.reader`); the records the
scheduler sends the worker are :mod:`.pull.contract`.

This module is a path only ascend-kv-p2p ships (vLLM-Ascend's wheel has none
here), so the name stays ours whatever is installed last; upstream's path
:mod:`.mooncake_connector` re-exports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_ascend.distributed.kv_transfer.core.vllm_compat import require_vllm

require_vllm("MooncakeConnectorV1")

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorTransferResults,
    SupportsHMA,
)

from vllm_ascend.distributed.kv_transfer.core.kv_groups import MOVABLE_KINDS  # noqa: E402
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig  # noqa: E402

from ..connector_shell import P2PConnectorShell  # noqa: E402
from ..rank_hosts import hosts_of  # noqa: E402
from .contract import MooncakeConnectorMetadata, RecvMeta, SendMeta  # noqa: E402
from .scheduler import PullScheduler  # noqa: E402
from .worker import PullWorker  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.request import Request

__all__ = ["MooncakeConnector", "MooncakeConnectorMetadata", "RecvMeta", "ReqMeta", "SendMeta"]

#: Upstream's name (``mooncake_connector.ReqMeta``) of the per-request record D pulls by;
#: kept as an alias of :class:`~.pull.contract.RecvMeta` for code written against upstream.
ReqMeta = RecvMeta


class MooncakeConnector(P2PConnectorShell[MooncakeP2PConfig, PullScheduler, PullWorker],
                        SupportsHMA):
    """P/D connector: the decode instance pulls the prefill instance's KV blocks.

    It serves vLLM's hybrid KV cache manager (``SupportsHMA``): with full-attention and
    sliding-window groups, P returns every group's blocks and D reads, group by group, the
    blocks its own manager keeps (a window's, not the whole prompt's); see
    :mod:`.pull.groups`."""

    config_class = MooncakeP2PConfig
    #: a state-space group's state moves too (the block at the group's last position)
    group_kinds = MOVABLE_KINDS

    # ============================== Scheduler-side methods (hybrid KV cache manager)
    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook with the hybrid KV cache manager on: the request's blocks, one list
        per KV cache group."""
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished_groups(request, block_ids)

    def on_new_request(self, request: Request) -> None:
        """vLLM's hook for a request just added (P leaves a window model's last prompt token
        to D: :meth:`~.pull.scheduler.PullScheduler.on_new_request`)."""
        if self.connector_scheduler is not None:
            self.connector_scheduler.on_new_request(request)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """A pull loads the request's own blocks of every group (vLLM's default, the
        prefix-cacheable groups, is a hash-addressed store's)."""
        return tuple(g.index for g in self.kv_groups.groups)

    def _make_scheduler(self, vllm_config: VllmConfig) -> PullScheduler:
        return PullScheduler(vllm_config, self.cfg, self.engine_id, kv_groups=self.kv_groups)

    def _make_worker(self, vllm_config: VllmConfig) -> PullWorker:
        return PullWorker(vllm_config, self.cfg, self.engine_id, self.recorder,
                          kv_groups=self.kv_groups)

    # ============================== Scheduler-side methods
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

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`, and the loads that failed: by request with several KV cache
        groups (vLLM refuses block ids there), by block otherwise
        (:meth:`get_block_ids_with_load_errors`)."""
        assert self.connector_worker is not None
        meta = self._connector_metadata
        sending, recving, failed = self.connector_worker.transfer_results(
            idle=isinstance(meta, MooncakeConnectorMetadata) and meta.idle)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving,
            failed_recving=failed if self.kv_groups.hybrid else set())
