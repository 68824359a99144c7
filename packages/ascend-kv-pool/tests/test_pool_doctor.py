# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv doctor`` checks of the KV pool (``ascend_store.tooling.doctor``)."""

from __future__ import annotations

import json
import socket
import types
from pathlib import Path

import pytest

from vllm_ascend.distributed.kv_transfer.core.tooling.doctor import Doctor
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.tooling import doctor as pool_doctor


def test_master_check_says_only_the_port_was_reached(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        path = tmp_path / "mooncake.json"
        path.write_text(json.dumps({
            "master_server_address": f"127.0.0.1:{listener.getsockname()[1]}",
            "metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}))
        d = Doctor({}, mooncake_config=str(path), timeout_s=0.5)
        pool_doctor.check_backend(d, types.SimpleNamespace(backend="mooncake", mooncake=None))
    master = next(c for c in d.checks if c.what == "mooncake_master")
    assert master.status == "ok" and "TCP connect only" in master.detail
    assert not any(c.what == "metadata server" for c in d.checks)  # P2PHANDSHAKE


def test_no_store_config_and_local_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    d = Doctor({})
    pool_doctor.check_backend(d, types.SimpleNamespace(backend="mooncake", mooncake=None))
    pool_doctor.check_backend(d, types.SimpleNamespace(backend="local"))
    assert [(c.what, c.status) for c in d.checks] == [("Mooncake Store config", "fail"),
                                                       ("pool backend", "ok")]
    assert "vllm-ascend-kv config AscendStoreConnector" in d.checks[0].fix


def test_the_alias_is_checked_against_the_pool_section() -> None:
    cfg = {"kv_connector": "MooncakeConnectorStoreV1", "kv_role": "kv_both",
           "kv_connector_extra_config": {"backend": "nope"}}
    d = Doctor(cfg)
    pool_doctor.check(d, "MooncakeConnectorStoreV1", {"backend": "nope"}, "here", cfg)
    fail = next(c for c in d.checks if c.what == "MooncakeConnectorStoreV1 configuration")
    assert fail.status == "fail" and "AscendStoreConnector" in fail.fix


def test_the_local_pool_is_checked_against_the_hosts_available_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.core import device

    monkeypatch.setattr(device, "available_host_memory", lambda: 4 << 30)
    gb = 1 << 30
    cases = [(2 * gb, True, "ok"), (4 * gb, True, "fail"), (8 * gb, False, "warn"),
             (2 * gb, False, "ok")]
    for size, prefault, status in cases:
        d = Doctor({})
        pool_doctor.check_backend(d, types.SimpleNamespace(
            backend="local", local_pool_size=size, local_pool_prefault=prefault))
        (mem,) = [c for c in d.checks if c.what == "local pool memory"]
        assert mem.status == status, (size, prefault, mem)
        assert "4096 MiB" in mem.detail
    monkeypatch.setattr(device, "available_host_memory", lambda: None)  # not Linux
    d = Doctor({})
    pool_doctor.check_backend(d, types.SimpleNamespace(backend="local", local_pool_size=gb,
                                                       local_pool_prefault=True))
    assert [c.what for c in d.checks] == ["pool backend"]


def test_the_local_pool_check_counts_every_worker_on_the_host(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Each worker keeps a pool: 4 workers of 1.5 GiB pools do not fit in 4 GiB."""
    from vllm_ascend.distributed.kv_transfer.core import device

    monkeypatch.setattr(device, "available_host_memory", lambda: 4 << 30)
    size = 3 << 29
    cases = [(1, True, "ok"), (2, True, "ok"), (4, True, "fail"), (4, False, "warn"),
             (2, False, "ok")]
    for tp, prefault, status in cases:
        d = Doctor({}, parallel={"tensor_parallel_size": tp})
        pool_doctor.check_backend(d, types.SimpleNamespace(
            backend="local", local_pool_size=size, local_pool_prefault=prefault))
        (mem,) = [c for c in d.checks if c.what == "local pool memory"]
        assert mem.status == status, (tp, prefault, mem)
        assert (f"{tp} workers x 1536 MiB" in mem.detail) == (tp > 1), mem.detail
        if status == "fail":
            assert "the last workers refuse to start" in mem.detail

