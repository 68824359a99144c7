# SPDX-License-Identifier: Apache-2.0
"""A fake ``memcache_hybrid`` for machines without an Ascend driver.

The real package imports without CANN, but every data path refuses to run
("the current version of ascend driver does not support mf!"). This stand-in
keeps the names, signatures and return codes of ``memcache_hybrid`` 1.3.0's
``DistributedObjectStore`` that the pool uses and keeps objects in a dict
shared by every store of the process (like one memcache cluster):

* ``init(device_id, init_bm=True) -> int`` (0; set :data:`FAIL_INIT` to get the
  driver's -1), ``setup(config) -> int``, ``close() -> int``;
* ``register_buffer(buffer_ptr, size) -> int``, ``unregister_buffer(...)``;
* ``is_exist(key)`` / ``batch_is_exist(keys) -> list[int]`` (1 present, 0 absent,
  -1 error);
* ``batch_put_from_layers(keys, buffer_ptrs, sizes, direct=3, replicateConfig=...)``
  and ``batch_get_into_layers(keys, buffer_ptrs, sizes, direct=2) -> list[int]``
  (0 ok, -1 error: missing key, size mismatch, not initialised);
* ``put_from`` / ``get_into`` / ``remove`` / ``remove_batch`` / ``remove_all``.

Activate with :func:`install` (or the ``fake_memcache`` fixture), remove with
:func:`uninstall`; it is never activated by importing this module.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import types
from typing import Any

#: Copy directions, as ``memcache_hybrid.L2G`` ... (``BmCopyType`` values).
L2G, G2L, G2H, H2G, AUTO = 0, 1, 2, 3, 9
MMC_OK = 0
MMC_ERROR = -1

#: Objects of the fake cluster: key -> bytes.
OBJECTS: dict[str, bytes] = {}
#: Every call, as ``(method, first argument)``, for assertions.
CALLS: list[tuple[str, Any]] = []
#: Make ``init`` fail the way it does without an Ascend driver.
FAIL_INIT = False
_lock = threading.Lock()


class ReplicateConfig:
    """``memcache_hybrid.ReplicateConfig``."""

    def __init__(self) -> None:
        self.replicaNum = 1
        self.preferredLocalServiceIDs: list[int] = []


class LocalConfig:
    """``memcache_hybrid.LocalConfig`` (the fields the tests set)."""

    def __init__(self) -> None:
        self.meta_service_url = ""
        self.config_store_url = ""
        self.protocol = "host_tcp"
        self.dram_size = "64MB"
        self.hbm_size = "0"
        self.world_size = 1


class KeyInfo:
    """``memcache_hybrid.KeyInfo``."""

    def __init__(self, size: int = 0) -> None:
        self.size = size
        self.gva_list: list[int] = []
        self.loc_list: list[int] = []
        self.type_list: list[int] = []


class DistributedObjectStore:
    """``memcache_hybrid.DistributedObjectStore`` over a process-wide dict."""

    def __init__(self) -> None:
        self._ready = False
        self.device_id: int | None = None
        self.registered: list[tuple[int, int]] = []

    def setup(self, config: LocalConfig) -> int:
        CALLS.append(("setup", config))
        return MMC_OK

    def init(self, device_id: int, init_bm: bool = True) -> int:
        CALLS.append(("init", device_id))
        if FAIL_INIT:
            return MMC_ERROR
        self._ready = True
        self.device_id = int(device_id)
        return MMC_OK

    def close(self) -> int:
        CALLS.append(("close", None))
        self._ready = False
        return MMC_OK

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        CALLS.append(("register_buffer", (buffer_ptr, size)))
        if not self._ready or size <= 0:
            return MMC_ERROR
        self.registered.append((int(buffer_ptr), int(size)))
        return MMC_OK

    def unregister_buffer(self, buffer_ptr: int, size: int) -> int:
        CALLS.append(("unregister_buffer", (buffer_ptr, size)))
        try:
            self.registered.remove((int(buffer_ptr), int(size)))
        except ValueError:
            return MMC_ERROR
        return MMC_OK

    # ------------------------------------------------------------ queries
    def is_exist(self, key: str) -> int:
        if not self._ready:
            return MMC_ERROR
        with _lock:
            return 1 if key in OBJECTS else 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        CALLS.append(("batch_is_exist", len(keys)))
        return [self.is_exist(k) for k in keys]

    def get_key_info(self, key: str, flag: int = 1) -> KeyInfo:
        with _lock:
            value = OBJECTS.get(key)
        return KeyInfo(len(value) if value is not None else 0)

    # ------------------------------------------------------------ data
    def put_from_layers(self, key: str, buffer_ptrs: list[int], sizes: list[int],
                        direct: int = H2G, replicateConfig: ReplicateConfig | None = None) -> int:
        if not self._ready or len(buffer_ptrs) != len(sizes) or direct not in (L2G, H2G, AUTO):
            return MMC_ERROR
        data = b"".join(ctypes.string_at(int(p), int(n)) for p, n in zip(buffer_ptrs, sizes,
                                                                        strict=True))
        with _lock:
            OBJECTS.setdefault(key, data)
        return MMC_OK

    def batch_put_from_layers(self, keys: list[str], buffer_ptrs: list[list[int]],
                              sizes: list[list[int]], direct: int = H2G,
                              replicateConfig: ReplicateConfig | None = None) -> list[int]:
        CALLS.append(("batch_put_from_layers", (len(keys), direct)))
        if len(keys) != len(buffer_ptrs) or len(keys) != len(sizes):
            return [MMC_ERROR] * len(keys)
        return [self.put_from_layers(k, p, s, direct) for k, p, s in zip(keys, buffer_ptrs, sizes,
                                                                         strict=True)]

    def get_into_layers(self, key: str, buffer_ptrs: list[int], sizes: list[int],
                        direct: int = G2H) -> int:
        if not self._ready or len(buffer_ptrs) != len(sizes) or direct not in (G2L, G2H, AUTO):
            return MMC_ERROR
        with _lock:
            value = OBJECTS.get(key)
        if value is None or sum(int(n) for n in sizes) != len(value):
            return MMC_ERROR
        offset = 0
        for p, n in zip(buffer_ptrs, sizes, strict=True):
            ctypes.memmove(int(p), value[offset:offset + int(n)], int(n))
            offset += int(n)
        return MMC_OK

    def batch_get_into_layers(self, keys: list[str], buffer_ptrs: list[list[int]],
                              sizes: list[list[int]], direct: int = G2H) -> list[int]:
        CALLS.append(("batch_get_into_layers", (len(keys), direct)))
        if len(keys) != len(buffer_ptrs) or len(keys) != len(sizes):
            return [MMC_ERROR] * len(keys)
        return [self.get_into_layers(k, p, s, direct) for k, p, s in zip(keys, buffer_ptrs, sizes,
                                                                         strict=True)]

    def put_from(self, key: str, buffer_ptr: int, size: int, direct: int = H2G,
                 replicateConfig: ReplicateConfig | None = None) -> int:
        return self.put_from_layers(key, [buffer_ptr], [size], direct)

    def get_into(self, key: str, buffer_ptr: int, size: int, direct: int = G2H) -> int:
        return self.get_into_layers(key, [buffer_ptr], [size], direct)

    def remove(self, key: str) -> int:
        with _lock:
            return MMC_OK if OBJECTS.pop(key, None) is not None else MMC_ERROR

    def remove_batch(self, keys: list[str]) -> list[int]:
        return [self.remove(k) for k in keys]

    def remove_all(self) -> int:
        with _lock:
            OBJECTS.clear()
        return MMC_OK


class MetaService:
    """``memcache_hybrid.MetaService`` (not started by the fake)."""

    @staticmethod
    def setup(config: Any) -> int:
        return MMC_OK

    @staticmethod
    def main() -> int:
        return MMC_OK


class MetaConfig:
    """``memcache_hybrid.MetaConfig``."""


_saved: dict[str, Any] = {}


def install() -> types.ModuleType:
    """Put the fake in ``sys.modules['memcache_hybrid']`` (clearing its objects)."""
    global FAIL_INIT
    mod = types.ModuleType("memcache_hybrid")
    for name in ("DistributedObjectStore", "LocalConfig", "ReplicateConfig", "KeyInfo",
                 "MetaService", "MetaConfig", "L2G", "G2L", "G2H", "H2G", "AUTO"):
        setattr(mod, name, globals()[name])
    mod.__dict__["__fake__"] = True
    if "memcache_hybrid" in sys.modules and "memcache_hybrid" not in _saved:
        _saved["memcache_hybrid"] = sys.modules["memcache_hybrid"]
    sys.modules["memcache_hybrid"] = mod
    OBJECTS.clear()
    CALLS.clear()
    FAIL_INIT = False
    return mod


def uninstall() -> None:
    """Remove the fake (restoring a real module that was imported before)."""
    global FAIL_INIT
    sys.modules.pop("memcache_hybrid", None)
    if "memcache_hybrid" in _saved:
        sys.modules["memcache_hybrid"] = _saved.pop("memcache_hybrid")
    OBJECTS.clear()
    CALLS.clear()
    FAIL_INIT = False
