# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_ascend.distributed.kv_transfer.core.config import (
    ConfigSection,
    format_size,
    option,
    parse_size,
)
from vllm_ascend.distributed.kv_transfer.core.config.p2p import (
    MooncakeLayerwiseConfig,
    MooncakeP2PConfig,
)
from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError


@pytest.mark.parametrize(("text", "expected"), [
    ("1GB", 1 << 30), ("1gb", 1 << 30), (" 1.5 GB ", 3 << 29), ("512MB", 512 << 20),
    ("64kb", 64 << 10), ("4096", 4096), ("10b", 10), ("0", 0), (".5mb", 1 << 19),
    (1024, 1024), (2.0, 2),
])
def test_parse_size_accepts(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "GB", "1 TB", "1.2.3GB", "-1GB", "one", "1e3", True, -5,
                                 1.5, None, [1], float("nan")])
def test_parse_size_rejects_with_the_value_in_the_message(bad: object) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(bad, key="global_segment_size", source="mooncake.json")
    msg = str(info.value)
    assert "global_segment_size" in msg and "mooncake.json" in msg
    assert repr(bad) in msg or str(bad) in msg


@given(st.integers(min_value=0, max_value=1 << 45))
def test_format_then_parse_is_close(n: int) -> None:
    # format_size rounds to two decimals; reading it back lands within 1 %.
    back = parse_size(format_size(n))
    assert abs(back - n) <= max(n * 0.01, 0)


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
    ({"prefill": {"pp_size": 2}}, "prefill.pp_size must be 1"),
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


@dataclass(frozen=True)
class _Section(ConfigSection):
    size: int = option("1GB", doc="a size", size=True)
    port: int = option(0, doc="a port", deprecated_aliases=("old_port",), minimum=0, maximum=65535)
    name: str = option(doc="required name")


def test_sizes_aliases_required(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        s = _Section.from_dict({"size": "2 MB", "old_port": 5, "name": "x"})
    assert s.size == 2 << 20 and s.port == 5 and "deprecated" in caplog.text
    with pytest.raises(ConfigError, match="required key 'name' is missing"):
        _Section.from_dict({})
    with pytest.raises(ConfigError, match="must be <= 65535"):
        _Section.from_dict({"name": "x", "port": 70000})
    docs = {d.key: d for d in _Section.describe()}
    assert docs["size"].default == "1GB" and docs["name"].default == "(required)"
    assert docs["port"].deprecated_aliases == ("old_port",)


def test_non_mapping_section_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="expected a mapping"):
        MooncakeP2PConfig.from_dict(["prefill"])  # type: ignore[arg-type]
