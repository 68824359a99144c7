# SPDX-License-Identifier: Apache-2.0
"""Slab allocation of the embedded ``local`` backend: a batch put faults in chunks sized to
the batch, a lone object of a new size costs one slot, freed slots are reused, and a
batch's slots are laid out region by region, so consecutive blocks move in one run."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import (
    local_backend,
    local_memory,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.local_backend import (
    LocalBackend,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.local_memory import (
    CHUNK_BYTES,
    Slabs,
    coalesce_moves,
    split_shares,
)

MIB = 1 << 20


def _chunks(slots: list[tuple[int, int, np.ndarray]]) -> set[int]:
    return {id(chunk) for _a, _n, chunk in slots}


def test_a_batch_is_allocated_in_chunks_sized_to_it() -> None:
    slabs = Slabs(capacity=1 << 30)
    views = slabs.alloc(MIB, 100)
    assert len(views) == 100 and all(n == MIB for _a, n, _c in views)
    # every slot lies inside its chunk
    assert all(c.ctypes.data <= a <= c.ctypes.data + c.nbytes - n for a, n, c in views)
    # 100 MiB in chunks of at most 64 MiB: two chunks, not a doubling series of six
    assert len(_chunks(views)) == 2
    assert all(c.nbytes <= CHUNK_BYTES for _a, _n, c in views)
    addrs = sorted(a for a, _n, _c in views)
    assert all(b - a >= MIB for a, b in zip(addrs, addrs[1:], strict=False))  # no overlap


def test_a_lone_object_of_a_new_size_costs_one_slot_then_chunks_grow() -> None:
    slabs = Slabs(capacity=1 << 30)
    ((_a, _n, first),) = slabs.alloc(3 * 1000)
    assert first.nbytes == 3000
    (second,) = slabs.alloc(3000)
    # the second of a size gets a chunk of at least 4 MiB; its spare slots are free
    assert second[2].nbytes >= 4 * MIB - 3000
    spare = slabs.alloc(3000, 5)
    assert _chunks(spare) == _chunks([second])


def test_freed_slots_are_reused_before_new_memory() -> None:
    slabs = Slabs(capacity=1 << 30)
    views = slabs.alloc(MIB, 8)
    for v in views[:3]:
        slabs.release(v)
    again = slabs.alloc(MIB, 3)
    assert {a for a, _n, _c in again} == {a for a, _n, _c in views[:3]}


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


def test_moves_contiguous_on_both_sides_merge_and_shares_split_them_evenly() -> None:
    moves = [(1000, 5000, 10), (1010, 5010, 10), (1020, 6000, 10), (2000, 6010, 5)]
    assert coalesce_moves(moves) == [(1000, 5000, 20), (1020, 6000, 10), (2000, 6010, 5)]
    one = [(0, 1 << 30, 10 * MIB)]
    shares = split_shares(one, 10 * MIB, 3)
    assert len(shares) == 3
    sizes = [sum(n for _d, _s, n in share) for share in shares]
    assert sum(sizes) == 10 * MIB and max(sizes) - min(sizes) <= 2
    # the pieces continue each other on both sides, in order
    flat = [m for share in shares for m in share]
    assert all(a[0] + a[2] == b[0] and a[1] + a[2] == b[1]
               for a, b in zip(flat, flat[1:], strict=False))


def _regions(parts: int, blocks: int, part: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (parts, blocks * part), dtype=np.uint8)


def _ranges(arr: np.ndarray, blocks: list[int], part: int) -> list[list[int]]:
    return [[int(arr[p].ctypes.data) + b * part for p in range(arr.shape[0])] for b in blocks]


def test_a_batch_of_consecutive_blocks_moves_one_run_per_region_even_after_evictions(
        monkeypatch: pytest.MonkeyPatch) -> None:
    parts, part, n = 4, 64 << 10, 16
    src = _regions(parts, 6 * n, part, 2)
    # a put of a quarter of a small pool is one batch
    pool = LocalBackend(capacity=4 * n * parts * part, copy_threads=1)
    calls: list[int] = []
    real = local_memory._memmove

    def recording(d: int, s: int, k: int) -> None:
        calls.append(k)
        real(d, s, k)

    monkeypatch.setattr(local_memory, "_memmove", recording)
    try:
        for r in range(6):  # the fifth and sixth puts evict and reuse the slots
            blocks = list(range(r * n, (r + 1) * n))
            calls.clear()
            assert pool.put([f"m@h@{b}" for b in blocks], _ranges(src, blocks, part),
                            [[part] * parts] * n) == [0] * n
            assert calls == [n * part] * parts, (r, calls)
        assert pool.evictions == 2 * n
        dst = np.zeros_like(src)
        calls.clear()
        blocks = list(range(5 * n, 6 * n))
        assert pool.get([f"m@h@{b}" for b in blocks], _ranges(dst, blocks, part),
                        [[part] * parts] * n) == [0] * n
        assert calls == [n * part] * parts
        assert np.array_equal(dst[:, 5 * n * part:], src[:, 5 * n * part:])
    finally:
        pool.close()


def test_a_get_may_cut_an_object_into_other_ranges_than_its_put() -> None:
    rng = np.random.default_rng(3)
    pieces = [rng.integers(0, 255, n, dtype=np.uint8) for n in (4096, 0, 8192, 100)]
    whole = np.concatenate(pieces)
    pool = LocalBackend(capacity=1 << 20)
    try:
        assert pool.put(["k"], [[int(a.ctypes.data) for a in pieces]],
                        [[a.nbytes for a in pieces]]) == [0]
        out = np.zeros_like(whole)
        cuts = [0, 1000, 1000, 9000, whole.nbytes]
        assert pool.get(["k"], [[int(out.ctypes.data) + c for c in cuts[:-1]]],
                        [[b - a for a, b in zip(cuts, cuts[1:], strict=False)]]) == [0]
        assert np.array_equal(out, whole)
    finally:
        pool.close()


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_touched_memory_is_resident_before_any_copy() -> None:
    before = _resident_bytes()
    untouched = np.empty(64 * MIB, dtype=np.uint8)
    assert _resident_bytes() - before < 16 * MIB  # np.empty alone faults nothing in
    del untouched
    before = _resident_bytes()
    arena = local_memory.touched_memory(64 * MIB, threads=2)
    assert arena.nbytes == 64 * MIB
    assert arena.ctypes.data % local_memory.HUGE_PAGE_BYTES == 0
    assert _resident_bytes() - before >= 48 * MIB  # every page written, by two threads


def test_a_prefaulted_pool_carves_its_chunks_from_the_touched_arena_then_fresh_memory() -> None:
    slabs = Slabs(capacity=16 * MIB, prefault=True)
    assert slabs.arena_bytes == 16 * MIB + CHUNK_BYTES
    arena = slabs._arena
    assert arena is not None
    lo, hi = arena.ctypes.data, arena.ctypes.data + arena.nbytes
    views = slabs.alloc(MIB, 80)  # 80 MiB: the arena holds 80, then fresh memory
    inside = [v for v in views if lo <= v[0] and v[0] + v[1] <= hi]
    assert len(inside) == 80
    assert all(v[0] % local_memory.ALIGN_BYTES == 0 for v in views)
    more = slabs.alloc(MIB, 4)
    assert all(not lo <= a < hi for a, _n, _c in more)  # the arena is used up
    # released arena slots are all kept for reuse (letting them go would free nothing),
    # past the free list's usual bound of an eighth of the capacity (here 64 MiB)
    for v in views:
        slabs.release(v)
    again = slabs.alloc(MIB, 80)
    assert {a for a, _n, _c in again} == {a for a, _n, _c in views}
    slabs.clear()
    assert slabs.arena_bytes == 0


def test_local_pool_prefault_from_the_config_round_trips_in_the_touched_memory() -> None:
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config import (
        AscendStoreConfig,
    )

    cfg = AscendStoreConfig.from_dict({"local_pool_size": "8MB", "local_pool_prefault": "true"})
    assert cfg.local_pool_prefault is True
    assert AscendStoreConfig.from_dict({}).local_pool_prefault is False
    pool = LocalBackend(config=cfg)
    try:
        arena = pool._slabs._arena
        assert arena is not None and arena.nbytes == 8 * MIB + CHUNK_BYTES
        rng = np.random.default_rng(2)
        src = [rng.integers(0, 255, MIB, dtype=np.uint8) for _ in range(12)]
        keys = [f"k{i}" for i in range(12)]
        assert pool.put(keys, [[a.ctypes.data] for a in src], [[MIB]] * 12) == [0] * 12
        kept = pool.stored_keys()
        assert len(kept) == 8 and pool.evictions == 4  # bounded by the capacity still
        lo = arena.ctypes.data
        assert all(lo <= p[0] < lo + arena.nbytes
                   for key in kept for p in pool._objects[key].parts)
        dst = [np.zeros(MIB, dtype=np.uint8) for _ in kept]
        assert pool.get(kept, [[a.ctypes.data] for a in dst], [[MIB]] * len(kept)) \
            == [0] * len(kept)
        assert all(np.array_equal(src[keys.index(k)], d) for k, d in zip(kept, dst, strict=True))
    finally:
        pool.close()
    assert pool._slabs.arena_bytes == 0  # closing lets the memory go


def test_a_prefault_larger_than_the_available_memory_is_refused_before_touching_any(
        monkeypatch: pytest.MonkeyPatch) -> None:
    touched: list[int] = []
    monkeypatch.setattr(local_backend, "available_host_memory", lambda: 256 * MIB)
    monkeypatch.setattr(local_memory, "touched_memory",
                        lambda n, threads=1, touched_=None: touched.append(n) or np.empty(n, dtype=np.uint8))
    with pytest.raises(ValueError, match="local_pool_prefault: local_pool_size of 1024 MiB"):
        LocalBackend(capacity=1 << 30, prefault=True)
    assert touched == []
    LocalBackend(capacity=1 << 30, prefault=False).close()  # without it nothing is checked
    pool = LocalBackend(capacity=128 * MIB, prefault=True)  # 128 + 64 MiB fit in 256
    pool.close()
    assert touched == [128 * MIB + CHUNK_BYTES]


def test_a_prefault_of_every_worker_on_the_host_beyond_its_memory_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    touched: list[int] = []
    monkeypatch.setattr(local_backend, "available_host_memory", lambda: 4096 * MIB)
    monkeypatch.setattr(local_backend, "total_host_memory", lambda: 1024 * MIB)
    monkeypatch.setattr(local_memory, "touched_memory",
                        lambda n, threads=1, touched_=None: touched.append(n) or np.empty(n, dtype=np.uint8))
    # 8 workers (vLLM's local_world_size) x (128 + 64) MiB > 1024 MiB in all
    with pytest.raises(ValueError, match="8 workers on this host keep a pool each"):
        LocalBackend(SimpleNamespace(local_world_size=8), capacity=128 * MIB, prefault=True)
    with pytest.raises(ValueError, match="8 workers"):
        LocalBackend(capacity=128 * MIB, prefault=True, host_workers=8)
    assert touched == []
    LocalBackend(capacity=128 * MIB, prefault=True, host_workers=4).close()  # 768 MiB fit
    LocalBackend(SimpleNamespace(local_world_size=8), capacity=128 * MIB).close()  # no prefault
    assert touched == [128 * MIB + CHUNK_BYTES]


def test_a_prefault_counts_what_other_workers_are_touching_now(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Workers starting side by side: one's claim not touched yet is not in the memory
    available, so the next one subtracts it (core.host_memory)."""
    import json

    from vllm_ascend.distributed.kv_transfer.core import host_memory

    ledger = tmp_path / "claims.json"
    monkeypatch.setenv(host_memory.LEDGER_ENV, str(ledger))
    monkeypatch.setattr(local_backend, "available_host_memory", lambda: 256 * MIB)
    ledger.write_text(json.dumps({"1:": 100 * MIB}))  # pid 1 lives: a worker touching 100 MiB
    with pytest.raises(ValueError, match="less the 100 MiB other workers of this host"):
        LocalBackend(capacity=128 * MIB, prefault=True)  # 192 MiB > 256 - 100
    reported: list[int] = []
    real = local_memory.touched_memory
    monkeypatch.setattr(local_memory, "touched_memory", lambda n, threads=1, touched=None: (
        real(n, threads, lambda k: (reported.append(k), touched and touched(k)))))
    pool = LocalBackend(capacity=64 * MIB, prefault=True, copy_threads=2)  # 128 MiB fit
    pool.close()
    assert sum(reported) == 128 * MIB and len(reported) == 2  # a chunk at a time
    assert json.loads(ledger.read_text()) == {"1:": 100 * MIB}  # its own claim dropped
