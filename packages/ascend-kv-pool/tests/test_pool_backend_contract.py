# SPDX-License-Identifier: Apache-2.0
"""One contract every pool backend keeps: local, Mooncake Store (real master), memcache (fake).

Objects are several memory ranges per key (one per KV region); ``exists``
answers 1/0, ``put`` of an existing key is harmless, ``get`` of a missing key
or into ranges of the wrong size fails for that key only, batches larger than
``max_batch_keys`` are split, and data round-trips byte for byte.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest

from ascend_kv_testing.requires import require
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import (
    Backend,
    LocalBackend,
    backend_class,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config import (
    AscendStoreConfig,
    MooncakeStoreConfig,
)

BACKENDS = ["local", "mooncake", "memcache"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    name = request.param
    if name == "local":
        b: Backend = LocalBackend(capacity=32 << 20, max_batch_keys=3)
    elif name == "mooncake":
        require("mooncake.store")
        master = request.getfixturevalue("mooncake_master")
        from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import (
            MooncakeBackend,
        )

        store = MooncakeStoreConfig.from_dict(master.config(global_segment_size="32MB",
                                                            local_buffer_size="16MB"))
        b = MooncakeBackend(store_config=store, max_batch_keys=3)
    else:
        request.getfixturevalue("fake_memcache")
        from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import (
            MemcacheBackend,
        )

        b = MemcacheBackend(config=AscendStoreConfig.from_dict({"memcache_device_type": "a2",
                                                               "max_batch_keys": 3}),
                            device_id=0, host_memory=True)
    try:
        yield b
    finally:
        b.close()


class Buffers:
    """Host memory standing in for KV regions, registered with the backend."""

    def __init__(self, backend: Backend, parts: int = 3, part_len: int = 256,
                 n_objects: int = 8) -> None:
        self.parts, self.part_len = parts, part_len
        self.src = np.random.default_rng(0).integers(0, 255, (parts, n_objects * part_len),
                                                     dtype=np.uint8)
        self.dst = np.zeros_like(self.src)
        for arr in (self.src, self.dst):
            for row in arr:
                backend.register_buffer([row.ctypes.data], [row.nbytes])

    def ranges(self, arr: np.ndarray, i: int) -> tuple[list[int], list[int]]:
        return ([int(arr[p].ctypes.data) + i * self.part_len for p in range(self.parts)],
                [self.part_len] * self.parts)

    def obj(self, arr: np.ndarray, i: int) -> np.ndarray:
        return arr[:, i * self.part_len:(i + 1) * self.part_len]


def _keys(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [f"tiny@pcp0@dcp0@head_or_tp_rank:0@pp_rank:0@{tag}{i:04x}" for i in range(n)]


def _put(backend: Backend, buf: Buffers, keys: list[str], idx: list[int]) -> list[int]:
    addrs, sizes = zip(*(buf.ranges(buf.src, i) for i in idx), strict=True)
    return backend.put(keys, list(addrs), list(sizes))


def _get(backend: Backend, buf: Buffers, keys: list[str], idx: list[int]) -> list[int]:
    addrs, sizes = zip(*(buf.ranges(buf.dst, i) for i in idx), strict=True)
    return backend.get(keys, list(addrs), list(sizes))


def test_round_trip_of_multi_range_objects(backend: Backend) -> None:
    buf = Buffers(backend)
    keys = _keys(7)  # more than max_batch_keys=3: the backend splits the batch
    assert _put(backend, buf, keys, list(range(7))) == [0] * 7
    assert backend.exists(keys) == [1] * 7
    order = [6, 0, 3, 1, 5, 2, 4]
    assert _get(backend, buf, [keys[i] for i in order], order) == [0] * 7
    for i in range(7):
        np.testing.assert_array_equal(buf.obj(buf.dst, i), buf.obj(buf.src, i))


def test_exists_answers_per_key(backend: Backend) -> None:
    buf = Buffers(backend)
    keys = _keys(4)
    _put(backend, buf, keys[:2], [0, 1])
    assert backend.exists([keys[3], keys[0], keys[2], keys[1]]) == [0, 1, 0, 1]
    assert backend.exists([]) == []


def test_missing_key_fails_only_that_key(backend: Backend) -> None:
    buf = Buffers(backend)
    keys = _keys(3)
    _put(backend, buf, [keys[0], keys[2]], [0, 2])
    rcs = _get(backend, buf, keys, [0, 1, 2])
    assert rcs[0] == 0 and rcs[2] == 0
    assert rcs[1] < 0
    assert not buf.obj(buf.dst, 1).any()  # nothing written for the missing key
    assert backend.describe_rc(rcs[1])


def test_get_into_ranges_of_the_wrong_size_fails(backend: Backend) -> None:
    buf = Buffers(backend)
    keys = _keys(1)
    _put(backend, buf, keys, [0])
    addrs, sizes = buf.ranges(buf.dst, 0)
    sizes = [s // 2 for s in sizes]
    assert backend.get(keys, [addrs], [sizes])[0] < 0


def test_put_of_an_existing_key_is_harmless(backend: Backend) -> None:
    buf = Buffers(backend)
    keys = _keys(1)
    assert _put(backend, buf, keys, [0]) == [0]
    rcs = _put(backend, buf, keys, [0])
    assert rcs[0] in (0, -705)  # Mooncake may answer OBJECT_ALREADY_EXISTS
    assert _get(backend, buf, keys, [0]) == [0]
    np.testing.assert_array_equal(buf.obj(buf.dst, 0), buf.obj(buf.src, 0))


def test_mismatched_lists_are_rejected(backend: Backend) -> None:
    with pytest.raises(ValueError, match="keys"):
        backend.put(_keys(2), [[0]], [[1]])
    with pytest.raises(ValueError, match="addresses"):
        backend.get(_keys(1), [[0, 1]], [[1]])
    with pytest.raises(ValueError, match="negative size"):
        backend.put(_keys(1), [[0, 0]], [[8, -1]])
    with pytest.raises(ValueError, match="negative size"):
        backend.get(_keys(1), [[0]], [[-8]])


def test_backend_class_by_name() -> None:
    assert backend_class("local") is LocalBackend
    assert backend_class(" Local ") is LocalBackend
    with pytest.raises(ValueError, match="unknown pool backend 'redis'"):
        backend_class("redis")


def test_local_backend_evicts_least_recently_used() -> None:
    b = LocalBackend(capacity=3 * 256 * 3, eviction_policy="lru")
    buf = Buffers(b)
    keys = _keys(4)
    _put(b, buf, keys[:3], [0, 1, 2])
    assert b.exists([keys[0]]) == [1]  # touch 0: 1 is now the oldest
    _put(b, buf, [keys[3]], [3])
    assert b.exists(keys) == [1, 0, 1, 1]
    assert b.evictions == 1
    assert b.used_bytes == 3 * 3 * 256


def test_local_backend_refuses_an_object_larger_than_the_pool() -> None:
    b = LocalBackend(capacity=100)
    buf = Buffers(b)
    rc = _put(b, buf, _keys(1), [0])[0]
    assert rc < 0 and "larger than local_pool_size" in b.describe_rc(rc)
    assert len(b) == 0


def test_local_backend_capacity_comes_from_the_config() -> None:
    cfg = AscendStoreConfig.from_dict({"local_pool_size": "2MB"})
    assert LocalBackend(config=cfg).capacity == 2 << 20
    with pytest.raises(ValueError, match="capacity must be positive"):
        LocalBackend(capacity=0)


def test_importing_backend_needs_no_store_client() -> None:
    import subprocess
    import sys

    code = ("import sys\n"
            "from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import Backend\n"
            "from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.backend "
            "import Backend\n"
            "from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend."
            "mooncake_backend import MooncakeBackend, _convert_to_bytes, "
            "_parse_global_segment_size\n"
            "from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend."
            "memcache_backend import MemcacheBackend\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'mooncake', "
            "'memcache_hybrid')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)
