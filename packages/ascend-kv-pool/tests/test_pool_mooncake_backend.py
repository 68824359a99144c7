# SPDX-License-Identifier: Apache-2.0
"""MooncakeBackend: size parsing, configuration, and a real ``mooncake_master`` on loopback."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ascend_kv_testing.requires import require
from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.mooncake_backend import (
    MooncakeBackend,
    _convert_to_bytes,
    _parse_global_segment_size,
    describe_mooncake_rc,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config import (
    MOONCAKE_CONFIG_ENV,
    AscendStoreConfig,
    MooncakeStoreConfig,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.errors import (
    BackendError,
    BackendUnavailableError,
)

GB, MB, KB = 1 << 30, 1 << 20, 1 << 10


# ---------------------------------------------------------------------- size parsing (upstream)
@pytest.mark.parametrize(("value", "expected"), [
    (1024, 1024), (0, 0), ("1GB", GB), ("1gb", GB), ("  1 GB ", GB), ("2.5GB", int(2.5 * GB)),
    ("512MB", 512 * MB), ("512 mb", 512 * MB), ("1024KB", 1024 * KB), ("1B", 1), ("1024", 1024),
    ("0.5mb", MB // 2), (2048.0, 2048), (1024.7, 1024),
])
def test_parse_global_segment_size(value: Any, expected: int) -> None:
    assert _parse_global_segment_size(value) == expected


@pytest.mark.parametrize("value", ["", "   ", "abc", "1TB", "GB", "1.2.3GB", "-1GB", "1 G B"])
def test_parse_global_segment_size_rejects_bad_strings(value: str) -> None:
    with pytest.raises(ValueError) as err:
        _parse_global_segment_size(value)
    if value.strip():
        assert repr(value) in str(err.value)  # the message names the bad value


@pytest.mark.parametrize("value", [None, [1], {"a": 1}, object(), True])
def test_parse_global_segment_size_rejects_other_types(value: Any) -> None:
    with pytest.raises(TypeError, match="Unsupported type"):
        _parse_global_segment_size(value)


def test_convert_to_bytes() -> None:
    assert _convert_to_bytes("1.5", GB, "1.5GB") == int(1.5 * GB)
    assert _convert_to_bytes("3", 1, "3") == 3
    with pytest.raises(ValueError, match="'abc'"):
        _convert_to_bytes("abc", 1, "abc")
    with pytest.raises(ValueError, match="too large"):
        _convert_to_bytes("1e400", GB, "1e400GB")


@given(n=st.integers(0, 1 << 20), unit=st.sampled_from(["", "b", "kb", "mb", "gb"]),
       upper=st.booleans(), spaces=st.booleans())
def test_size_strings_round_trip(n: int, unit: str, upper: bool, spaces: bool) -> None:
    mult = {"": 1, "b": 1, "kb": KB, "mb": MB, "gb": GB}[unit]
    text = f"{n}{' ' if spaces else ''}{unit.upper() if upper else unit}"
    if spaces:
        text = f"  {text} "
    assert _parse_global_segment_size(text) == n * mult


# ---------------------------------------------------------------------- configuration
def test_store_config_from_env_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "127.0.0.1:50061",
                                "metadata_server": "P2PHANDSHAKE", "global_segment_size": "2GB",
                                "local_buffer_size": 1024, "protocol": "tcp",
                                "mode": "standalone-store"}))
    monkeypatch.setenv(MOONCAKE_CONFIG_ENV, str(path))
    cfg = MooncakeStoreConfig.load_from_env()
    assert (cfg.global_segment_size, cfg.local_buffer_size, cfg.protocol) == (2 * GB, 1024, "tcp")
    # the inline section wins over the file
    pool = AscendStoreConfig.from_dict({"backend": "mooncake", "mooncake": {
        "master_server_address": "10.0.0.1:1"}})
    assert pool.mooncake_store_config().master_server_address == "10.0.0.1:1"


def test_missing_store_config_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MOONCAKE_CONFIG_ENV, raising=False)
    with pytest.raises(ConfigError, match=MOONCAKE_CONFIG_ENV):
        MooncakeBackend(config=AscendStoreConfig.from_dict({"backend": "mooncake"}))


def test_unreachable_master_fails_fast() -> None:
    from ascend_kv_testing.procs import free_port

    cfg = MooncakeStoreConfig.from_dict({"master_server_address": f"127.0.0.1:{free_port()}"})
    start = time.monotonic()
    with pytest.raises(BackendUnavailableError, match="cannot reach mooncake_master"):
        MooncakeBackend(store_config=cfg)
    assert time.monotonic() - start < 10  # the store's own setup would wait ~90 s


def test_return_codes_are_named() -> None:
    assert "OBJECT_HAS_LEASE" in describe_mooncake_rc(-706)
    assert "RPC_FAIL" in describe_mooncake_rc(-900)
    assert "unknown" in describe_mooncake_rc(-12345)


# ---------------------------------------------------------------------- real master
@pytest.fixture
def store_cfg(mooncake_master: Any) -> MooncakeStoreConfig:
    require("mooncake.store")
    return MooncakeStoreConfig.from_dict(mooncake_master.config(global_segment_size="32MB",
                                                                local_buffer_size="4MB"))


def test_objects_larger_than_local_buffer_go_zero_copy(store_cfg: MooncakeStoreConfig) -> None:
    # Mooncake's bytes put() of more than local_buffer_size fails with -600; the pool puts
    # from registered KV memory (batch_put_from_multi_buffers), which has no such limit.
    b = MooncakeBackend(store_config=store_cfg)
    try:
        big = np.random.default_rng(2).integers(0, 255, 5 * MB, dtype=np.uint8)
        out = np.zeros_like(big)
        b.register_buffer([big.ctypes.data, out.ctypes.data], [big.nbytes, out.nbytes])
        assert b.store.put(f"bytes-{uuid.uuid4().hex}", big.tobytes()) == -600
        key = f"big-{uuid.uuid4().hex}"
        assert b.put([key], [[big.ctypes.data]], [[big.nbytes]]) == [0]
        assert b.get([key], [[out.ctypes.data]], [[out.nbytes]]) == [0]
        np.testing.assert_array_equal(big, out)
    finally:
        b.close()


def test_remove_needs_force_for_leased_objects(store_cfg: MooncakeStoreConfig) -> None:
    b = MooncakeBackend(store_config=store_cfg)
    try:
        buf = np.arange(4096, dtype=np.uint8)
        b.register_buffer([buf.ctypes.data], [buf.nbytes])
        key = f"lease-{uuid.uuid4().hex}"
        out = np.zeros_like(buf)
        b.register_buffer([out.ctypes.data], [out.nbytes])
        assert b.put([key], [[buf.ctypes.data]], [[4096]]) == [0]
        assert b.get([key], [[out.ctypes.data]], [[4096]]) == [0]  # a read takes a lease
        assert b.store.remove(key) == -706  # OBJECT_HAS_LEASE
        assert b.remove([key], force=True) == [0]
        assert b.exists([key]) == [0]
    finally:
        b.close()


def test_second_client_reads_the_first_clients_objects(store_cfg: MooncakeStoreConfig) -> None:
    writer = MooncakeBackend(store_config=store_cfg)
    reader = MooncakeBackend(store_config=store_cfg.__class__.from_dict(
        {**store_cfg.to_dict(), "global_segment_size": 0}))
    try:
        src = np.random.default_rng(1).integers(0, 255, 8192, dtype=np.uint8)
        dst = np.zeros_like(src)
        writer.register_buffer([src.ctypes.data], [src.nbytes])
        reader.register_buffer([dst.ctypes.data], [dst.nbytes])
        key = f"x-{uuid.uuid4().hex}"
        assert writer.put([key], [[src.ctypes.data, src.ctypes.data + 4096]], [[4096, 4096]]) == [0]
        assert reader.get([key], [[dst.ctypes.data]], [[8192]]) == [0]  # byte count -> 0
        np.testing.assert_array_equal(src, dst)
    finally:
        reader.close()
        writer.close()


def test_dead_master_raises_unavailable(tmp_path: Path) -> None:
    require("mooncake.store")
    from ascend_kv_testing.mooncake import MooncakeMaster

    master = MooncakeMaster(tmp_path / "mc").start()
    try:
        b = MooncakeBackend(store_config=MooncakeStoreConfig.from_dict(
            master.config(global_segment_size="16MB", local_buffer_size="4MB")))
        assert b.exists(["k"]) == [0]
        master.kill()
        start = time.monotonic()
        with pytest.raises(BackendUnavailableError) as err:
            b.exists(["k"])
        assert err.value.rc == -900 and time.monotonic() - start < 5
        start = time.monotonic()
        b.close(timeout=1.0)  # a dead master makes the store's close block: skipped
        assert time.monotonic() - start < 3
    finally:
        master.stop()


def test_setup_error_names_the_config(store_cfg: MooncakeStoreConfig) -> None:
    bad = MooncakeStoreConfig.from_dict({**store_cfg.to_dict(), "protocol": "rdma",
                                         "device_name": "no-such-nic"})
    with pytest.raises(BackendError, match="Mooncake Store setup failed") as err:
        MooncakeBackend(store_config=bad)  # rdma on a NIC that does not exist: setup refuses
    assert err.value.op == "setup" and err.value.rc is not None and err.value.rc != 0
    assert "protocol 'rdma'" in str(err.value)
    assert f"master {store_cfg.master_server_address}" in str(err.value)


def test_p2phandshake_store_shares_the_process_transfer_engine(mooncake_master: Any) -> None:
    require("mooncake.store")
    from vllm_ascend.distributed.kv_transfer.core.transfer_engine import peek_transfer_engine

    cfg = MooncakeStoreConfig.from_dict(mooncake_master.config(
        metadata_server="P2PHANDSHAKE", global_segment_size="16MB", local_buffer_size="4MB"))
    b = MooncakeBackend(store_config=cfg, hostname="127.0.0.1")
    try:
        assert b._engine is not None and b._engine is peek_transfer_engine()
        src = np.random.default_rng(3).integers(0, 255, 4096, dtype=np.uint8)
        dst = np.zeros_like(src)
        b.register_buffer([src.ctypes.data, dst.ctypes.data], [4096, 4096])
        assert b._engine.registered_bytes >= 8192  # registered once, through the engine
        key = f"shared-{uuid.uuid4().hex}"
        assert b.put([key], [[src.ctypes.data]], [[4096]]) == [0]
        assert b.get([key], [[dst.ctypes.data]], [[4096]]) == [0]
        np.testing.assert_array_equal(src, dst)
    finally:
        b.close()
