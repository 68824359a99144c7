# SPDX-License-Identifier: Apache-2.0
"""ascend-kv-p2p: P/D disaggregation connectors for vLLM.

* ``MooncakeConnectorV1`` -> :mod:`.mooncake_connector` (decode pulls);
* ``MooncakeLayerwiseConnector`` -> :mod:`.mooncake_layerwise_connector`
  (prefill pushes layer by layer, virtual push);
* the P/D proxy: the ``vllm-ascend-pd-proxy`` command (:mod:`.proxy`).

Importing this package is cheap: :func:`register` (the ``vllm.general_plugins``
entry point) registers the connector names lazily.
"""

from __future__ import annotations

from .__about__ import __version__

__all__ = ["CONNECTORS", "__version__", "register"]

_PKG = "vllm_ascend.distributed.kv_transfer.kv_p2p"

#: (name, module, class) of every connector this package provides.
CONNECTORS = [
    ("MooncakeConnectorV1", f"{_PKG}.mooncake_connector", "MooncakeConnector"),
    ("MooncakeLayerwiseConnector", f"{_PKG}.mooncake_layerwise_connector",
     "MooncakeLayerwiseConnector"),
]


def register() -> None:
    """Register the P/D connectors with vLLM (lazy, idempotent)."""
    from vllm_ascend.distributed.kv_transfer.core.registration import register_connectors

    register_connectors(CONNECTORS)
