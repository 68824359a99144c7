# SPDX-License-Identifier: Apache-2.0
"""The embedded default backend: host memory of this process, bounded, LRU.

Zero configuration: with no ``backend`` key the pool keeps blocks here, up to
``local_pool_size`` bytes (``"8GB"`` by default), evicting the least recently
used objects. Objects are numpy byte arrays; copies are ``memmove`` calls that
release the GIL, so the save and load threads overlap the forward pass.

The store is per process: with TP > 1 each worker keeps its own heads, and the
lookup (answered by rank 0) sees only rank 0's objects. A rank that evicted a
block the others kept fails that load and vLLM recomputes the block.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from .base import RC_ERROR, Backend

logger = logging.getLogger(__name__)

#: The object does not exist.
RC_NOT_FOUND = -704
#: The destination ranges do not add up to the stored object's size.
RC_SIZE_MISMATCH = -600
#: The object is larger than the whole pool.
RC_TOO_LARGE = -10

_RC_TEXT = {RC_NOT_FOUND: "object not found", RC_SIZE_MISMATCH: "size mismatch",
            RC_TOO_LARGE: "object larger than local_pool_size", RC_ERROR: "error"}

DEFAULT_CAPACITY = 8 << 30


class LocalBackend(Backend):
    """Bounded LRU pool in this process's memory.

    Evicted and removed keys are reported to the listeners of
    :meth:`add_eviction_listener` (the pool's ``BlockRemoved`` KV cache events).

    Args:
        parallel_config: unused (upstream signature).
        capacity: bytes kept at most; default from ``config.local_pool_size`` or 8 GiB.
        **kwargs: ``config``, the pool's ``AscendStoreConfig`` (optional), and the
            options of :class:`~.base.Backend`.
    """

    name: ClassVar[str] = "local"
    shared_across_processes: ClassVar[bool] = False
    host_memory_only: ClassVar[bool] = True

    def __init__(self, parallel_config: Any = None, *, capacity: int | None = None,
                 **kwargs: Any) -> None:
        config = kwargs.get("config")
        if config is not None:
            kwargs.setdefault("max_batch_keys", config.max_batch_keys)
        super().__init__(parallel_config, **kwargs)
        if capacity is None:
            capacity = config.local_pool_size if config is not None else DEFAULT_CAPACITY
        if capacity <= 0:
            raise ValueError(f"local pool capacity must be positive, got {capacity}")
        self.capacity = int(capacity)
        self._lock = threading.Lock()
        self._objects: OrderedDict[str, np.ndarray] = OrderedDict()
        self._used = 0
        self.evictions = 0
        self._listeners: list[Callable[[list[str]], None]] = []

    # ------------------------------------------------------------ state
    @property
    def used_bytes(self) -> int:
        """Bytes held now."""
        with self._lock:
            return self._used

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)

    def stored_keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._objects)

    # ------------------------------------------------------------ Backend
    def register_buffer(self, ptrs: list[int], lengths: list[int]) -> None:
        """Nothing to register: copies are plain memory moves."""

    def exists(self, keys: list[str]) -> list[int]:
        with self._lock:
            out = []
            for key in keys:
                if key in self._objects:
                    self._objects.move_to_end(key)
                    out.append(1)
                else:
                    out.append(0)
            return out

    def put(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        self._check_lists(keys, addrs, sizes)
        out = []
        for key, parts, lens in zip(keys, addrs, sizes, strict=True):
            total = int(sum(lens))
            with self._lock:
                if key in self._objects:
                    # Same key, same content (keys are content hashes): keep the old copy.
                    self._objects.move_to_end(key)
                    out.append(0)
                    continue
            if total > self.capacity:
                logger.warning("local pool: object %s of %d bytes exceeds local_pool_size %d",
                               key, total, self.capacity)
                out.append(RC_TOO_LARGE)
                continue
            value = np.empty(total, dtype=np.uint8)
            dst = value.ctypes.data
            for addr, n in zip(parts, lens, strict=True):
                ctypes.memmove(dst, addr, n)
                dst += n
            with self._lock:
                evicted: list[str] = []
                if key not in self._objects:
                    self._objects[key] = value
                    self._used += total
                    evicted = self._evict_locked()
            self._notify(evicted)
            out.append(0)
        return out

    def get(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        self._check_lists(keys, addrs, sizes)
        out = []
        for key, parts, lens in zip(keys, addrs, sizes, strict=True):
            with self._lock:
                value = self._objects.get(key)
                if value is not None:
                    self._objects.move_to_end(key)
            if value is None:
                out.append(RC_NOT_FOUND)
                continue
            if int(sum(lens)) != value.nbytes:
                out.append(RC_SIZE_MISMATCH)
                continue
            src = value.ctypes.data
            for addr, n in zip(parts, lens, strict=True):
                ctypes.memmove(addr, src, n)
                src += n
            out.append(0)
        return out

    def remove(self, keys: list[str]) -> int:
        """Drop ``keys``; returns how many were present."""
        gone: list[str] = []
        with self._lock:
            for key in keys:
                value = self._objects.pop(key, None)
                if value is not None:
                    self._used -= value.nbytes
                    gone.append(key)
        self._notify(gone)
        return len(gone)

    def close(self) -> None:
        with self._lock:
            self._objects.clear()
            self._used = 0

    def describe_rc(self, rc: int) -> str:
        return _RC_TEXT.get(rc, super().describe_rc(rc))

    @classmethod
    def supports_eviction_events(cls) -> bool:
        return True

    def add_eviction_listener(self, listener: Callable[[list[str]], None]) -> None:
        """Call ``listener`` with the keys evicted or removed (outside the store's lock)."""
        self._listeners.append(listener)

    def _notify(self, keys: list[str]) -> None:
        if not keys:
            return
        for listener in list(self._listeners):
            try:
                listener(keys)
            except Exception:  # a listener must never break a put
                logger.warning("local pool: eviction listener failed", exc_info=True)

    def _evict_locked(self) -> list[str]:
        evicted = []
        while self._used > self.capacity and self._objects:
            key, value = self._objects.popitem(last=False)
            self._used -= value.nbytes
            self.evictions += 1
            evicted.append(key)
        return evicted

    def __repr__(self) -> str:
        return f"LocalBackend(capacity={self.capacity}, used={self._used})"
