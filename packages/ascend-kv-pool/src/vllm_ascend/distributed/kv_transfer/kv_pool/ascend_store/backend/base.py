# SPDX-License-Identifier: Apache-2.0
"""The ``Backend`` ABC (what the pool needs from a store) and the chunked batch loop.

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

The pool worker builds its backend with :meth:`Backend.create`, from the pool's
config and the worker's :class:`~..context.PoolContext`; a backend that needs
more than the config (memcache's device id) overrides it. :class:`ChunkedBackend`
is the batch loop of the stores whose batch calls take at most
``max_batch_keys`` keys (Mooncake Store, memcache): a subclass gives the call for
one chunk.

This module needs neither vLLM, Mooncake nor memcache_hybrid.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ..errors import BackendError

if TYPE_CHECKING:
    from ..context import PoolContext

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

    @classmethod
    def create(cls, cfg: Any, ctx: PoolContext, *, parallel_config: Any = None,
               host_memory: bool = True) -> Backend:
        """The backend the pool worker uses (``store_worker.create_backend`` calls this).

        Args:
            cfg: the pool's ``AscendStoreConfig`` (typed ``Any``: the config module
                imports the registry, which names this class).
            ctx: the worker's ranks and model.
            parallel_config: vLLM's parallel config (upstream's first argument).
            host_memory: the KV cache the backend reads and writes is in host memory.

        The default passes ``config=cfg``; override it for what a store needs besides.
        """
        return cls(parallel_config, config=cfg)

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


#: The call for one chunk of a put or get: ``(keys, addrs, sizes) -> per-key codes``.
ChunkCall = Callable[[list[str], list[list[int]], list[list[int]]], Sequence[int]]


class ChunkedBackend(Backend):
    """A backend over a store whose batch calls take at most ``max_batch_keys`` keys.

    :meth:`exists`, :meth:`put` and :meth:`get` split the keys into chunks of
    ``max_batch_keys``, in order, call the store once per chunk through
    :meth:`exists_chunk`, :meth:`put_chunk` and :meth:`get_chunk`, and join the
    per-key codes. A chunk call that raises ends the batch (later chunks are not
    sent) and the exception reaches the caller; one that answers for another number
    of keys than it was given is a :class:`BackendError`.
    """

    @abstractmethod
    def exists_chunk(self, keys: list[str]) -> Sequence[int]:
        """The store's answer for one chunk (``1``/``0``/negative per key)."""

    @abstractmethod
    def put_chunk(self, keys: list[str], addrs: list[list[int]],
                  sizes: list[list[int]]) -> Sequence[int]:
        """Store one chunk; per-key return codes."""

    @abstractmethod
    def get_chunk(self, keys: list[str], addrs: list[list[int]],
                  sizes: list[list[int]]) -> Sequence[int]:
        """Load one chunk; per-key return codes (0 = all bytes)."""

    def exists(self, keys: list[str]) -> list[int]:
        return self._each_chunk("exists", keys, [], [], lambda k, _a, _s: self.exists_chunk(k))

    def put(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        self._check_lists(keys, addrs, sizes)
        return self._each_chunk("put", keys, addrs, sizes, self.put_chunk)

    def get(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        self._check_lists(keys, addrs, sizes)
        return self._each_chunk("get", keys, addrs, sizes, self.get_chunk)

    def _each_chunk(self, op: str, keys: Sequence[str], addrs: list[list[int]],
                    sizes: list[list[int]], call: ChunkCall) -> list[int]:
        out: list[int] = []
        for start, part in chunks(keys, self.max_batch_keys):
            end = start + len(part)
            codes = call(list(part), addrs[start:end], sizes[start:end])
            if len(codes) != len(part):
                raise BackendError(f"{self.name} returned {len(codes)} results for "
                                   f"{len(part)} keys", backend=self.name, op=op)
            out.extend(int(c) for c in codes)
        return out
