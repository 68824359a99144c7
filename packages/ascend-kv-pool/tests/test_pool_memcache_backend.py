# SPDX-License-Identifier: Apache-2.0
"""MemcacheBackend against the fake ``memcache_hybrid`` (the real data path needs an Ascend driver)."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from vllm_ascend.distributed.kv_transfer.core.errors import DependencyError
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.memcache_backend import (
    MemcacheBackend,
    MmcDirect,
    detect_device_type,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config import AscendStoreConfig
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.errors import BackendError


def cfg(kind: str) -> AscendStoreConfig:
    return AscendStoreConfig.from_dict({"backend": "memcache", "memcache_device_type": kind})


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "memcache_hybrid", None)
    with pytest.raises(DependencyError, match=r"ascend-kv-pool\[memcache\]"):
        MemcacheBackend(config=cfg("a3"))


def test_init_failure_is_a_clear_error(fake_memcache: Any) -> None:
    fake_memcache.FAIL_INIT = True
    with pytest.raises(BackendError, match=r"init\(3\) failed: rc=-1") as err:
        MemcacheBackend(config=cfg("a3"), device_id=3)
    assert err.value.op == "init" and err.value.rc == -1


@pytest.mark.parametrize(("kind", "registers"), [("a2", True), ("a3", False), ("other", False)])
def test_only_a2_registers_buffers(fake_memcache: Any, kind: str, registers: bool) -> None:
    b = MemcacheBackend(config=cfg(kind), device_id=1)
    buf = np.zeros(1024, dtype=np.uint8)
    b.register_buffer([buf.ctypes.data], [buf.nbytes])
    assert (b.store.registered == [(buf.ctypes.data, 1024)]) is registers
    assert ("init", 1) in fake_memcache.CALLS


@pytest.mark.parametrize(("host", "put_dir", "get_dir"), [
    (False, MmcDirect.COPY_L2G.value, MmcDirect.COPY_G2L.value),
    (True, MmcDirect.COPY_H2G.value, MmcDirect.COPY_G2H.value)])
def test_copy_direction_follows_where_the_cache_lives(fake_memcache: Any, host: bool, put_dir: int,
                                                      get_dir: int) -> None:
    b = MemcacheBackend(config=cfg("a3"), host_memory=host)
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros_like(src)
    if host:
        assert b.put(["k"], [[src.ctypes.data]], [[64]]) == [0]
        assert b.get(["k"], [[dst.ctypes.data]], [[64]]) == [0]
        np.testing.assert_array_equal(src, dst)
    else:
        # the fake checks the direction: device directions on host memory still copy
        b.put(["k"], [[src.ctypes.data]], [[64]])
        b.get(["k"], [[dst.ctypes.data]], [[64]])
    dirs = [c[1][1] for c in fake_memcache.CALLS if c[0].startswith("batch_") and
            c[0] != "batch_is_exist"]
    assert dirs == [put_dir, get_dir]


def test_device_type_is_other_without_an_npu() -> None:
    assert detect_device_type() == "other"


def test_close_is_idempotent(fake_memcache: Any) -> None:
    b = MemcacheBackend(config=cfg("a3"))
    b.close()
    b.close()
    assert [c for c in fake_memcache.CALLS if c[0] == "close"] == [("close", None)]
