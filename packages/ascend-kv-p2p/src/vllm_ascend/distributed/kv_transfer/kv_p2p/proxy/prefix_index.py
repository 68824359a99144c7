# SPDX-License-Identifier: Apache-2.0
"""What each prefill instance holds in its prefix cache, and the block hashes of a prompt.

The hashes are vLLM's (``vllm.v1.core.kv_cache_utils.hash_block_tokens``: the hash of
``(parent, tuple(block's tokens), None)`` with vLLM's own function of the instances'
``--prefix-caching-hash-algo`` from ``vllm.utils.hashing``, :func:`hash_function`), chained
from ``NONE_HASH = hash_fn(seed)`` exactly as ``init_none_hash`` derives it; the seed is the
instance's ``PYTHONHASHSEED`` (vLLM's fixed default seed for the sha256 algorithms when
unset). The chaining is done here and the hash module is loaded from its file: importing
vLLM's packages made the proxy's start take seconds more. The tests check every algorithm
against vLLM's scheduler; a running proxy checks the first block of each stored event
against its tokens (:meth:`.EventStream._verify`), and stops using an index whose hashes
differ.

Keys are the low 64 bits of a hash as an unsigned big-endian integer: that is what vLLM
publishes with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` (``maybe_convert_block_hash``), and
a bytes hash from an event is reduced the same way, so either setting of the instance works.

:class:`PrefixIndex` holds one instance's blocks; :class:`PoolIndex` those of a KV pool
several instances share (fed by the pool's events on their streams).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

_MASK = (1 << 64) - 1
#: Algorithms whose seed is random per process unless PYTHONHASHSEED is set (vLLM's rule).
NON_CRYPTO_ALGOS = ("xxhash", "xxhash_cbor")
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
#: vLLM's ``kv_cache_utils.DEFAULT_NONE_HASH_SEED``: the sha256 algorithms' seed when
#: ``PYTHONHASHSEED`` is unset.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
#: ``medium`` of the KV pool's events (``AscendStoreConnector``, as vLLM-Ascend's).
POOL_MEDIUM = "cpu"
#: Blocks a shared pool index remembers at most (the oldest stored are forgotten first).
POOL_MAX_BLOCKS = 1 << 20
#: Blocks one instance's index remembers at most (the oldest stored are forgotten first):
#: more than a device cache and an offload tier of millions of blocks hold; only a stream
#: whose removals never come (an instance that does not publish them) reaches it.
PREFIX_MAX_BLOCKS = 1 << 22
#: Share of the bound forgotten at once when it is passed (one pass over the oldest keys).
_EVICT_SHARE = 16


def hash_function(algo: str) -> Callable[[Any], bytes]:
    """vLLM's ``get_hash_fn_by_name(algo)`` (``vllm.utils.hashing``), taken from vLLM's own
    file without importing vLLM: that module needs only the standard library, ``cbor2`` and,
    optionally, ``xxhash``, where importing its package loads torch and most of vLLM
    (seconds of the proxy's start). Where that file cannot be loaded alone (another vLLM),
    vLLM is imported.

    Raises:
        ValueError: an unknown algorithm.
        ImportError: vLLM is not installed, or the algorithm's module (``xxhash``) is not.
    """
    if algo not in HASH_ALGOS:
        raise ValueError(f"unknown prefix-caching hash algo {algo!r}")
    return _vllm_hashing().get_hash_fn_by_name(algo)  # type: ignore[no-any-return]


@functools.cache
def _vllm_hashing() -> Any:
    """The module ``vllm.utils.hashing``, loaded from its file (no ``vllm`` package run)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the kv_aware policy computes vLLM's block hashes with vLLM's hash "
                          "functions and needs vLLM installed beside the proxy")
    for root in spec.submodule_search_locations:
        path = os.path.join(root, "utils", "hashing.py")
        if not os.path.isfile(path):
            continue
        file_spec = importlib.util.spec_from_file_location("_vakv_vllm_hashing", path)
        if file_spec is None or file_spec.loader is None:
            continue
        module = importlib.util.module_from_spec(file_spec)
        try:
            file_spec.loader.exec_module(module)
        except ImportError:  # it imports vLLM itself in this version
            break
        if callable(getattr(module, "get_hash_fn_by_name", None)):
            return module
    import vllm.utils.hashing

    return vllm.utils.hashing


def block_key(block_hash: bytes | int) -> int:
    """The index key of a block hash (bytes as vLLM computes it, or the int it publishes)."""
    if isinstance(block_hash, int):
        return block_hash & _MASK
    return int.from_bytes(block_hash, "big") & _MASK


class PrefixCacheHasher:
    """vLLM's prefix-cache block hashes of a token sequence.

    Args:
        algo: the instances' ``--prefix-caching-hash-algo`` (vLLM's default: ``sha256``).
        seed: their ``PYTHONHASHSEED``; None: this process's ``PYTHONHASHSEED``, else vLLM's
            fixed default seed (only valid for the sha256 algorithms: the xxhash ones use a
            random seed per process unless one is set, so they need an explicit seed).

    Raises:
        ValueError: an unknown algorithm, or an xxhash algorithm without a seed.
        ImportError: the algorithm's module is not installed (``cbor2``, ``xxhash``: vLLM's
            dependencies, there wherever its engines run).
    """

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        if algo not in HASH_ALGOS:
            raise ValueError(f"unknown prefix-caching hash algo {algo!r}; expected one of "
                             f"{HASH_ALGOS}")
        if seed is None:
            seed = os.environ.get("PYTHONHASHSEED")
        if seed is None:
            if algo in NON_CRYPTO_ALGOS:
                raise ValueError(f"prefix-caching hash algo {algo!r} uses a random seed per "
                                 "vLLM process unless PYTHONHASHSEED is set: set the same "
                                 "PYTHONHASHSEED on the instances and give it to the proxy "
                                 "(--kv-hash-seed)")
            seed = DEFAULT_NONE_HASH_SEED
        self.algo = algo
        self.seed = seed
        self._fn: Callable[[Any], bytes] = hash_function(algo)
        #: init_none_hash: NONE_HASH = hash_fn(seed); passed explicitly as the first parent
        self.none_hash: bytes = self._fn(seed)

    def hash_block(self, parent: bytes | None, tokens: Sequence[int]) -> bytes:
        """The hash of one full block after ``parent`` (None: the first block)."""
        return self._fn((parent or self.none_hash, tuple(tokens), None))

    def keys(self, tokens: Sequence[int], block_size: int, limit: int | None = None) -> list[int]:
        """Keys of the full blocks of ``tokens`` (at most ``limit`` of them)."""
        n = len(tokens) // block_size
        if limit is not None:
            n = min(n, limit)
        out: list[int] = []
        parent: bytes | None = None
        for i in range(n):
            parent = self.hash_block(parent, tokens[i * block_size:(i + 1) * block_size])
            out.append(block_key(parent))
        return out


class _KeyIndex:
    """What every block-key index answers: size, membership, the held prefix, alignment.

    Subclasses set ``_blocks`` (keyed by block key), ``_lock``, ``hash_mismatched`` and
    ``block_size_mismatch``.
    """

    _blocks: Mapping[int, Any]
    _lock: threading.Lock
    hash_mismatched: int
    block_size_mismatch: int | None

    def __len__(self) -> int:
        return len(self._blocks)

    def holds(self, key: int) -> bool:
        return key in self._blocks  # one dict lookup: atomic under the GIL

    def matched(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` are held (the prefix a request would hit)."""
        n = 0
        with self._lock:
            for k in keys:
                if k not in self._blocks:
                    break
                n += 1
        return n

    @property
    def aligned(self) -> bool:
        """False once a stored block's hash disagreed with the one computed here, or its
        block size with the configured one: the proxy's hash settings are not the
        instance's (or the pool's), and its predictions would be wrong."""
        return self.hash_mismatched == 0 and self.block_size_mismatch is None


class PrefixIndex(_KeyIndex):
    """The block keys one instance holds, fed by its KV events (thread-safe).

    A block may be held on several media (``GPU``, ``CPU`` from an offload tier): it stays
    in the index until removed from all of them.

    Bounded: past ``max_blocks`` keys the oldest stored ones (a 16th of the bound, in one
    pass) are forgotten and counted in ``evicted``; a forgotten key only under-predicts.
    None: unbounded (benchmarks of the structure alone).
    """

    def __init__(self, block_size: int | None = None,
                 max_blocks: int | None = PREFIX_MAX_BLOCKS) -> None:
        #: configured block size; None: learned from the first BlockStored
        self.block_size = block_size
        self.max_blocks = None if max_blocks is None else max(1, int(max_blocks))
        #: key -> the media holding it, one bit each (a small int: no set a block)
        self._blocks: dict[int, int] = {}
        self._media: dict[str, int] = {}
        self._lock = threading.Lock()
        self.stored = 0
        self.removed = 0
        self.cleared = 0
        self.evicted = 0
        #: hash checks of stored blocks: recomputed here from the event's tokens
        self.hash_verified = 0
        self.hash_mismatched = 0
        #: the event's block size differs from the configured one
        self.block_size_mismatch: int | None = None

    def store(self, keys: Sequence[int], medium: str | None, block_size: int | None) -> None:
        if block_size:
            if self.block_size is None:
                self.block_size = block_size
            elif block_size != self.block_size:
                self.block_size_mismatch = block_size
        where = medium or "GPU"
        with self._lock:
            bit = self._media.get(where)
            if bit is None:
                bit = self._media[where] = 1 << len(self._media)
            blocks = self._blocks
            for k in keys:
                blocks[k] = blocks.get(k, 0) | bit
            self.stored += len(keys)
            if self.max_blocks is not None and len(self._blocks) > self.max_blocks:
                self._evict()

    def _evict(self) -> None:
        """Forget the oldest stored keys down to the bound less a 16th (lock held): in one
        pass, as deleting a dict's first key one at a time rescans the deleted slots."""
        assert self.max_blocks is not None
        blocks = self._blocks
        n = len(blocks) - self.max_blocks + self.max_blocks // _EVICT_SHARE
        for k in list(itertools.islice(iter(blocks), n)):
            del blocks[k]
        self.evicted += n

    def remove(self, keys: Sequence[int], medium: str | None) -> None:
        with self._lock:
            bit = self._media.get(medium or "GPU")
            if bit is not None:  # else: no block was ever stored there
                blocks = self._blocks
                for k in keys:
                    media = blocks.get(k)
                    if media is None:
                        continue
                    media &= ~bit
                    if media:
                        blocks[k] = media
                    else:
                        del blocks[k]
            self.removed += len(keys)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()
            self.cleared += 1

    def as_dict(self) -> dict[str, Any]:
        return {"blocks": len(self), "max_blocks": self.max_blocks,
                "block_size": self.block_size, "stored": self.stored,
                "removed": self.removed, "cleared": self.cleared, "evicted": self.evicted,
                "hash_verified": self.hash_verified, "hash_mismatched": self.hash_mismatched,
                "block_size_mismatch": self.block_size_mismatch, "aligned": self.aligned}


class PoolIndex(_KeyIndex):
    """The block keys a KV pool shared by several instances holds (thread-safe).

    Fed by the pool's events (``medium`` ``cpu``) on the event streams of every instance
    attached to the pool: the instance that wrote a block announces it, the one whose
    backend reports the eviction removes it. Each key remembers which streams announced
    it, so that a stream that lost events (gap, restart, garbled batch) makes the index
    :meth:`forget` what that stream told, not the others' knowledge. Bounded: Mooncake
    Store and Memcache evict without saying so, so the index keeps the ``max_blocks``
    most recently stored keys (a forgotten key only under-predicts).
    """

    def __init__(self, name: str, block_size: int | None = None,
                 max_blocks: int = POOL_MAX_BLOCKS) -> None:
        self.name = name
        self.block_size = block_size
        self.max_blocks = max(1, int(max_blocks))
        #: key -> the streams that announced it, one bit each (a small int: no allocation)
        self._blocks: OrderedDict[int, int] = OrderedDict()
        self._bits: dict[str, int] = {}
        self._lock = threading.Lock()
        self.stored = 0
        self.removed = 0
        self.forgotten = 0
        self.evicted = 0
        self.hash_verified = 0
        self.hash_mismatched = 0
        self.block_size_mismatch: int | None = None

    def store(self, keys: Sequence[int], owner: str, block_size: int | None) -> None:
        """``owner``'s stream announced ``keys`` stored in the pool."""
        if block_size:
            if self.block_size is None:
                self.block_size = block_size
            elif block_size != self.block_size:
                self.block_size_mismatch = block_size
        with self._lock:
            bit = self._bits.get(owner)
            if bit is None:
                bit = self._bits[owner] = 1 << len(self._bits)
            blocks = self._blocks
            for k in keys:
                owners = blocks.get(k)
                if owners is None:
                    blocks[k] = bit
                else:
                    blocks[k] = owners | bit
                    blocks.move_to_end(k)
            self.stored += len(keys)
            while len(self._blocks) > self.max_blocks:
                self._blocks.popitem(last=False)
                self.evicted += 1

    def remove(self, keys: Sequence[int]) -> None:
        """The pool dropped ``keys`` (whoever announced them)."""
        with self._lock:
            for k in keys:
                self._blocks.pop(k, None)
            self.removed += len(keys)

    def forget(self, owner: str) -> None:
        """Drop what ``owner``'s stream announced (its removals may have been lost)."""
        with self._lock:
            bit = self._bits.get(owner)
            if bit is None:
                return
            blocks = self._blocks
            shared = [k for k, owners in blocks.items() if owners & bit and owners != bit]
            gone = [k for k, owners in blocks.items() if owners == bit]
            for k in shared:
                blocks[k] &= ~bit  # an existing key: its place in the order stays
            for k in gone:
                del blocks[k]
            self.forgotten += len(gone)

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "blocks": len(self), "max_blocks": self.max_blocks,
                "block_size": self.block_size, "stored": self.stored,
                "removed": self.removed, "forgotten": self.forgotten,
                "evicted": self.evicted, "hash_verified": self.hash_verified,
                "hash_mismatched": self.hash_mismatched,
                "block_size_mismatch": self.block_size_mismatch, "aligned": self.aligned}
