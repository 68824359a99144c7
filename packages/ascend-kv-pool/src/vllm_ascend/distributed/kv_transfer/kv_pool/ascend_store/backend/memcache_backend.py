# SPDX-License-Identifier: Apache-2.0
"""Upstream's module path of ``MemcacheBackend``; it lives in :mod:`.memcache_store`.

vLLM-Ascend's wheel ships a file at this path too; installed after ours, its
copy replaces this one, and the pool keeps using :mod:`.memcache_store`.
"""

from __future__ import annotations

from .memcache_store import MemcacheBackend, MmcDirect, detect_device_type

__all__ = ["MemcacheBackend", "MmcDirect", "detect_device_type"]
