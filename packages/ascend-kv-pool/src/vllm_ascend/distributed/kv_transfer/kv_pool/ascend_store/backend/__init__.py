# SPDX-License-Identifier: Apache-2.0
"""Pool backends, exported lazily by name.

``from ...backend import Backend`` (or ``MooncakeBackend``, ``MemcacheBackend``,
``LocalBackend``) imports only the module that defines the name; the store
packages themselves (``mooncake``, ``memcache_hybrid``) are imported when a
backend is *created*, so importing this package needs neither (nor vLLM).

The classes live in modules only ascend-kv-pool ships (:mod:`.base`,
:mod:`.local_backend`, :mod:`.mooncake_store`, :mod:`.memcache_store`) and the
worker finds them through :mod:`.registry`; upstream's paths (this file,
``backend.py``, ``mooncake_backend.py``, ``memcache_backend.py``) re-export them.
vLLM-Ascend's wheel ships its own copies of those four, which replace these when
it is installed after ours; the pool keeps working with ours. A new backend is
registered in :mod:`.registry`, not here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .registry import backend_class, backend_names, load_export, register_backend

if TYPE_CHECKING:
    from .base import Backend
    from .local_backend import LocalBackend
    from .memcache_store import MemcacheBackend
    from .mooncake_store import MooncakeBackend

__all__ = ["Backend", "LocalBackend", "MemcacheBackend", "MooncakeBackend", "backend_class",
           "backend_names", "register_backend"]


def __getattr__(name: str) -> Any:
    value = load_export(name)
    globals()[name] = value
    return value
