# SPDX-License-Identifier: Apache-2.0
"""Eviction policies of the local backend: order on small hand-made examples, and the
backend honouring the ``eviction_policy`` option, pins and learned chains."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from vllm_ascend.distributed.kv_transfer.core.device import usable_cpus
from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import (
    local_backend,
    local_memory,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.eviction import (
    DEFAULT_POLICY,
    POLICY_NAMES,
    BeladyOracle,
    EvictionPolicy,
    LRUPolicy,
    PrefixLRUPolicy,
    PrefixS3FIFOPolicy,
    S3FIFOPolicy,
    make_policy,
    uses_by_key,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.local_backend import (
    LocalBackend,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config import AscendStoreConfig


def drain(policy: EvictionPolicy, pinned: tuple[str, ...] = ()) -> list[str]:
    out = []
    while (key := policy.victim(pinned)) is not None:
        out.append(key)
    return out


# ---------------------------------------------------------------------- policies
def test_lru_evicts_least_recently_used_and_skips_pinned() -> None:
    p = LRUPolicy(100)
    for k in "abcd":
        p.insert(k, 1)
    p.access("a")
    assert p.victim(pinned=("b",)) == "c"
    p.remove("d")
    assert drain(p) == ["b", "a"]


def test_prefix_lru_evicts_leaves_before_their_parents() -> None:
    p = PrefixLRUPolicy(100)
    p.insert("a", 1)
    p.insert("b", 1, parent="a")
    p.insert("c", 1, parent="b")
    p.insert("x", 1)
    p.access("a")  # a is the most recent: its descendants go before it, x after them
    assert drain(p) == ["c", "b", "x", "a"]


def test_prefix_lru_parent_is_a_leaf_again_once_its_children_leave() -> None:
    p = PrefixLRUPolicy(100)
    p.insert("a", 1)
    p.insert("b", 1, parent="a")
    p.insert("z", 1)
    p.remove("b")
    assert drain(p) == ["a", "z"]
    # a pinned leaf is skipped; with every key pinned there is no victim
    p.insert("a", 1)
    p.insert("b", 1, parent="a")
    assert p.victim(pinned=("b",)) is None or p.victim(pinned=("b",)) != "b"


def test_prefix_lru_survives_a_cycle_of_links() -> None:
    p = PrefixLRUPolicy(100)
    p.insert("a", 1, parent="b")
    p.insert("b", 1, parent="a")
    assert sorted(drain(p)) == ["a", "b"]


def test_s3fifo_one_off_scan_does_not_push_out_a_reused_key() -> None:
    p = S3FIFOPolicy(capacity=10, small_fraction=0.3)
    p.insert("hot", 1)
    p.access("hot")
    evicted = []
    for i in range(20):  # a scan of one-off keys, one eviction per insert beyond 10
        p.insert(f"s{i}", 1)
        if len(p) > 10:
            evicted.append(p.victim())
    assert "hot" not in evicted and len(evicted) == 11
    assert evicted[:3] == ["s0", "s1", "s2"]  # one-offs leave in FIFO order


def test_s3fifo_ghost_key_comes_back_into_main() -> None:
    p = S3FIFOPolicy(capacity=4, small_fraction=0.5)
    for k in "abc":
        p.insert(k, 1)
    assert p.victim() == "a"  # cold: to the ghost list
    p.insert("a", 1)  # seen again: straight into main
    p.insert("d", 1)
    # small holds b, c, d (over its share): b goes, then small is within its share and a,
    # alone in main, goes before c and d (back in small, a would have left after c)
    assert drain(p) == ["b", "a", "c", "d"]


def test_prefix_s3fifo_keeps_parents_until_their_children_leave() -> None:
    p = PrefixS3FIFOPolicy(capacity=100, small_fraction=0.1)
    p.insert("a", 1)
    p.insert("b", 1, parent="a")
    p.insert("c", 1, parent="b")
    p.insert("x", 1)
    # a and b wait outside the queues while they have children: the chain peels from its tip
    assert drain(p) == ["c", "b", "a", "x"]


def test_prefix_s3fifo_parent_rejoins_its_fifo_when_its_last_child_leaves() -> None:
    p = PrefixS3FIFOPolicy(capacity=100, small_fraction=0.1)
    p.insert("a", 1)
    p.insert("b", 1, parent="a")
    p.insert("y", 1)
    p.access("a")
    assert p.victim() == "b"  # the cold tip; a re-enters the small FIFO at its eviction end
    assert list(p._small) == ["a", "y"]
    assert p.victim() == "a"  # read: promoted to main, where (not read since) it goes
    assert p.victim() == "y"


def test_prefix_s3fifo_pinned_and_removed_keys() -> None:
    p = PrefixS3FIFOPolicy(capacity=100)
    p.insert("a", 1)
    p.insert("b", 1, parent="a")
    # b is being read and a has a child: the capacity wins, a goes
    assert p.victim(pinned=("b",)) == "a"
    p.remove("b")
    assert drain(p) == []


def test_belady_evicts_the_key_used_furthest_in_the_future() -> None:
    uses = uses_by_key([["a", "b"], ["c"], ["b"], ["a"], ["c"]])
    p = BeladyOracle(100, uses)
    p.now = 1
    for k in "abc":
        p.insert(k, 1)
    # next uses after request 1: b at 2, a at 3, c at 4
    assert drain(p) == ["c", "a", "b"]


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_policy_tracks_inserts_and_removals(name: str) -> None:
    p = make_policy(name, 1000)
    for i in range(50):
        p.insert(f"k{i}", 10, parent=f"k{i - 1}" if i % 5 else None)
        p.access(f"k{i // 2}")
    p.remove("k7")
    out = drain(p)
    assert sorted(out) == sorted(f"k{i}" for i in range(50) if i != 7)
    assert len(p) == 0


def test_unknown_policy_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy 'fifo'.*lru"):
        make_policy("fifo", 10)
    with pytest.raises(ConfigError, match="eviction_policy"):
        AscendStoreConfig.from_dict({"eviction_policy": "fifo"})


# ---------------------------------------------------------------------- the backend
def test_backend_takes_its_policy_from_the_config() -> None:
    assert LocalBackend(capacity=10).policy.name == DEFAULT_POLICY
    cfg = AscendStoreConfig.from_dict({"eviction_policy": "LRU", "local_pool_size": "1MB"})
    assert isinstance(LocalBackend(config=cfg).policy, LRUPolicy)
    assert LocalBackend(capacity=10, eviction_policy="s3fifo").policy.name == "s3fifo"
    with pytest.raises(ValueError, match="unknown eviction policy"):
        LocalBackend(capacity=10, eviction_policy="nope")


def _put(b: LocalBackend, keys: list[str], src: np.ndarray) -> list[int]:
    return b.put(keys, [[src.ctypes.data]] * len(keys), [[src.nbytes]] * len(keys))


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_backend_learns_chains_from_lookups(name: str) -> None:
    src = np.arange(16, dtype=np.uint8)
    b = LocalBackend(capacity=3 * 16, eviction_policy=name)
    chain = ["m@h@a", "m@h@b", "m@h@c"]
    assert b.exists(chain) == [0, 0, 0]  # the lookup walks the chain from its root
    assert _put(b, chain, src) == [0, 0, 0]
    _put(b, ["m@h@x"], src)
    kept = b.exists(chain)
    if name.startswith("prefix"):
        assert kept == [1, 1, 0]  # the tip went, the prefix still hits
    assert sum(kept) == 2 and len(b) == 3


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_a_key_being_read_is_not_evicted(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros_like(src)
    b = LocalBackend(capacity=2 * 64, eviction_policy=name)
    _put(b, ["k@a", "k@b"], src)
    real = local_memory._memmove
    during: list[list[int]] = []
    started: list[bool] = []

    def memmove_then_fill(dst_addr: int, src_addr: int, n: int) -> None:
        if not started:  # mid-read: another thread's puts push the pool over capacity
            started.append(True)
            t = threading.Thread(target=_put, args=(b, ["k@c", "k@d", "k@e"], src))
            t.start()
            t.join()
            during.append(b.exists(["k@a"]))
        real(dst_addr, src_addr, n)

    monkeypatch.setattr(local_memory, "_memmove", memmove_then_fill)
    assert b.get(["k@a"], [[dst.ctypes.data]], [[64]]) == [0]
    assert during == [[1]]  # the key being read stayed while the puts evicted
    assert np.array_equal(dst, src)
    monkeypatch.setattr(local_memory, "_memmove", real)
    _put(b, ["k@f"], src)  # no reader now: back within capacity
    assert b.used_bytes <= b.capacity


def test_removed_while_read_slot_is_recycled_after_the_read(
        monkeypatch: pytest.MonkeyPatch) -> None:
    src = np.arange(64, dtype=np.uint8)
    other = np.full(64, 7, dtype=np.uint8)
    dst = np.zeros_like(src)
    b = LocalBackend(capacity=1 << 20)
    _put(b, ["k@a"], src)
    real = local_memory._memmove
    state = {"n": 0}

    def remove_and_reuse(dst_addr: int, src_addr: int, n: int) -> None:
        if state["n"] == 0:
            state["n"] = 1
            b.remove(["k@a"])
            _put(b, ["k@b"], other)  # must not land in the slot being read
        real(dst_addr, src_addr, n)

    monkeypatch.setattr(local_memory, "_memmove", remove_and_reuse)
    assert b.get(["k@a"], [[dst.ctypes.data]], [[64]]) == [0]
    assert np.array_equal(dst, src)


def test_concurrent_puts_and_gets_keep_bytes_and_capacity() -> None:
    b = LocalBackend(capacity=40 * 256)
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(200):
            key = f"w@{int(rng.integers(0, 80))}"
            data = np.full(256, hash(key) % 251, dtype=np.uint8)
            out = np.zeros(256, dtype=np.uint8)
            _put(b, [key], data)
            rc = b.get([key], [[out.ctypes.data]], [[256]])
            if rc == [0] and not np.array_equal(out, data):
                errors.append(key)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert b.used_bytes <= b.capacity


# ---------------------------------------------------------------------- copy threads
def _blocks(n: int, parts: int, part: int) -> tuple[np.ndarray, list[list[int]], list[list[int]]]:
    arr = np.random.default_rng(n).integers(0, 255, (parts, n * part), dtype=np.uint8)
    addrs = [[int(arr[p].ctypes.data) + i * part for p in range(parts)] for i in range(n)]
    return arr, addrs, [[part] * parts for _ in range(n)]


@pytest.mark.parametrize("threads", [1, 2])
def test_a_large_put_and_get_are_split_over_the_copy_threads(
        threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    n, parts, part = 64, 4, 64 << 10  # 16 MiB: above PARALLEL_MIN_BYTES
    assert n * parts * part >= local_memory.PARALLEL_MIN_BYTES
    src, src_a, sizes = _blocks(n, parts, part)
    dst = np.zeros_like(src)
    dst_a = [[int(dst[p].ctypes.data) + i * part for p in range(parts)] for i in range(n)]
    b = LocalBackend(capacity=64 << 20, copy_threads=threads)
    expect = min(threads, usable_cpus())
    assert b.copy_threads == expect
    real = local_memory._memmove
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()

    def recording(d: int, s: int, k: int) -> None:
        with lock:
            seen.append((threading.current_thread().name, k))
        real(d, s, k)

    monkeypatch.setattr(local_memory, "_memmove", recording)
    keys = [f"m@h@{i}" for i in range(n)]
    assert b.put(keys, src_a, sizes) == [0] * n
    put_calls = len(seen)
    assert b.get(keys, dst_a, sizes) == [0] * n
    assert np.array_equal(dst, src)
    total = n * parts * part
    assert sum(k for _name, k in seen) == 2 * total
    # a region's consecutive blocks are one run each way: a call per region and thread
    # (a share's end may cut one more), not one per block and region
    assert put_calls <= parts + expect
    assert len(seen) - put_calls <= parts + expect
    on_pool = sum(k for name, k in seen if name.startswith("local-pool-copy"))
    if expect == 1:
        assert on_pool == 0
    else:  # half of each call's bytes moved on the pool thread
        assert 0.4 * 2 * total < on_pool < 0.6 * 2 * total
    b.close()  # stops the threads; the next large call starts them again
    assert b.put(keys, src_a, sizes) == [0] * n
    dst[:] = 0
    assert b.get(keys, dst_a, sizes) == [0] * n
    assert np.array_equal(dst, src)
    b.close()


def test_small_calls_copy_on_the_calling_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    src, src_a, sizes = _blocks(4, 2, 4096)
    b = LocalBackend(capacity=1 << 20, copy_threads=2)
    real = local_memory._memmove
    names: list[str] = []
    monkeypatch.setattr(local_memory, "_memmove",
                        lambda d, s, k: (names.append(threading.current_thread().name),
                                         real(d, s, k)))
    assert b.put([f"m@h@{i}" for i in range(4)], src_a, sizes) == [0] * 4
    assert names and set(names) == {threading.current_thread().name}
    assert b._copier._pool is None  # no thread started for a small call


def test_copy_threads_come_from_the_config() -> None:
    cfg = AscendStoreConfig.from_dict({"local_copy_threads": 1, "local_pool_size": "1MB"})
    assert LocalBackend(config=cfg).copy_threads == 1
    assert AscendStoreConfig.from_dict({}).local_copy_threads == local_backend.DEFAULT_COPY_THREADS
    with pytest.raises(ConfigError, match="local_copy_threads"):
        AscendStoreConfig.from_dict({"local_copy_threads": 0})
