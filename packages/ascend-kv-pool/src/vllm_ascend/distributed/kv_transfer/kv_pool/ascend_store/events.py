# SPDX-License-Identifier: Apache-2.0
"""KV cache events of the pool, worker side (no vLLM needed).

With ``kv_events_config.enable_kv_cache_events`` on, vLLM publishes, besides
its own device-cache events, the events a connector hands it. The pool
announces:

* a block it stored (:class:`StoredBlock`, published as ``BlockStored`` with
  ``medium="cpu"``, as vLLM-Ascend's ``AscendStoreKVEvents`` does) once this
  rank's share of the block is in the store: the whole block, or every layer
  of it with ``use_layerwise``; blocks the store already held are not
  announced again;
* a block the store dropped (:class:`RemovedBlock`, published as
  ``BlockRemoved``) where the backend reports evictions: the embedded
  ``local`` backend does; Mooncake Store and Memcache evict on their own and
  say nothing, so no removals are published for them.

With vLLM's hybrid KV cache manager on, the same tokens have a block in each KV cache group
(each its own object in the pool): an event names its group (``group``, published as
``group_idx``), and a sliding-window group announces only the blocks it saved.

A :class:`PoolEventLog` collects them between two polls of the worker
(``get_kv_connector_kv_cache_events``); the connector turns them into vLLM's
event types and vLLM's scheduler publishes the ones every writing rank
reported (see ``AscendStoreKVEvents``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from .jobs import BlockEventSpec

logger = logging.getLogger(__name__)

#: Partly stored layerwise blocks remembered at most (the oldest are forgotten).
MAX_PARTIAL_BLOCKS = 65536


@dataclass(frozen=True)
class StoredBlock:
    """This rank's share of one block is now in the pool.

    Attributes:
        block_hash: vLLM's hash of the block.
        parent_hash: vLLM's hash of the block before it (``None`` for a prompt's first block).
        token_ids: the block's token ids.
        block_size: tokens per block.
        lora_name: LoRA adapter name of the request that stored it.
        lora_id: LoRA adapter id of the request that stored it.
        group: vLLM's KV cache group of the block (``None``: one group).
    """

    block_hash: bytes
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None = None
    lora_id: int | None = None
    group: int | None = None


@dataclass(frozen=True)
class RemovedBlock:
    """The store dropped a block this rank had announced.

    Attributes:
        block_hash: vLLM's hash of the block.
        group: vLLM's KV cache group of the block (``None``: one group).
    """

    block_hash: bytes
    group: int | None = None


PoolEvent = StoredBlock | RemovedBlock


def stored_blocks(spec: BlockEventSpec, first: int, picked: Sequence[int],
                  block_size: int, group: int | None = None) -> list[StoredBlock | None]:
    """The events announcing blocks ``picked`` (indices into the job) of a save job.

    Args:
        spec: the job's event description.
        first: the job's first block index in the request.
        picked: the job's blocks this rank saves (indices into ``spec.block_hashes``).
        block_size: tokens per block.
        group: the job's KV cache group (hybrid KV cache manager), ``None`` with one group.

    Returns:
        One event per picked block, ``None`` for a block without a vLLM hash.
    """
    out: list[StoredBlock | None] = []
    for i in picked:
        block_hash = spec.block_hashes[i]
        if block_hash is None:
            out.append(None)
            continue
        parent = spec.block_hashes[i - 1] if i > 0 else spec.parent_hash
        tokens = tuple(spec.token_ids[i * block_size:(i + 1) * block_size])
        if len(tokens) != block_size:
            # a vLLM hash always covers a full block; fewer tokens means a bad plan
            logger.debug("no KV event for block %d: %d of %d tokens known", first + i,
                         len(tokens), block_size)
            out.append(None)
            continue
        out.append(StoredBlock(block_hash, parent, tokens, block_size, spec.lora_name,
                               spec.lora_id, group))
    return out


class PoolEventLog:
    """The events of one worker between two :meth:`take` calls (thread-safe).

    The send thread reports saves (:meth:`saved`), the backend reports evicted
    keys (:meth:`evicted`), the worker takes the events once a step.

    Args:
        num_layers: layers of the KV cache (a layerwise block is stored once all are).
        track_removals: remember which keys make up each announced block, so that
            an evicted key becomes a :class:`RemovedBlock` (backends that report
            evictions only).
    """

    def __init__(self, num_layers: int, *, track_removals: bool = False) -> None:
        self.num_layers = max(1, int(num_layers))
        self.track_removals = track_removals
        self._lock = threading.Lock()
        self._events: list[PoolEvent] = []
        # layerwise: block hash -> (layer -> key) stored so far, and whether any was written now
        self._partial: OrderedDict[bytes, tuple[dict[int, str], bool]] = OrderedDict()
        self._partial_keys: dict[str, bytes] = {}
        # removals: store key -> (block hash, group), (block hash, group) -> its keys
        # (announced blocks only; a hash has a block in each KV cache group)
        self._key_block: dict[str, tuple[bytes, int | None]] = {}
        self._block_keys: dict[tuple[bytes, int | None], set[str]] = {}
        # keys evicted during the save being reported that it had not announced yet
        self._evicted_unknown: set[str] = set()

    def saved(self, keys: Sequence[str], written: Sequence[bool], present: Sequence[bool],
              blocks: Sequence[StoredBlock | None], layer: int | None = None) -> None:
        """Report the outcome of one save (called right after its ``put``).

        Args:
            keys: the store keys of the save.
            written: per key, the save wrote it now.
            present: per key, the store holds it now (written now or before).
            blocks: per key, the event announcing its block (``None``: no event).
            layer: the layer of layerwise keys, ``None`` for whole blocks.
        """
        if not (len(keys) == len(written) == len(present) == len(blocks)):
            raise ValueError(f"{len(keys)} keys but {len(written)} written flags, "
                             f"{len(present)} present flags and {len(blocks)} events")
        with self._lock:
            for key, was_written, is_present, block in zip(keys, written, present, blocks,
                                                           strict=True):
                if block is None or not is_present or key in self._evicted_unknown:
                    continue  # (evicted: written, then pushed out by a later key of the save)
                if layer is None:
                    if was_written:
                        self._announce(block, [key])
                    continue
                self._layer_saved(block, key, layer, was_written)
            self._evicted_unknown.clear()

    def _layer_saved(self, block: StoredBlock, key: str, layer: int, was_written: bool) -> None:
        layers, any_written = self._partial.pop(block.block_hash, ({}, False))
        layers[layer] = key
        any_written = any_written or was_written
        if len(layers) < self.num_layers:
            self._partial[block.block_hash] = (layers, any_written)
            self._partial_keys[key] = block.block_hash
            while len(self._partial) > MAX_PARTIAL_BLOCKS:
                _hash, (old, _w) = self._partial.popitem(last=False)
                for old_key in old.values():
                    self._partial_keys.pop(old_key, None)
            return
        for layer_key in layers.values():
            self._partial_keys.pop(layer_key, None)
        if any_written:  # all layers present and at least one new: the block is new in the pool
            self._announce(block, list(layers.values()))

    def _announce(self, block: StoredBlock, keys: list[str]) -> None:
        self._events.append(block)
        if not self.track_removals:
            return
        ident = (block.block_hash, block.group)
        known = self._block_keys.setdefault(ident, set())
        for key in keys:
            known.add(key)
            self._key_block[key] = ident

    def evicted(self, keys: Sequence[str]) -> None:
        """The store dropped ``keys``: each announced block they belong to is removed."""
        with self._lock:
            for key in keys:
                partial = self._partial_keys.pop(key, None)
                if partial is not None:
                    # a layer of a block not complete yet: it cannot complete any more
                    layers, _w = self._partial.pop(partial, ({}, False))
                    for layer_key in layers.values():
                        self._partial_keys.pop(layer_key, None)
                    continue
                ident = self._key_block.pop(key, None)
                if ident is None:
                    self._evicted_unknown.add(key)
                    continue
                for other in self._block_keys.pop(ident, set()):
                    self._key_block.pop(other, None)
                self._events.append(RemovedBlock(*ident))

    def take(self) -> list[PoolEvent]:
        """The events since the last call, in order."""
        with self._lock:
            out, self._events = self._events, []
        return out

    @property
    def tracked_blocks(self) -> int:
        """Announced blocks whose removal would be reported."""
        with self._lock:
            return len(self._block_keys)
