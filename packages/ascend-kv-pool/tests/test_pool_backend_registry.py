# SPDX-License-Identifier: Apache-2.0
"""One registration makes a pool backend: config validation, the worker's factory, the docs
and the CLI all read :mod:`backend.registry`; an unknown name is an error listing the known."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.base import Backend
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.memcache_store import (
    MemcacheBackend,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.registry import (
    backend_class,
    backend_names,
    register_backend,
    unregister_backend,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config import (
    POOL_BACKENDS,
    AscendStoreConfig,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.context import PoolContext
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.store_worker import create_backend

CONFIG_REF = "vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config:AscendStoreConfig"


class DictBackend(Backend):
    """A backend defined in a test: objects in a dict, built from the config and the ranks."""

    shared_across_processes = False

    def __init__(self, parallel_config: Any = None, *, config: Any = None, rank: int = -1,
                 **kwargs: Any) -> None:
        super().__init__(parallel_config, **kwargs)
        self.config = config
        self.rank = rank
        self.objects: dict[str, bytes] = {}

    @classmethod
    def create(cls, cfg: Any, ctx: PoolContext, *, parallel_config: Any = None,
               host_memory: bool = True) -> DictBackend:
        return cls(parallel_config, config=cfg, rank=ctx.tp_rank + 10 * ctx.pp_rank)

    def register_buffer(self, ptrs: list[int], lengths: list[int]) -> None:
        return None

    def exists(self, keys: list[str]) -> list[int]:
        return [int(k in self.objects) for k in keys]

    def put(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        self.objects.update((k, b"") for k in keys)
        return [0] * len(keys)

    def get(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        return [0 if k in self.objects else -1 for k in keys]


@pytest.fixture
def dict_backend() -> Iterator[str]:
    register_backend("dict", DictBackend, "a dict in the test")  # the one registration
    try:
        yield "dict"
    finally:
        unregister_backend("dict")


def test_a_registered_backend_is_accepted_by_the_config(dict_backend: str) -> None:
    assert AscendStoreConfig.from_dict({"backend": "Dict"}).backend == "dict"
    assert "dict" in POOL_BACKENDS and list(POOL_BACKENDS)[-1] == "dict"


def test_the_worker_builds_it_with_its_own_factory(dict_backend: str) -> None:
    cfg = AscendStoreConfig.from_dict({"backend": "dict", "max_batch_keys": 7})
    b = create_backend(cfg, PoolContext("m", 16, tp_size=2, tp_rank=1, pp_size=2, pp_rank=1))
    assert isinstance(b, DictBackend)
    assert (b.config, b.rank) == (cfg, 11)
    assert b.put(["k"], [[0]], [[1]]) == [0] and b.exists(["k", "x"]) == [1, 0]


def test_the_docs_and_the_cli_list_it(dict_backend: str, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    # the configuration reference and `vllm-ascend-kv config` render describe()
    (doc,) = [d for d in AscendStoreConfig.describe() if d.key == "backend"]
    assert doc.type == "'local' | 'mooncake' | 'memcache' | 'dict'"
    from vllm_ascend.distributed.kv_transfer.core.tooling import cli

    monkeypatch.setattr(cli, "config_sections", lambda: {"AscendStoreConnector": CONFIG_REF})
    assert cli.main(["config", "AscendStoreConnector", "--json"]) == 0
    keys = json.loads(capsys.readouterr().out)["AscendStoreConnector"]
    assert [k["type"] for k in keys if k["key"] == "backend"] == [doc.type]


def test_an_unregistered_backend_is_refused_naming_the_known_ones(dict_backend: str) -> None:
    unregister_backend("dict")
    with pytest.raises(ConfigError, match="backend: expected one of 'local', 'mooncake', "
                                          "'memcache', got 'dict'"):
        AscendStoreConfig.from_dict({"backend": "dict"})
    with pytest.raises(ValueError, match=r"unknown pool backend 'dict'; expected one of "
                                         r"local, memcache, mooncake$"):
        backend_class("dict")


def test_the_builtin_backends_document_the_key() -> None:
    assert list(backend_names()) == ["local", "mooncake", "memcache"]
    (doc,) = [d for d in AscendStoreConfig.describe() if d.key == "backend"]
    assert "'mooncake' (Mooncake Store)" in doc.doc and "'memcache' (memcache_hybrid)" in doc.doc


def test_registering_by_module_path_imports_nothing_until_used() -> None:
    register_backend("later", "tests_pool_no_such_module:Store")
    try:
        assert "tests_pool_no_such_module" not in sys.modules
        assert AscendStoreConfig.from_dict({"backend": "later"}).backend == "later"
        with pytest.raises(ModuleNotFoundError, match="tests_pool_no_such_module"):
            backend_class("later")
    finally:
        unregister_backend("later")


def test_registration_mistakes_are_clear(dict_backend: str) -> None:
    with pytest.raises(ValueError, match="'dict' is registered already"):
        register_backend("dict", DictBackend)
    with pytest.raises(ValueError, match="is built in"):
        unregister_backend("local")
    with pytest.raises(ValueError, match="must be lower case"):
        register_backend("Bad Name", DictBackend)
    with pytest.raises(ValueError, match="is not 'module:Class'"):
        register_backend("nocolon", "some.module.Class")
    register_backend("notabackend", "json:JSONDecoder")
    try:
        with pytest.raises(TypeError, match="not a subclass of"):
            backend_class("notabackend")
    finally:
        unregister_backend("notabackend")


def test_memcache_takes_its_device_from_the_ranks(fake_memcache: Any) -> None:
    cfg = AscendStoreConfig.from_dict({"backend": "memcache", "memcache_device_type": "a3"})
    b = create_backend(cfg, PoolContext("m", 16, tp_size=4, tp_rank=3, pp_size=2, pp_rank=1),
                       host_memory=False)
    assert isinstance(b, MemcacheBackend)
    assert b.device_id == 7 and ("init", 7) in fake_memcache.CALLS
    b.put(["k"], [[0]], [[0]])
    assert [c[1][1] for c in fake_memcache.CALLS if c[0] == "batch_put_from_layers"] == [0]
    b.close()
