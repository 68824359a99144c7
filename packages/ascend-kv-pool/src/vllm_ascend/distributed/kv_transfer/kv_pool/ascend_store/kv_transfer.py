# SPDX-License-Identifier: Apache-2.0
"""Upstream's module path of the pool's save and load threads; they live in :mod:`.store_transfer`.

vLLM-Ascend's wheel ships a file at this path too; installed after ours, its
copy replaces this one, and the pool keeps using :mod:`.store_transfer`.
"""

from __future__ import annotations

from .store_transfer import (
    LoadTask,
    PendingSaves,
    SaveTask,
    StoreGuard,
    TransferThread,
    run_load,
    run_save,
)

__all__ = ["LoadTask", "PendingSaves", "SaveTask", "StoreGuard", "TransferThread", "run_load",
           "run_save"]
