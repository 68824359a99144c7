# SPDX-License-Identifier: Apache-2.0
"""Upstream's module path of the pool's contract; it lives in :mod:`.store_contract`.

vLLM-Ascend's wheel ships a file at this path too; installed after ours, its
copy replaces this one, and the pool keeps using :mod:`.store_contract`.
"""

from __future__ import annotations

from .store_contract import (
    AscendConnectorMetadata,
    BlockEventSpec,
    BlockHasher,
    KeyMetadata,
    LayerPoolKey,
    LoadSpec,
    PoolHit,
    PoolKey,
    RequestTracker,
    TransferJob,
)

__all__ = ["AscendConnectorMetadata", "BlockEventSpec", "BlockHasher", "KeyMetadata",
           "LayerPoolKey", "LoadSpec", "PoolHit", "PoolKey", "RequestTracker", "TransferJob"]
