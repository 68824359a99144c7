# SPDX-License-Identifier: Apache-2.0
"""Upstream's module path of ``MooncakeConnector``; the class lives in :mod:`.pull.connector`.

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
