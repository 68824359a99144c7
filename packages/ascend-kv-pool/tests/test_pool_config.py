# SPDX-License-Identifier: Apache-2.0
"""The KV pool's typed config: AscendStoreConfig and MooncakeStoreConfig."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config import (
    MOONCAKE_CONFIG_ENV,
    AscendStoreConfig,
    MooncakeStoreConfig,
)

GB, MB = 1 << 30, 1 << 20


def test_defaults_are_zero_configuration() -> None:
    cfg = AscendStoreConfig.from_dict(None)
    assert cfg.backend == "local"
    assert cfg.local_pool_size == 8 * GB
    assert cfg.discard_partial_chunks is True
    assert (cfg.use_layerwise, cfg.load_async, cfg.consumer_is_to_put,
            cfg.consumer_is_to_load) == (False, False, False, False)
    assert cfg.lookup_rpc_port == 0 and cfg.mooncake is None


def test_upstream_keys_keep_their_meaning() -> None:
    cfg = AscendStoreConfig.from_dict({
        "backend": "Mooncake", "use_layerwise": "true", "load_async": True,
        "consumer_is_to_put": "1", "consumer_is_to_load": "yes", "discard_partial_chunks": False,
        "lookup_rpc_port": "12", "prefill_pp_size": 2, "prefill_pp_layer_partition": "20,20"})
    assert cfg.backend == "mooncake"
    assert cfg.use_layerwise and cfg.load_async and cfg.consumer_is_to_load
    assert cfg.lookup_rpc_port == 12 and cfg.prefill_pp_layer_partition == [20, 20]


def test_deprecated_mooncake_rpc_port_still_works(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        cfg = AscendStoreConfig.from_dict({"mooncake_rpc_port": 7})
    assert cfg.lookup_rpc_port == 7
    assert "deprecated" in caplog.text and "lookup_rpc_port" in caplog.text


@pytest.mark.parametrize(("data", "match"), [
    ({"backend": "redis"}, "backend"),
    ({"local_pool_size": "lots"}, "'lots'"),
    ({"local_pool_size": 0}, "local_pool_size"),
    ({"lookup_timeout_s": 0}, "lookup_timeout_s"),
    ({"prefill_pp_size": 2, "prefill_pp_layer_partition": [10]}, "prefill_pp_layer_partition"),
    ({"use_layerwise": "maybe"}, "use_layerwise"),
    ({"mooncake": {"protocol": "tcp"}}, "master_server_address"),
    ({"mooncake": "127.0.0.1:1"}, "mooncake"),
])
def test_bad_values_name_the_key_and_value(data: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        AscendStoreConfig.from_dict(data)


@given(n=st.integers(1, 4096), unit=st.sampled_from(["KB", "MB", "GB", "kb", "mb", "gb"]))
def test_local_pool_size_parses_size_strings(n: int, unit: str) -> None:
    mult = {"kb": 1 << 10, "mb": MB, "gb": GB}[unit.lower()]
    assert AscendStoreConfig.from_dict({"local_pool_size": f" {n} {unit} "}).local_pool_size == \
        n * mult


def test_inline_mooncake_config() -> None:
    cfg = AscendStoreConfig.from_dict({"backend": "mooncake", "mooncake_config": {
        "master_server_addr": "10.0.0.1:50088", "global_segment_size": "4GB",
        "local_buffer_size": 0, "protocol": "RDMA", "mode": "standalone-store"}})
    store = cfg.mooncake_store_config()
    assert store.master_server_address == "10.0.0.1:50088"
    assert (store.global_segment_size, store.local_buffer_size) == (4 * GB, 0)
    assert store.protocol == "rdma" and store.metadata_server == "P2PHANDSHAKE"


@pytest.mark.parametrize("addr", ["nohost", ":123", "host:", "host:port"])
def test_master_address_must_be_host_port(addr: str) -> None:
    with pytest.raises(ConfigError, match="host:port"):
        MooncakeStoreConfig.from_dict({"master_server_address": addr})


def test_store_config_file_errors_name_the_file(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(MOONCAKE_CONFIG_ENV, raising=False)
    with pytest.raises(ConfigError, match=MOONCAKE_CONFIG_ENV):
        MooncakeStoreConfig.load_from_env()
    missing = tmp_path / "nope.json"
    monkeypatch.setenv(MOONCAKE_CONFIG_ENV, str(missing))
    with pytest.raises(ConfigError, match="nope.json"):
        MooncakeStoreConfig.load_from_env()
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        MooncakeStoreConfig.from_file(bad)
    sized = tmp_path / "sized.json"
    sized.write_text(json.dumps({"master_server_address": "h:1", "global_segment_size": "1.5x"}))
    with pytest.raises(ConfigError, match="'1.5x'"):
        MooncakeStoreConfig.from_file(sized)


def test_describe_lists_every_key() -> None:
    keys = {d.key for d in AscendStoreConfig.describe()}
    assert {"backend", "local_pool_size", "lookup_rpc_port", "mooncake"} <= keys
    doc = {d.key: d for d in AscendStoreConfig.describe()}
    assert doc["local_pool_size"].default == "8GB"
    assert doc["lookup_rpc_port"].deprecated_aliases == ("mooncake_rpc_port",)
