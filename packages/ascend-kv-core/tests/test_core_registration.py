# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import sys

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from vllm_ascend.distributed.kv_transfer.core.registration import (
    register_connectors,
    registered_by_us,
)

MOD = "ascend_kv_core_test_fake_connector_module"


def test_lazy_idempotent_and_never_overrides_vllm() -> None:
    before = KVConnectorFactory._registry["MooncakeConnector"]
    entries = [("CoreTestConnectorA", MOD, "Conn"), ("MooncakeConnector", MOD, "Conn")]
    added = register_connectors(entries)
    assert added == ["CoreTestConnectorA"]
    assert KVConnectorFactory._registry["MooncakeConnector"] is before  # vLLM's own stays
    assert MOD not in sys.modules  # nothing imported until vLLM asks for the class
    assert register_connectors(entries) == []  # second call: no error, nothing new
    assert registered_by_us()["CoreTestConnectorA"] == (MOD, "Conn")
    with pytest.raises(ModuleNotFoundError):
        KVConnectorFactory._registry["CoreTestConnectorA"]()
