# SPDX-License-Identifier: Apache-2.0
"""Pool backends, exported lazily by name.

``from ...backend import Backend`` (or ``MooncakeBackend``, ``MemcacheBackend``,
``LocalBackend``) imports only the module that defines the name; the store
packages themselves (``mooncake``, ``memcache_hybrid``) are imported when a
backend is *created*, so importing this package needs neither (nor vLLM).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .backend import Backend
    from .local_backend import LocalBackend
    from .memcache_backend import MemcacheBackend
    from .mooncake_backend import MooncakeBackend

#: Exported name -> submodule defining it.
_EXPORTS = {
    "Backend": "backend",
    "LocalBackend": "local_backend",
    "MooncakeBackend": "mooncake_backend",
    "MemcacheBackend": "memcache_backend",
}

#: ``backend`` config value -> exported class name.
BACKEND_CLASSES = {
    "local": "LocalBackend",
    "mooncake": "MooncakeBackend",
    "memcache": "MemcacheBackend",
}

__all__ = ["BACKEND_CLASSES", "Backend", "LocalBackend", "MemcacheBackend", "MooncakeBackend",
           "backend_class"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def backend_class(name: str) -> type[Backend]:
    """The backend class for a ``backend`` config value.

    Raises:
        ValueError: ``name`` is not a known backend.
    """
    cls_name = BACKEND_CLASSES.get(name.strip().lower())
    if cls_name is None:
        raise ValueError(f"unknown pool backend {name!r}; expected one of "
                         f"{', '.join(sorted(BACKEND_CLASSES))}")
    cls: type[Backend] = __getattr__(cls_name)
    return cls
