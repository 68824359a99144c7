# SPDX-License-Identifier: Apache-2.0
"""The P/D connectors' kv_connector_extra_config sections (kv_p2p.config)."""
from __future__ import annotations

import logging

import pytest

from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.core.retry import RetryPolicy
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
    ({"protocol": "udp"}, "expected one of 'tcp', 'rdma', 'ascend', 'local', got 'udp'"),
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


def test_retry_policies_default_to_the_former_constants() -> None:
    """The defaults are the waits and tries the connectors had before the keys existed."""
    pull = MooncakeP2PConfig()
    assert pull.claim_retry == RetryPolicy(delay_s=0.01, max_delay_s=0.5, deadline_s=10.0)
    assert pull.read_retry == RetryPolicy(attempts=9, delay_s=0.25, max_delay_s=4.0)
    push = MooncakeLayerwiseConfig()
    assert push.push_retry == RetryPolicy(delay_s=0.01, max_delay_s=0.5, deadline_s=10.0)
    assert push.metaserver_policy == RetryPolicy(attempts=4, delay_s=0.05, max_delay_s=1.0)
    # the claim: 0.01 s doubled up to 0.5 s, for 10 s
    assert [pull.claim_retry.delay(n) for n in range(8)] == [
        0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.5, 0.5]


def test_retry_keys_override_only_what_they_name() -> None:
    cfg = MooncakeLayerwiseConfig.from_dict({
        "read_retry": {"attempts": 2}, "claim_retry": {"deadline_s": 1.5},
        "push_retry": {"max_delay_s": 0.1}, "metaserver_retry": {"attempts": None,
                                                                 "deadline_s": 3}})
    assert cfg.read_retry == RetryPolicy(attempts=2, delay_s=0.25, max_delay_s=4.0)
    assert cfg.claim_retry == RetryPolicy(delay_s=0.01, max_delay_s=0.5, deadline_s=1.5)
    assert cfg.push_retry.max_delay_s == 0.1 and cfg.push_retry.deadline_s == 10.0
    assert cfg.metaserver_policy == RetryPolicy(delay_s=0.05, max_delay_s=1.0, deadline_s=3.0)
    # the older key sets the metaserver's tries
    older = MooncakeLayerwiseConfig.from_dict({"metaserver_retries": 0})
    assert older.metaserver_policy.attempts == 1 and older.metaserver_policy.delay_s == 0.05
    docs = {d.key: d.default for d in MooncakeLayerwiseConfig.describe()}
    assert (docs["read_retry.attempts"], docs["read_retry.delay_s"]) == ("9", "0.25")
    assert (docs["claim_retry.deadline_s"], docs["metaserver_retry.attempts"]) == ("10.0", "4")


@pytest.mark.parametrize(("data", "needle"), [
    ({"read_retry": {"attempts": 0}}, "read_retry: attempts: must be >= 1, got 0"),
    ({"claim_retry": {"deadline_s": None}}, "claim_retry: set attempts or deadline_s"),
    ({"read_retry": {"max_delay_s": 0.1}}, "max_delay_s (0.1) is below delay_s (0.25)"),
    ({"read_retry": 3}, "read_retry: expected an object, got 3"),
    ({"metaserver_retries": -1}, "metaserver_retries: must be >= 0"),
])
def test_bad_retry_values_are_clear_errors(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        MooncakeLayerwiseConfig.from_dict(data, strict=True)
    assert needle in str(info.value)
