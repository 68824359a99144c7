# SPDX-License-Identifier: Apache-2.0
"""Upstream's module path of the ``Backend`` ABC; it lives in :mod:`.base`.

vLLM-Ascend's wheel ships a file at this path too; installed after ours, its
copy replaces this one, and the pool keeps using :mod:`.base`.
"""

from __future__ import annotations

from .base import RC_ERROR, Backend, chunks

__all__ = ["RC_ERROR", "Backend", "chunks"]
