# SPDX-License-Identifier: Apache-2.0
"""ascend-kv-p2p's ``vllm.general_plugins`` entry point: :func:`register`.

The connector names are registered at modules only ascend-kv-p2p ships
(:mod:`.pull.connector`, :mod:`.layerwise.connector`, :mod:`.multi_connector`),
and this module is one of them: vLLM-Ascend's wheel, installed after ours,
overwrites upstream's paths (``kv_p2p/__init__.py`` with an empty file,
``mooncake_connector.py``, ...) but neither this entry point nor the classes
behind the names.
"""

from __future__ import annotations

__all__ = ["CONNECTORS", "register"]

_PKG = "vllm_ascend.distributed.kv_transfer.kv_p2p"

#: (name, module, class) of every connector this package provides.
CONNECTORS = [
    ("MooncakeConnectorV1", f"{_PKG}.pull.connector", "MooncakeConnector"),
    ("MooncakeLayerwiseConnector", f"{_PKG}.layerwise.connector", "MooncakeLayerwiseConnector"),
    # vLLM's MultiConnector feeding layerwise children; under its own name, never over
    # vLLM's "MultiConnector"
    ("AscendMultiConnector", f"{_PKG}.multi_connector", "AscendMultiConnector"),
]


def register() -> None:
    """Register the P/D connectors with vLLM (lazy, idempotent)."""
    from vllm_ascend.distributed.kv_transfer.core.registration import register_connectors

    register_connectors(CONNECTORS)
