# SPDX-License-Identifier: Apache-2.0
"""``MooncakeLayerwiseConnector``: P/D disaggregation where prefill pushes layer by layer.

Lifecycle (vLLM ``KVConnectorBase_V1``):

1. The proxy sends the request to D first, with ``kv_transfer_params =
   {"do_remote_prefill": true, "metaserver": URL, "request_id": ID}``. D's
   ``get_num_new_matched_tokens`` reports the prompt as an asynchronous
   external hit; once blocks are allocated (``update_state_after_alloc``), D
   POSTs its block ids and address to the metaserver (optional TLS from
   ``tls_config``) and its workers wait for the pushes under a deadline.
2. The proxy forwards the request to P with what D posted (``do_remote_decode``)
   and ``max_tokens=1``. Each engine step that computes part of the prompt
   pushes the matching blocks: ``save_kv_layer`` writes every layer into D's
   blocks with the Mooncake transfer engine as soon as the attention layer
   computed it, chunk by chunk under chunked prefill. After the step that
   completes the prompt, each P rank tells each D rank it pushes to that the
   request is complete; D counts these against the expected number.
3. Writes happen under leases D grants on exactly the blocks it allocated for
   the request; D fails (or recomputes, per ``kv_load_failure_policy``) a
   request whose P failed, died or missed the deadline, but only once no P
   can still write into its blocks. P keeps a finished request's blocks until
   no push reads them.

**Virtual push**: a request with ``"do_virtual": true`` is not posted to the
metaserver; D's workers report it loaded at once with nothing transferred
(``ReqMeta.do_virtual``, upstream's name of :class:`~.layerwise.contract.RecvReq`, and
the worker's ``virtual_request`` set). ``None``, empty or ``do_virtual``-less params are
ordinary requests.

The class is thin: scheduler-side work is in :mod:`.layerwise.scheduler`, worker-side
work in :mod:`.layerwise.worker` (a P sender and a D receiver), and the records the
scheduler sends the workers in :mod:`.layerwise.contract`.

This module is a path only ascend-kv-p2p ships, so the name stays ours whatever is
installed last; upstream's path :mod:`.mooncake_layerwise_connector` re-exports it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_ascend.distributed.kv_transfer.core.vllm_compat import require_vllm

require_vllm("MooncakeLayerwiseConnector")

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorTransferResults,
    SupportsHMA,
)

from vllm_ascend.distributed.kv_transfer.core.kv_groups import TOKEN_KINDS  # noqa: E402
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeLayerwiseConfig  # noqa: E402

from ..connector_shell import P2PConnectorShell  # noqa: E402
from .contract import (  # noqa: E402
    MooncakeLayerwiseConnectorMetadata,
    PushReq,
    RecvReq,
    ReqMeta,
)
from .scheduler import LayerwiseScheduler  # noqa: E402
from .worker import LayerwiseWorker  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.request import Request

__all__ = ["MooncakeLayerwiseConnector", "MooncakeLayerwiseConnectorMetadata", "PushReq",
           "RecvReq", "ReqMeta"]


class MooncakeLayerwiseConnector(
        P2PConnectorShell[MooncakeLayerwiseConfig, LayerwiseScheduler, LayerwiseWorker],
        SupportsHMA):
    """P/D connector: the prefill instance pushes each layer into the decode instance.

    It serves vLLM's hybrid KV cache manager (``SupportsHMA``): with full-attention and
    sliding-window groups, D posts the blocks its manager keeps of each group
    (``remote_block_groups``), and each layer's hook on P pushes its own group's blocks.
    """

    config_class = MooncakeLayerwiseConfig
    #: the token kinds (a state is rewritten as the prompt goes on: not pushed layer by layer)
    group_kinds = TOKEN_KINDS

    def _make_scheduler(self, vllm_config: VllmConfig) -> LayerwiseScheduler:
        return LayerwiseScheduler(vllm_config, self.cfg, self.engine_id,
                                  kv_groups=self.kv_groups)

    def _make_worker(self, vllm_config: VllmConfig) -> LayerwiseWorker:
        return LayerwiseWorker(vllm_config, self.cfg, self.engine_id, self.recorder,
                               kv_groups=self.kv_groups)

    # ============================== Scheduler-side methods (hybrid KV cache manager)
    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hook with the hybrid KV cache manager on (the blocks of every group: the
        layerwise scheduler tracks them itself)."""
        assert self.connector_scheduler is not None
        return self.connector_scheduler.request_finished(request, list(block_ids[0]))

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """P pushes the request's own blocks of every group."""
        return tuple(g.index for g in self.kv_groups.groups)

    def _meta(self) -> MooncakeLayerwiseConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, MooncakeLayerwiseConnectorMetadata)
        return meta

    # ============================== Worker-side methods
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        meta = self._meta()
        if meta is not None:
            self.connector_worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """D receives whole requests, P computes its own KV: nothing to wait for."""

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.save_kv_layer(self._meta(), layer_name, kv_layer)

    def wait_for_save(self) -> None:
        assert self.connector_worker is not None
        self.connector_worker.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                 set[str] | None]:
        assert self.connector_worker is not None
        meta = self._meta()  # bound while vLLM asks (None in a bare call)
        return self.connector_worker.get_finished(finished_req_ids,
                                                  idle=meta is not None and meta.idle)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`, and the receptions that failed: by request with several KV
        cache groups (vLLM refuses block ids there), by block otherwise."""
        assert self.connector_worker is not None
        meta = self._meta()
        sending, recving, failed = self.connector_worker.transfer_results(
            finished_req_ids, idle=meta is not None and meta.idle)
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving,
            failed_recving=failed if self.kv_groups.hybrid else set())


def push_stats(_llm: Any = None) -> dict[str, int]:
    """Diagnostics of this process's layerwise worker: how layer pushes were queued.

    ``hooked``: by the attention layer's ``save_kv_layer`` (the layer-by-layer path);
    ``fallback``: by ``wait_for_save`` because the backend never called the hook.
    The argument is ignored (it lets ``EngineProcess.call`` run this in an engine).
    """
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return {}
    worker = getattr(get_kv_transfer_group(), "connector_worker", None)
    if not isinstance(worker, LayerwiseWorker):
        return {}
    return {"hooked": worker.hooked_layer_pushes, "fallback": worker.fallback_layer_pushes}
