# SPDX-License-Identifier: Apache-2.0
"""Upstream-path re-export (no code here): ``MooncakeConnector`` lives in :mod:`.pull.connector`.

This module exists because upstream's configs and imports name this path
(``kv_connector_module_path``, DESIGN.md); everything else of the connector is in
:mod:`.pull`.

vLLM-Ascend's wheel ships a file at this path too. Installed after ours, its
copy replaces this one: imports of this path then get vLLM-Ascend's class,
while the name ``MooncakeConnectorV1`` stays ours (it is registered at
:mod:`.pull.connector`, which only ascend-kv-p2p ships).
"""

from __future__ import annotations

from .pull.connector import (
    MooncakeConnector,
    MooncakeConnectorMetadata,
    RecvMeta,
    ReqMeta,
    SendMeta,
)

__all__ = ["MooncakeConnector", "MooncakeConnectorMetadata", "RecvMeta", "ReqMeta", "SendMeta"]
