# SPDX-License-Identifier: Apache-2.0
"""``AscendMultiConnector``: vLLM's ``MultiConnector`` that keeps layerwise P/D children fed.

vLLM's ``MultiConnector`` loads through the first child that reports external
tokens (the *chosen* one) and tells the other children about the request with
``num_external_tokens=0`` (vLLM 0.17 also gave them empty blocks). A
``MooncakeLayerwiseConnector`` child must see the request's real blocks and the
real external-token count even when another child (a KV pool) was chosen: on P
it pushes every layer of those blocks to D, on D it posts them to the proxy.
So, as upstream (vLLM-Ascend PR #7032), this class passes ``blocks`` and
``num_external_tokens`` to the chosen child **and every layerwise child**;
the other children get what vLLM's ``MultiConnector`` gives them.

That is the production shape "layerwise P/D plus a shared prefix pool"::

    kv_connector="AscendMultiConnector",
    kv_connector_extra_config={"connectors": [
        {"kv_connector": "MooncakeLayerwiseConnector", ...},
        {"kv_connector": "AscendStoreConnector", ...}]}

vLLM's ``MultiConnector`` keeps its hybrid KV cache manager on only when every child
declares ``SupportsHMA``: both P/D connectors, ``AscendStoreConnector`` and
``CPUOffloadingConnector`` do (``tests-e2e/test_hybrid_multi_e2e.py`` runs vLLM's
``MultiConnector`` over the pull and the pool with it on, a sliding-window model).
``tests-e2e/test_multi_connector_e2e.py`` runs this layerwise shape on real engines, with
the manager off; with it on it is not tested.

Registered as ``AscendMultiConnector``. Upstream replaces vLLM's own
``MultiConnector`` name with this class; we never override a name vLLM owns,
so select it by its own name (or by ``kv_connector_module_path``).
Upstream's path ``kv_transfer/ascend_multi_connector.py`` re-exports it; this
module is a path only ascend-kv-p2p ships, so the name resolves to this class
even when vLLM-Ascend's wheel has overwritten that file.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm_ascend.distributed.kv_transfer.core.vllm_compat import require_vllm

require_vllm("AscendMultiConnector")

from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (  # noqa: E402
    MultiConnector,
)

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

__all__ = ["AscendMultiConnector", "is_layerwise_connector"]


def is_layerwise_connector(connector: Any) -> bool:
    """Whether ``connector`` is a ``MooncakeLayerwiseConnector`` (ours, or vLLM-Ascend's copy)."""
    from .layerwise.connector import MooncakeLayerwiseConnector

    if isinstance(connector, MooncakeLayerwiseConnector):
        return True
    # vLLM-Ascend's wheel ships a class of the same name and module path
    return any(cls.__name__ == "MooncakeLayerwiseConnector" for cls in type(connector).__mro__)


class AscendMultiConnector(MultiConnector):
    """``MultiConnector`` forwarding real blocks to layerwise children (see the module docstring)."""

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        chosen = self._requests_to_connector.get(request.request_id, -1)
        for i, child in enumerate(self._connectors):
            if i == chosen or is_layerwise_connector(child):
                child.update_state_after_alloc(request, blocks, num_external_tokens)
            else:
                # as vLLM's MultiConnector (>= 0.32): the request's blocks, nothing to load
                child.update_state_after_alloc(request, blocks, 0)
