# SPDX-License-Identifier: Apache-2.0
"""Registration at modules only ascend-kv-p2p ships; upstream's paths re-export the classes."""

from __future__ import annotations

import importlib
import sys
import tomllib
from pathlib import Path

from ascend_kv_testing.procs import start_in_background
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


#: A fresh interpreter importing the three connectors (vLLM with them: the slowest check of
#: this session), started when this module is collected: it runs on a free core meanwhile.
_FRESH_IMPORT = start_in_background([sys.executable, "-c", (
    "import sys\n"
    "for m in ('pull.connector', 'layerwise.connector', 'multi_connector', 'plugin'):\n"
    "    __import__('vllm_ascend.distributed.kv_transfer.kv_p2p.' + m)\n"
    "print('\\n'.join(m for m in sys.modules if m.startswith('vllm_ascend')))")], timeout=300)


def test_runtime_imports_avoid_upstream_paths() -> None:
    """A fresh import of the three connectors loads no file vLLM-Ascend's wheel also ships
    (but the package ``__init__`` Python runs on the way, harmless in vLLM-Ascend's copy)."""
    packages = {  # upstream packages: nothing under them either
        "vllm_ascend.distributed.parallel_state", "vllm_ascend.distributed.utils",
        "vllm_ascend.distributed.device_communicators",
        "vllm_ascend.distributed.kv_transfer.utils"}
    proc = _FRESH_IMPORT.result()
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = set(proc.stdout.split())
    bad = {m for m in loaded if m in UPSTREAM_PATHS or m in packages
           or any(m.startswith(p + ".") for p in packages)}
    assert bad == {"vllm_ascend.distributed.kv_transfer.kv_p2p"}, sorted(loaded)
