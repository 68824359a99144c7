# SPDX-License-Identifier: Apache-2.0
"""Upstream's module path of ``KVPoolScheduler``; it lives in :mod:`.store_scheduler`.

vLLM-Ascend's wheel ships a file at this path too; installed after ours, its
copy replaces this one, and the pool keeps using :mod:`.store_scheduler`.
"""

from __future__ import annotations

from .store_scheduler import MAX_TRACKED_WAITING, KVPoolScheduler

__all__ = ["MAX_TRACKED_WAITING", "KVPoolScheduler"]
