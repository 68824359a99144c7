# SPDX-License-Identifier: Apache-2.0
"""ascend-kv-p2p: P/D disaggregation connectors for vLLM.

* ``MooncakeConnectorV1`` -> :mod:`.mooncake_connector` (decode pulls);
* ``MooncakeLayerwiseConnector`` -> :mod:`.mooncake_layerwise_connector`
  (prefill pushes layer by layer, virtual push);
* ``AscendMultiConnector`` -> ``kv_transfer.ascend_multi_connector`` (vLLM's
  ``MultiConnector`` that gives layerwise children the real blocks);
* the P/D proxy: the ``vllm-ascend-pd-proxy`` command (:mod:`.proxy`);
* upstream's ``kv_transfer/utils`` package (``GlobalTE``, the P/D helpers).

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
    # vLLM's MultiConnector feeding layerwise children; under its own name, never over
    # vLLM's "MultiConnector"
    ("AscendMultiConnector", "vllm_ascend.distributed.kv_transfer.ascend_multi_connector",
     "AscendMultiConnector"),
]


def register() -> None:
    """Register the P/D connectors with vLLM (lazy, idempotent)."""
    from vllm_ascend.distributed.kv_transfer.core.registration import register_connectors

    register_connectors(CONNECTORS)
