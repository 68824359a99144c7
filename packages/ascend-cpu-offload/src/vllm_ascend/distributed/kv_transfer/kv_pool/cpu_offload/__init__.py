# SPDX-License-Identifier: Apache-2.0
"""CPU offload: ``CPUOffloadingConnector`` and its host-memory KV manager.

KV blocks computed on the device are copied into a host-memory prefix cache
shared by the ranks of one instance; a later request whose prefix is there
(and no longer in the device's own prefix cache) gets it back layer by layer.

Importing this package is cheap: :func:`register` only tells vLLM where the
connector lives; the connector module is imported when vLLM builds it.
"""

from __future__ import annotations

from .__about__ import __version__

CONNECTOR_NAME = "CPUOffloadingConnector"
CONNECTOR_MODULE = "vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_connector"

__all__ = ["CONNECTOR_MODULE", "CONNECTOR_NAME", "__version__", "register"]


def register() -> list[str]:
    """Register ``CPUOffloadingConnector`` with vLLM's connector factory (lazy, idempotent).

    Upstream left the connector unregistered (reachable only through
    ``kv_connector_module_path``); this makes ``"kv_connector":
    "CPUOffloadingConnector"`` work. Returns the names newly registered.
    """
    from vllm_ascend.distributed.kv_transfer.core.registration import register_connectors

    return register_connectors([(CONNECTOR_NAME, CONNECTOR_MODULE, "CPUOffloadingConnector")])
