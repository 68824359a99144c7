# SPDX-License-Identifier: Apache-2.0
"""Registration with vLLM, the deprecated alias, and the CLI's config reference."""

from __future__ import annotations

import logging
import sys
from typing import Any

import pytest

from ascend_kv_testing.procs import start_in_background
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


#: What vLLM-Ascend 0.26.0rc1's wheel ships at our paths: installed after ours, its copies
#: replace these files, so neither the entry point nor anything the connector imports at run
#: time may live there.
UPSTREAM_PATHS = {
    f"vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store{m}" for m in (
        "", ".ascend_store_connector", ".config_data", ".kv_transfer", ".pool_scheduler",
        ".pool_worker", ".backend", ".backend.backend", ".backend.mooncake_backend",
        ".backend.memcache_backend")}
#: upstream path -> the names it re-exports from a module only we ship
SHIMS = {
    ".ascend_store_connector": ("store_connector", ["AscendStoreConnector",
                                                    "MooncakeConnectorStoreV1"]),
    ".config_data": ("store_contract", ["AscendConnectorMetadata", "LoadSpec", "TransferJob"]),
    ".kv_transfer": ("store_transfer", ["TransferThread", "StoreGuard", "run_save"]),
    ".pool_scheduler": ("store_scheduler", ["KVPoolScheduler"]),
    ".pool_worker": ("store_worker", ["KVPoolWorker", "create_backend"]),
    ".backend.backend": ("backend.base", ["Backend", "chunks", "RC_ERROR"]),
    ".backend.mooncake_backend": ("backend.mooncake_store", [
        "MooncakeBackend", "_convert_to_bytes", "_parse_global_segment_size"]),
    ".backend.memcache_backend": ("backend.memcache_store", ["MemcacheBackend"]),
}
PKG = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store"


def test_registered_at_modules_only_we_ship() -> None:
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store import plugin

    assert ascend_store.register is plugin.register
    for _, module, _ in (*plugin.CONNECTORS,):
        assert module not in UPSTREAM_PATHS and module.startswith(PKG)


#: A fresh interpreter importing the connector's module graph (vLLM with it: a slow check),
#: started when this module is collected: it runs on a free core meanwhile.
_FRESH_IMPORT = start_in_background([sys.executable, "-c", (
    "import sys; import vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store."
    "store_connector as c; from vllm_ascend.distributed.kv_transfer.kv_pool."
    "ascend_store.backend.registry import backend_class as b; b('local'); "
    "b('mooncake'); b('memcache'); "
    "print('\\n'.join(m for m in sys.modules if m.startswith('vllm_ascend')))")], timeout=300)


def test_runtime_imports_avoid_upstream_paths() -> None:
    """Importing the connector's module graph fresh never loads an upstream path's file."""
    proc = _FRESH_IMPORT.result()
    assert proc.returncode == 0, proc.stderr[-2000:]
    loaded = set(proc.stdout.split())
    # the packages' __init__ files run (Python imports parents); vLLM-Ascend's are harmless
    assert not (loaded & UPSTREAM_PATHS) - {PKG, f"{PKG}.backend"}, sorted(loaded)


@pytest.mark.parametrize("path", sorted(SHIMS))
def test_upstream_paths_re_export_ours(path: str) -> None:
    import importlib

    module, names = SHIMS[path]
    shim = importlib.import_module(PKG + path)
    ours = importlib.import_module(f"{PKG}.{module}")
    for name in names:
        assert getattr(shim, name) is getattr(ours, name), name


def _hybrid_config(*, mamba: bool = False) -> tuple[Any, Any]:
    """A bare ``VllmConfig`` stand-in and a ``KVCacheConfig`` with full-attention and
    sliding-window groups (or a full-attention and a state-space group)."""
    from types import SimpleNamespace

    import torch
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec, MambaSpec

    from ascend_kv_testing.models import hybrid_kv_cache_config

    kv_cache_config = hybrid_kv_cache_config()
    if mamba:
        state = MambaSpec(block_size=16, shapes=((16,),), dtypes=(torch.float32,))
        kv_cache_config.kv_cache_groups[1] = KVCacheGroupSpec(
            ["model.layers.1.mixer", "model.layers.3.mixer"], state)
    cfg = SimpleNamespace(kv_transfer_config=SimpleNamespace(
        kv_connector_extra_config={"use_layerwise": True}))
    return cfg, kv_cache_config


def test_the_connector_serves_the_hybrid_kv_cache_manager() -> None:
    """It declares vLLM's SupportsHMA: vLLM keeps the hybrid manager on for it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma

    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.store_connector import (
        AscendStoreConnector,
        MooncakeConnectorStoreV1,
    )

    assert supports_hma(AscendStoreConnector) and supports_hma(MooncakeConnectorStoreV1)


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_a_state_space_group_is_refused_at_start_up(role: str) -> None:
    """A group the pool cannot move (a state-space model's state) is refused, naming it,
    instead of pooling part of a request's KV."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.store_connector import (
        AscendStoreConnector,
    )

    cfg, kv_cache_config = _hybrid_config(mamba=True)
    with pytest.raises(ConfigError, match=r"AscendStoreConnector moves the blocks of full and "
                                          r"sliding KV cache groups .* \['MambaSpec'\]") as info:
        AscendStoreConnector(cfg, getattr(KVConnectorRole, role),  # type: ignore[arg-type]
                             kv_cache_config)
    assert info.value.key == "kv_cache_groups"


def test_layerwise_with_several_groups_is_refused_at_start_up() -> None:
    """use_layerwise would save a tensor a layer of each group shares when only one of the
    layers is computed: refused with the way out."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.store_connector import (
        AscendStoreConnector,
    )

    cfg, kv_cache_config = _hybrid_config()
    with pytest.raises(ConfigError, match="use_layerwise moves one layer's KV at a time") as info:
        AscendStoreConnector(cfg, KVConnectorRole.SCHEDULER,  # type: ignore[arg-type]
                             kv_cache_config)
    assert info.value.key == "use_layerwise"
