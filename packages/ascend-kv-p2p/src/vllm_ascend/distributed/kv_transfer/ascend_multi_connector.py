# SPDX-License-Identifier: Apache-2.0
"""Upstream-path re-export (no code here): ``AscendMultiConnector`` lives in
``kv_p2p.multi_connector``.

vLLM-Ascend's wheel ships a file at this path too. Installed after ours, its
copy replaces this one: imports of this path then get vLLM-Ascend's class,
while the name ``AscendMultiConnector`` stays ours (it is registered at
``kv_p2p.multi_connector``, which only ascend-kv-p2p ships).
"""

from __future__ import annotations

from vllm_ascend.distributed.kv_transfer.kv_p2p.multi_connector import (
    AscendMultiConnector,
    is_layerwise_connector,
)

__all__ = ["AscendMultiConnector", "is_layerwise_connector"]
