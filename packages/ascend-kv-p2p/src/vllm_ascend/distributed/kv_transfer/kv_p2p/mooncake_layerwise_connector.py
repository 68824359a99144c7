# SPDX-License-Identifier: Apache-2.0
"""Upstream-path re-export (no code): ``MooncakeLayerwiseConnector`` is in :mod:`.layerwise`.

The class lives in :mod:`.layerwise.connector`.

This module exists because upstream's configs and imports name this path
(``kv_connector_module_path``, DESIGN.md); everything else of the connector is in
:mod:`.layerwise`.

vLLM-Ascend's wheel ships a file at this path too. Installed after ours, its
copy replaces this one: imports of this path then get vLLM-Ascend's class,
while the name ``MooncakeLayerwiseConnector`` stays ours (it is registered at
:mod:`.layerwise.connector`, which only ascend-kv-p2p ships).
"""

from __future__ import annotations

from .layerwise.connector import (
    MooncakeLayerwiseConnector,
    MooncakeLayerwiseConnectorMetadata,
    PushReq,
    RecvReq,
    ReqMeta,
    push_stats,
)

__all__ = ["MooncakeLayerwiseConnector", "MooncakeLayerwiseConnectorMetadata", "PushReq",
           "RecvReq", "ReqMeta", "push_stats"]
