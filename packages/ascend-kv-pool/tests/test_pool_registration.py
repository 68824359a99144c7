# SPDX-License-Identifier: Apache-2.0
"""Registration with vLLM, the deprecated alias, and the CLI's config reference."""

from __future__ import annotations

import logging

import pytest

from vllm_ascend.distributed.kv_transfer.kv_pool import ascend_store


def test_register_is_lazy_and_idempotent() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    ascend_store.register()
    assert ascend_store.register() == []
    for name, module, cls in ascend_store.CONNECTORS:
        assert name in KVConnectorFactory._registry
        loaded = KVConnectorFactory._registry[name]()
        assert loaded.__name__ == cls and loaded.__module__ == module


def test_alias_is_the_same_connector_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.ascend_store_connector import (
        AscendStoreConnector,
        MooncakeConnectorStoreV1,
    )

    assert issubclass(MooncakeConnectorStoreV1, AscendStoreConnector)

    class Config:  # __init__ warns before touching the config, then fails on this stand-in
        kv_transfer_config = None

    with caplog.at_level(logging.WARNING), pytest.raises(Exception):  # noqa: B017
        MooncakeConnectorStoreV1(Config(), None)  # type: ignore[arg-type]
    assert "MooncakeConnectorStoreV1' is deprecated" in caplog.text


def test_cli_describes_the_pool_config(capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_ascend.distributed.kv_transfer.core.tooling import cli

    if "AscendStoreConnector" not in cli.config_sections():
        pytest.skip("ascend-kv-pool's entry points are not installed in this environment")
    assert cli.main(["config", "AscendStoreConnector"]) == 0
    out = capsys.readouterr().out
    for key in ("backend", "local_pool_size", "discard_partial_chunks", "lookup_rpc_port"):
        assert key in out
