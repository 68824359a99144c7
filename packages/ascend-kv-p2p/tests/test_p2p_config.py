# SPDX-License-Identifier: Apache-2.0
"""The P/D connectors' kv_connector_extra_config sections (kv_p2p.config)."""
from __future__ import annotations

import logging

import pytest

from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import (
    MooncakeLayerwiseConfig,
    MooncakeP2PConfig,
)


def test_p2p_config_defaults_and_nested_values() -> None:
    cfg = MooncakeP2PConfig.from_dict({
        "prefill": {"tp_size": 2, "dp_size": 2, "pp_size": 1, "pp_layer_partition": "24"},
        "decode": {"tp_size": "1", "dp_size": 4},
        "protocol": "TCP",
    })
    assert cfg.prefill.tp_size == 2 and cfg.prefill.pp_layer_partition == [24]
    assert cfg.decode.tp_size == 1 and cfg.decode.dp_size == 4
    assert cfg.protocol == "tcp"
    assert MooncakeP2PConfig.from_dict(None) == MooncakeP2PConfig()


@pytest.mark.parametrize(("data", "needle"), [
    ({"prefill": {"tp_size": 0}}, "prefill: tp_size: must be >= 1, got 0"),
    ({"prefill": {"tp_size": "two"}}, "tp_size: expected an integer, got 'two'"),
    ({"prefill": {"tp_size": True}}, "expected an integer, got True"),
    ({"prefill": {"pp_size": 2, "pp_layer_partition": [4]}}, "has 1 entries but pp_size is 2"),
    ({"decode": {"pp_size": 2}}, "decode.pp_size must be 1"),
    ({"prefill": {"pp_size": 2, "pp_layer_partition": "0,8"}}, "must be positive"),
    ({"protocol": "udp"}, "expected one of 'tcp', 'rdma', 'ascend', got 'udp'"),
    ({"prefill": [1, 2]}, "expected an object"),
    ({"lease_ttl_s": "soon"}, "lease_ttl_s: expected a number, got 'soon'"),
])
def test_p2p_config_errors_name_key_and_value(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as info:
        MooncakeP2PConfig.from_dict(data)
    assert needle in str(info.value)


def test_unknown_keys_warn_or_raise(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        MooncakeP2PConfig.from_dict({"lease_ttl": 3})
    assert "did you mean 'lease_ttl_s'" in caplog.text
    with pytest.raises(ConfigError, match="unknown key"):
        MooncakeP2PConfig.from_dict({"lease_ttl": 3}, strict=True)
    # upstream configs carry keys nobody reads; those pass silently
    caplog.clear()
    MooncakeP2PConfig.from_dict({"use_ascend_direct": True}, strict=True)
    assert MooncakeP2PConfig.unknown_keys({"use_ascend_direct": 1, "x": 2}) == ["x"]


def test_layerwise_config_tls() -> None:
    cfg = MooncakeLayerwiseConfig.from_dict({"tls_config": {"ssl_enable": "true",
                                                            "ssl_ca_certs": "/ca.pem"}})
    assert cfg.tls_config.ssl_enable is True and cfg.tls_config.ssl_ca_certs == "/ca.pem"
    with pytest.raises(ConfigError, match="ssl_enable: expected a bool"):
        MooncakeLayerwiseConfig.from_dict({"tls_config": {"ssl_enable": "maybe"}})


def test_a_pipeline_parallel_prefill_is_accepted_by_the_pull_connector() -> None:
    cfg = MooncakeP2PConfig.from_dict({"prefill": {"pp_size": 2, "pp_layer_partition": "3,5"}})
    assert cfg.prefill.pp_size == 2 and cfg.prefill.pp_layer_partition == [3, 5]
