# SPDX-License-Identifier: Apache-2.0
"""Registration at modules only ascend-kv-p2p ships; upstream's paths re-export the classes."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

from vllm_ascend.distributed.kv_transfer import kv_p2p
from vllm_ascend.distributed.kv_transfer.kv_p2p import plugin

#: What vLLM-Ascend 0.26.0rc1's wheel ships at our paths: installed after ours, its copies
#: replace these files, so neither the entry point nor a registered class may live there.
UPSTREAM_PATHS = {
    "vllm_ascend.distributed.kv_transfer.kv_p2p",
    "vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_connector",
    "vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_layerwise_connector",
    "vllm_ascend.distributed.kv_transfer.ascend_multi_connector",
}
SHIMS = {  # upstream path -> the class it re-exports
    "vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_connector": "MooncakeConnector",
    "vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_layerwise_connector":
        "MooncakeLayerwiseConnector",
    "vllm_ascend.distributed.kv_transfer.ascend_multi_connector": "AscendMultiConnector",
}


def test_names_are_registered_at_modules_only_we_ship() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    kv_p2p.register()
    assert kv_p2p.register is plugin.register and kv_p2p.CONNECTORS is plugin.CONNECTORS
    for name, module, cls in plugin.CONNECTORS:
        assert module not in UPSTREAM_PATHS, name
        loaded = KVConnectorFactory._registry[name]()
        assert (loaded.__module__, loaded.__name__) == (module, cls)


def test_upstream_paths_re_export_the_same_classes() -> None:
    registered = {cls: module for _, module, cls in plugin.CONNECTORS}
    for path, cls in SHIMS.items():
        ours = getattr(importlib.import_module(registered[cls]), cls)
        assert getattr(importlib.import_module(path), cls) is ours


def test_the_plugin_entry_point_is_not_an_upstream_path() -> None:
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    eps = tomllib.loads(pyproject.read_text())["project"]["entry-points"]
    value = eps["vllm.general_plugins"]["ascend_kv_p2p"]
    assert value == "vllm_ascend.distributed.kv_transfer.kv_p2p.plugin:register"
    assert value.partition(":")[0] not in UPSTREAM_PATHS
