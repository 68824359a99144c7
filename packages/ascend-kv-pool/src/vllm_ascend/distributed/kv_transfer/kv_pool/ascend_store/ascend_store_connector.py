# SPDX-License-Identifier: Apache-2.0
"""Upstream's module path of ``AscendStoreConnector``; it lives in :mod:`.store_connector`.

vLLM-Ascend's wheel ships a file at this path too. Installed after ours, its
copy replaces this one: imports of this path then get vLLM-Ascend's class,
while the names ``AscendStoreConnector`` and ``MooncakeConnectorStoreV1`` stay
ours (they are registered at :mod:`.store_connector`, which only ascend-kv-pool
ships).
"""

from __future__ import annotations

from .store_connector import (
    EVENT_MEDIUM,
    MAX_PENDING_EVENTS,
    AscendStoreConnector,
    AscendStoreKVEvents,
    MooncakeConnectorStoreV1,
    to_vllm_events,
)

__all__ = ["EVENT_MEDIUM", "MAX_PENDING_EVENTS", "AscendStoreConnector", "AscendStoreKVEvents",
           "MooncakeConnectorStoreV1", "to_vllm_events"]
