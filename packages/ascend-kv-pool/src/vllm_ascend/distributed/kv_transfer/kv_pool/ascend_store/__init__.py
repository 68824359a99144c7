# SPDX-License-Identifier: Apache-2.0
"""ascend-kv-pool: the KV pool connector (``AscendStoreConnector``) and its backends.

Importing this package is light (no vLLM, no store client); :func:`register`
is the ``vllm.general_plugins`` entry point that tells vLLM where the
connector classes live.
"""

from __future__ import annotations

from .__about__ import __version__

CONNECTOR_MODULE = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.ascend_store_connector"

#: (name, module, class) of every connector this package registers.
CONNECTORS = (
    ("AscendStoreConnector", CONNECTOR_MODULE, "AscendStoreConnector"),
    # deprecated alias; the class logs a warning when it is created
    ("MooncakeConnectorStoreV1", CONNECTOR_MODULE, "MooncakeConnectorStoreV1"),
)

#: Upstream's thin shells over third-party engines (``uc-manager``, LMCache-Ascend), at the
#: kv_pool level; their modules import those engines, so only when vLLM creates the connector.
THIRD_PARTY_CONNECTORS = (
    ("UCMConnector", "vllm_ascend.distributed.kv_transfer.kv_pool.ucm_connector",
     "UCMConnectorV1"),
    ("LMCacheAscendConnector",
     "vllm_ascend.distributed.kv_transfer.kv_pool.lmcache_ascend_connector",
     "LMCacheConnectorV1"),
)

__all__ = ["CONNECTORS", "THIRD_PARTY_CONNECTORS", "__version__", "register"]


def register() -> list[str]:
    """Register the pool connectors with vLLM (lazy, idempotent); returns names newly added."""
    from vllm_ascend.distributed.kv_transfer.core.registration import register_connectors

    return register_connectors((*CONNECTORS, *THIRD_PARTY_CONNECTORS))
