# SPDX-License-Identifier: Apache-2.0
"""ascend-kv-pool's ``vllm.general_plugins`` entry point: :func:`register`.

The connector names are registered at :mod:`.store_connector`, a module only
ascend-kv-pool ships, and this module is one too: vLLM-Ascend's wheel,
installed after ours, overwrites upstream's paths (``ascend_store/__init__.py``
with an empty file, ``ascend_store_connector.py``, ``pool_worker.py``,
``backend/``, ...) but neither this entry point nor anything the connector
imports at run time.
"""

from __future__ import annotations

__all__ = ["CONNECTORS", "CONNECTOR_MODULE", "THIRD_PARTY_CONNECTORS", "register"]

CONNECTOR_MODULE = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.store_connector"

#: (name, module, class) of every connector this package registers.
CONNECTORS = (
    ("AscendStoreConnector", CONNECTOR_MODULE, "AscendStoreConnector"),
    # deprecated alias; the class logs a warning when it is created
    ("MooncakeConnectorStoreV1", CONNECTOR_MODULE, "MooncakeConnectorStoreV1"),
)

#: Upstream's thin shells over third-party engines (``uc-manager``, LMCache-Ascend), at the
#: kv_pool level; their modules import those engines, so only when vLLM creates the connector.
#: These are upstream's paths: with vLLM-Ascend installed after ours, its copies answer.
THIRD_PARTY_CONNECTORS = (
    ("UCMConnector", "vllm_ascend.distributed.kv_transfer.kv_pool.ucm_connector",
     "UCMConnectorV1"),
    ("LMCacheAscendConnector",
     "vllm_ascend.distributed.kv_transfer.kv_pool.lmcache_ascend_connector",
     "LMCacheConnectorV1"),
)


def register() -> list[str]:
    """Register the pool connectors with vLLM (lazy, idempotent); returns names newly added."""
    from vllm_ascend.distributed.kv_transfer.core.registration import register_connectors

    return register_connectors((*CONNECTORS, *THIRD_PARTY_CONNECTORS))
