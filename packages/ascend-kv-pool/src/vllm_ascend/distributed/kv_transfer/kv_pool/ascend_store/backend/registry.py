# SPDX-License-Identifier: Apache-2.0
"""Which module defines each pool backend, and the class for a ``backend`` config value.

The worker finds its backend here, never through ``backend/__init__.py``:
vLLM-Ascend's wheel ships its own ``backend/__init__.py`` (and ``backend.py``,
``mooncake_backend.py``, ``memcache_backend.py``), which replace ours when it
is installed after ours. Every module named below is one only ascend-kv-pool
ships. Importing this module imports no backend and no store client.
"""

from __future__ import annotations

import importlib
import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .base import Backend

logger = logging.getLogger(__name__)

_PKG = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend"

#: Exported name -> the module (ours only) defining it.
EXPORTS = {
    "Backend": f"{_PKG}.base",
    "LocalBackend": f"{_PKG}.local_backend",
    "MooncakeBackend": f"{_PKG}.mooncake_store",
    "MemcacheBackend": f"{_PKG}.memcache_store",
}

#: ``backend`` config value -> exported class name.
BACKEND_CLASSES = {
    "local": "LocalBackend",
    "mooncake": "MooncakeBackend",
    "memcache": "MemcacheBackend",
}

__all__ = ["BACKEND_CLASSES", "EXPORTS", "backend_class", "load_export"]


def load_export(name: str) -> Any:
    """The object ``name`` (a key of :data:`EXPORTS`), importing only its module.

    Raises:
        AttributeError: ``name`` is not exported.
    """
    module = EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {_PKG!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def backend_class(name: str) -> type[Backend]:
    """The backend class for a ``backend`` config value.

    Raises:
        ValueError: ``name`` is not a known backend.
    """
    cls_name = BACKEND_CLASSES.get(name.strip().lower())
    if cls_name is None:
        raise ValueError(f"unknown pool backend {name!r}; expected one of "
                         f"{', '.join(sorted(BACKEND_CLASSES))}")
    cls: type[Backend] = load_export(cls_name)
    return cls
