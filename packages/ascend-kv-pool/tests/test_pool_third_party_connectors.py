# SPDX-License-Identifier: Apache-2.0
"""``UCMConnectorV1`` and ``LMCacheAscendConnector``: delegation, registration, missing engines.

``uc-manager`` on PyPI is only a backend selector; its engines are CANN or CUDA
builds that do not install on a CPU machine. So the delegation is exercised
against a fake ``ucm.integration.vllm.ucm_connector`` package written to a
temporary directory and put on ``sys.path`` by the test, and LMCache-Ascend
(not on PyPI) by a fake ``lmcache_ascend`` module.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from vllm_ascend.distributed.kv_transfer.core.errors import DependencyError
from vllm_ascend.distributed.kv_transfer.kv_pool import ascend_store

UCM = "vllm_ascend.distributed.kv_transfer.kv_pool.ucm_connector"
LMC = "vllm_ascend.distributed.kv_transfer.kv_pool.lmcache_ascend_connector"

FAKE_UCM = textwrap.dedent("""
    calls = []

    class UCMConnector:
        def __init__(self, *args):
            calls.append(("__init__", args))

        def __getattr__(self, name):
            def method(*args, **kwargs):
                calls.append((name, args, kwargs))
                return ("from-ucm", name)
            return method

        @classmethod
        def build_kv_connector_stats(cls, data=None):
            calls.append(("build_kv_connector_stats", (data,), {}))
            return "stats"

        @classmethod
        def build_prom_metrics(cls, *args):
            calls.append(("build_prom_metrics", args, {}))
            return "prom"
""")


@pytest.fixture
def fake_ucm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    pkg = tmp_path / "ucm" / "integration" / "vllm"
    pkg.mkdir(parents=True)
    for d in (tmp_path / "ucm", tmp_path / "ucm" / "integration", pkg):
        (d / "__init__.py").write_text("")
    (pkg / "ucm_connector.py").write_text(FAKE_UCM)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [m for m in sys.modules if m == "ucm" or m.startswith("ucm.")]:
        monkeypatch.delitem(sys.modules, name)
    yield importlib.import_module("ucm.integration.vllm.ucm_connector")
    for name in [m for m in sys.modules if m == "ucm" or m.startswith("ucm.")]:
        del sys.modules[name]


def _config() -> Any:
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_role="kv_both"))


def test_ucm_connector_delegates_every_method(fake_ucm: Any) -> None:
    from vllm_ascend.distributed.kv_transfer.kv_pool.ucm_connector import UCMConnectorV1

    cfg = _config()
    conn = UCMConnectorV1(cfg, KVConnectorRole.WORKER, kv_cache_config="kvcfg")  # type: ignore[arg-type]
    assert fake_ucm.calls == [("__init__", (cfg, KVConnectorRole.WORKER, "kvcfg"))]
    UCMConnectorV1(cfg, KVConnectorRole.SCHEDULER)
    assert fake_ucm.calls[-1] == ("__init__", (cfg, KVConnectorRole.SCHEDULER))
    fake_ucm.calls.clear()
    fc, req, blocks, meta, out = object(), object(), object(), object(), object()
    calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = [
        ("has_connector_metadata", (), {}),
        ("register_kv_caches", ({"l0": 1},), {}),
        ("start_load_kv", (fc,), {"extra": 1}),
        ("wait_for_layer_load", ("l0",), {}),
        ("save_kv_layer", ("l0", 2, 3), {"k": 4}),
        ("wait_for_save", (), {}),
        ("clear_connector_metadata", (), {}),
        ("bind_connector_metadata", (meta,), {}),
        ("get_finished", ({"r1"},), {}),
        ("get_num_new_matched_tokens", (req, 16), {}),
        ("update_state_after_alloc", (req, blocks, 16), {}),
        ("build_connector_meta", (out,), {}),
        ("request_finished", (req, [1, 2]), {}),
        ("update_connector_output", (out,), {}),
    ]
    for name, args, kwargs in calls:
        result = getattr(conn, name)(*args, **kwargs)
        assert fake_ucm.calls[-1] == (name, args, kwargs), name
        if name in ("get_finished", "get_num_new_matched_tokens", "build_connector_meta",
                    "request_finished"):
            assert result == ("from-ucm", name)
    assert conn.has_connector_metadata() is True
    fake_ucm.calls.clear()

    class Errors:
        def get_block_ids_with_load_errors(self) -> list[int]:
            return [3, 3, 5]

    conn._ucm_engine = Errors()
    assert conn.get_block_ids_with_load_errors() == {3, 5}
    assert UCMConnectorV1.build_kv_connector_stats({"a": 1}) == "stats"
    assert UCMConnectorV1.build_prom_metrics(cfg, {}, ["l"], {0: ["x"]}) == "prom"  # type: ignore[arg-type]
    assert fake_ucm.calls == [("build_kv_connector_stats", ({"a": 1},), {}),
                              ("build_prom_metrics", (cfg, {}, ["l"], {0: ["x"]}), {})]


def test_ucm_connector_without_uc_manager(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend.distributed.kv_transfer.kv_pool.ucm_connector import UCMConnectorV1

    monkeypatch.setitem(sys.modules, "ucm.integration.vllm.ucm_connector", None)
    with pytest.raises(DependencyError, match="pip package uc-manager") as info:
        UCMConnectorV1(_config(), KVConnectorRole.WORKER)  # type: ignore[arg-type]
    assert isinstance(info.value, ImportError)


def test_lmcache_ascend_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_connector import (
        LMCacheConnectorV1,
    )

    monkeypatch.delitem(sys.modules, LMC, raising=False)
    monkeypatch.setitem(sys.modules, "lmcache_ascend", None)
    with pytest.raises(DependencyError, match="LMCache-Ascend.*pip install lmcache"):
        importlib.import_module(LMC)
    monkeypatch.delitem(sys.modules, LMC, raising=False)
    fake = SimpleNamespace(__name__="lmcache_ascend")
    monkeypatch.setitem(sys.modules, "lmcache_ascend", fake)  # type: ignore[arg-type]
    module = importlib.import_module(LMC)
    assert module.LMCacheConnectorV1 is LMCacheConnectorV1
    monkeypatch.delitem(sys.modules, LMC)


def test_registered_under_upstream_names() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    ascend_store.register()
    registry = KVConnectorFactory._registry
    assert "UCMConnector" in registry and "LMCacheAscendConnector" in registry
    from vllm_ascend.distributed.kv_transfer.kv_pool.ucm_connector import UCMConnectorV1

    assert registry["UCMConnector"]() is UCMConnectorV1
    # vLLM's own names stay vLLM's
    assert registry["LMCacheConnectorV1"]().__module__.startswith("vllm.")
