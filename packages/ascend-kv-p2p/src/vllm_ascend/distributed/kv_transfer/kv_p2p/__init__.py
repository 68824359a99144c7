# SPDX-License-Identifier: Apache-2.0
"""ascend-kv-p2p: P/D disaggregation connectors for vLLM.

* ``MooncakeConnectorV1`` -> :mod:`.pull.connector` (decode pulls; upstream's path
  :mod:`.mooncake_connector` re-exports it);
* ``MooncakeLayerwiseConnector`` -> :mod:`.layerwise.connector` (prefill pushes
  layer by layer, virtual push; upstream's path :mod:`.mooncake_layerwise_connector`);
* ``AscendMultiConnector`` -> :mod:`.multi_connector` (vLLM's ``MultiConnector``
  that gives layerwise children the real blocks; upstream's path
  ``kv_transfer.ascend_multi_connector``);
* the P/D proxy: the ``vllm-ascend-pd-proxy`` command (:mod:`.proxy`);
* upstream's ``kv_transfer/utils`` package (``GlobalTE``, the P/D helpers).

Importing this package is cheap: :func:`register` (the ``vllm.general_plugins``
entry point, in :mod:`.plugin`) registers the connector names lazily. vLLM-Ascend's
wheel ships an empty file at this path; nothing of ours needs this one at run time.
"""

from __future__ import annotations

from .__about__ import __version__
from .plugin import CONNECTORS, register

__all__ = ["CONNECTORS", "__version__", "register"]
