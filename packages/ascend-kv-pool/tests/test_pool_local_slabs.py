# SPDX-License-Identifier: Apache-2.0
"""Slab allocation of the embedded ``local`` backend: a batch put faults in chunks sized to
the batch, a lone object of a new size costs one slot, and freed slots are reused."""

from __future__ import annotations

import numpy as np

from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.local_backend import (
    CHUNK_BYTES,
    LocalBackend,
    _Slabs,
)

MIB = 1 << 20


def _chunks(views: list[np.ndarray]) -> set[int]:
    return {id(v.base) for v in views}


def test_a_batch_is_allocated_in_chunks_sized_to_it() -> None:
    slabs = _Slabs(capacity=1 << 30)
    views = slabs.alloc(MIB, 100)
    assert len(views) == 100 and all(v.nbytes == MIB for v in views)
    # 100 MiB in chunks of at most 64 MiB: two chunks, not a doubling series of six
    assert len(_chunks(views)) == 2
    assert all(v.base.nbytes <= CHUNK_BYTES for v in views)
    addrs = sorted(v.ctypes.data for v in views)
    assert all(b - a >= MIB for a, b in zip(addrs, addrs[1:], strict=False))  # no overlap


def test_a_lone_object_of_a_new_size_costs_one_slot_then_chunks_grow() -> None:
    slabs = _Slabs(capacity=1 << 30)
    (first,) = slabs.alloc(3 * 1000)
    assert first.base.nbytes == 3000
    (second,) = slabs.alloc(3000)
    # the second of a size gets a chunk of at least 4 MiB; its spare slots are free
    assert second.base.nbytes >= 4 * MIB - 3000
    spare = slabs.alloc(3000, 5)
    assert _chunks(spare) == _chunks([second])


def test_freed_slots_are_reused_before_new_memory() -> None:
    slabs = _Slabs(capacity=1 << 30)
    views = slabs.alloc(MIB, 8)
    for v in views[:3]:
        slabs.release(v)
    again = slabs.alloc(MIB, 3)
    assert {v.ctypes.data for v in again} == {v.ctypes.data for v in views[:3]}


def test_a_batch_put_of_mixed_sizes_round_trips_in_key_order() -> None:
    rng = np.random.default_rng(1)
    sizes = [MIB, 4096, MIB, 4096, 3 * 4096] * 10
    src = [rng.integers(0, 255, s, dtype=np.uint8) for s in sizes]
    dst = [np.zeros_like(a) for a in src]
    keys = [f"k{i}" for i in range(len(src))]
    pool = LocalBackend(capacity=1 << 30, copy_threads=2)
    try:
        assert pool.put(keys, [[a.ctypes.data] for a in src], [[a.nbytes] for a in src]) \
            == [0] * len(keys)
        assert pool.stored_keys() == keys  # inserted in the order put
        assert pool.get(keys, [[a.ctypes.data] for a in dst], [[a.nbytes] for a in dst]) \
            == [0] * len(keys)
        assert all(np.array_equal(a, b) for a, b in zip(src, dst, strict=True))
    finally:
        pool.close()
