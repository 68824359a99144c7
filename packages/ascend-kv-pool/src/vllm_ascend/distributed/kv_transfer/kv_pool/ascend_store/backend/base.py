# SPDX-License-Identifier: Apache-2.0
"""The ``Backend`` ABC: what the pool needs from a store.

A backend stores *objects* under string keys. One object is one pool block
(or one layer of one block with ``use_layerwise``) and is made of several
memory ranges: the block's slice of every K/V region of the KV cache. So
``put``/``get`` take, per key, a list of addresses and a list of sizes, and
the object is their concatenation (Mooncake's ``batch_put_from_multi_buffers``,
memcache's ``batch_put_from_layers``).

Return codes are per key: ``0`` success, a negative number the store's error
code. :meth:`exists` answers ``1`` (present), ``0`` (absent) or negative (error).
A store that cannot be reached at all raises :class:`BackendUnavailableError`,
which the worker turns into misses and counted dropped saves.

This module needs neither vLLM, Mooncake nor memcache_hybrid.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Generic error code for a failure a store did not give a code for.
RC_ERROR = -1


def chunks(items: Sequence[T], size: int) -> Iterator[tuple[int, Sequence[T]]]:
    """``(start, items[start:start + size])`` for every chunk of ``items``."""
    if size <= 0:
        raise ValueError(f"chunk size must be positive, got {size}")
    for start in range(0, len(items), size):
        yield start, items[start:start + size]


class Backend(ABC):
    """A key-value store of KV blocks.

    Args:
        parallel_config: vLLM's ``ParallelConfig`` (upstream signature), or ``None``.
        **kwargs: backend options (the pool worker passes ``config``, the
            :class:`~vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config.AscendStoreConfig`,
            and ``device_id``).
    """

    #: Name used in the ``backend`` config key.
    name: ClassVar[str] = ""
    #: The store is seen by every process (Mooncake, memcache); ``local`` is per process.
    shared_across_processes: ClassVar[bool] = True
    #: ``put``/``get`` addresses must be host memory (the worker stages device blocks).
    host_memory_only: ClassVar[bool] = False

    def __init__(self, parallel_config: Any = None, **kwargs: Any) -> None:
        self.parallel_config = parallel_config
        self.max_batch_keys = int(kwargs.get("max_batch_keys", 256))

    def set_device(self) -> None:
        """Make the worker's device current for the store's threads (no-op by default)."""
        return None

    @abstractmethod
    def register_buffer(self, ptrs: list[int], lengths: list[int]) -> None:
        """Register memory that ``put``/``get`` will read and write (the KV cache)."""

    @abstractmethod
    def exists(self, keys: list[str]) -> list[int]:
        """``1`` present, ``0`` absent, negative on error, for every key."""

    @abstractmethod
    def put(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """Store each key's object, read from its ranges; per-key return codes."""

    @abstractmethod
    def get(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        """Copy each key's object into its ranges; per-key return codes (0 = all bytes)."""

    def close(self) -> None:
        """Release the store connection (idempotent)."""
        return None

    # ------------------------------------------------------------ optional: eviction events
    @classmethod
    def supports_eviction_events(cls) -> bool:
        """True when the backend tells :meth:`add_eviction_listener` listeners what it drops.

        Only then can the pool publish ``BlockRemoved`` KV cache events; stores that
        evict on their own (Mooncake Store, Memcache) do not report it.
        """
        return False

    def add_eviction_listener(self, listener: Callable[[list[str]], None]) -> None:
        """Call ``listener`` with the keys the store drops (evictions and removals).

        Raises:
            NotImplementedError: the backend does not report evictions
                (see :meth:`supports_eviction_events`).
        """
        raise NotImplementedError(f"{type(self).__name__} does not support eviction events")

    def describe_rc(self, rc: int) -> str:
        """Human-readable meaning of a return code."""
        return "ok" if rc == 0 else f"error {rc}"

    @staticmethod
    def _check_lists(keys: Sequence[str], addrs: Sequence[Sequence[int]],
                     sizes: Sequence[Sequence[int]]) -> None:
        if not (len(keys) == len(addrs) == len(sizes)):
            raise ValueError(f"{len(keys)} keys but {len(addrs)} address lists and "
                             f"{len(sizes)} size lists")
        for key, a, s in zip(keys, addrs, sizes, strict=True):
            if len(a) != len(s):
                raise ValueError(f"key {key!r}: {len(a)} addresses but {len(s)} sizes")
            if any(n < 0 for n in s):
                raise ValueError(f"key {key!r}: a negative size in {list(s)}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
