# SPDX-License-Identifier: Apache-2.0
"""Upstream's module path of ``KVPoolWorker``; it lives in :mod:`.store_worker`.

vLLM-Ascend's wheel ships a file at this path too; installed after ours, its
copy replaces this one, and the pool keeps using :mod:`.store_worker`.
"""

from __future__ import annotations

from .store_worker import KVPoolWorker, create_backend

__all__ = ["KVPoolWorker", "create_backend"]
