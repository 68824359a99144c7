# SPDX-License-Identifier: Apache-2.0
"""ascend-kv-p2p: P/D disaggregation connectors for vLLM.

* ``MooncakeConnectorV1`` -> :mod:`.pull` (decode pulls: :mod:`.pull.connector`);
* ``MooncakeLayerwiseConnector`` -> :mod:`.layerwise` (prefill pushes layer by layer,
  virtual push: :mod:`.layerwise.connector`);
* ``AscendMultiConnector`` -> :mod:`.multi_connector` (vLLM's ``MultiConnector``
  that gives layerwise children the real blocks);
* what both connectors share, at this level: :mod:`.config`, :mod:`.params`,
  :mod:`.protocol`, :mod:`.connector_shell`, :mod:`.scheduler_base`,
  :mod:`.worker_base`, :mod:`.renewer`, :mod:`.rank_hosts`, :mod:`.errors`,
  :mod:`.p2p_metrics`;
* the P/D proxy: the ``vllm-ascend-pd-proxy`` command (:mod:`.proxy`);
* upstream's ``kv_transfer/utils`` package (``GlobalTE``, the P/D helpers).

Upstream-path re-exports, kept only because upstream's configs and imports name them (no
code of ours lives there): :mod:`.mooncake_connector`, :mod:`.mooncake_layerwise_connector`
and ``kv_transfer/ascend_multi_connector.py``.

Importing this package is cheap: :func:`register` (the ``vllm.general_plugins``
entry point, in :mod:`.plugin`) registers the connector names lazily. vLLM-Ascend's
wheel ships an empty file at this path; nothing of ours needs this one at run time.
"""

from __future__ import annotations

from .__about__ import __version__
from .plugin import CONNECTORS, register

__all__ = ["CONNECTORS", "__version__", "register"]
