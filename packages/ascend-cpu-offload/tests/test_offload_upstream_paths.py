# SPDX-License-Identifier: Apache-2.0
"""Upstream's cpu_kv_cache_manager and metadata modules, over our host block manager and server."""

from __future__ import annotations

import ast
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload import config, metadata
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_kv_cache_manager import (
    CPUCacheStats,
    CPUKVCacheManager,
    PrefixStats,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager import (
    MetadataClient,
    server,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager.block_manager import (
    BlockState,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.metadata import (
    MetadataServer,
    MetadataServerProc,
    get_cpu_offload_connector,
)

BS = 4


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    sampling_params: Any = field(default_factory=lambda: SimpleNamespace(prompt_logprobs=None))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def cache(manager: CPUKVCacheManager, req: FakeRequest) -> list[int]:
    """Match, allocate, copy (nothing to copy here) and cache one request."""
    manager.get_matched_num_and_touch(req)
    ids = manager.allocate_slots({req.request_id: req.num_tokens}, set())[req.request_id]
    manager.record_request_cache_and_free_slots(req)
    manager.cache_and_free_slots(req.request_id)
    manager.block_manager.check()
    return ids


def test_a_cached_prefix_is_matched_and_the_last_token_is_left_to_compute() -> None:
    m = CPUKVCacheManager(SimpleNamespace(block_size=BS), 8)
    tokens = list(range(100, 109))  # two full blocks and one token
    assert m.get_matched_num_and_touch(FakeRequest("a", tokens)) == (0, False)
    ids = m.allocate_slots({"a": 9}, set())["a"]
    assert len(ids) == 2  # full blocks only
    assert all(m.block_manager.state_of(b) is BlockState.PENDING for b in ids)
    m.record_request_cache_and_free_slots(FakeRequest("a", tokens))
    m.cache_and_free_slots("a")
    assert all(m.block_manager.state_of(b) is BlockState.CACHED for b in ids)
    m.block_manager.check()

    assert m.get_matched_num_and_touch(FakeRequest("b", tokens)) == (8, False)
    # an exactly block-aligned prompt never gets its last block: vLLM computes one token
    assert m.get_matched_num_and_touch(FakeRequest("c", tokens[:8])) == (4, False)
    # touched blocks are pinned: not evictable until freed
    assert m.block_manager.num_evictable == 0
    assert m.allocate_slots({}, {"b", "c"}) == {}
    assert m.block_manager.num_evictable == 2
    m.block_manager.check()


def test_prompt_logprobs_skip_the_cache_and_stats_count_hits() -> None:
    m = CPUKVCacheManager(BS, 8)
    tokens = list(range(13))
    cache(m, FakeRequest("a", tokens))
    req = FakeRequest("p", tokens, SimpleNamespace(prompt_logprobs=1))
    assert m.get_matched_num_and_touch(req) == (0, False)
    assert m.get_matched_num_and_touch(FakeRequest("b", tokens)) == (12, False)
    stats = m.cpu_cache_stats
    assert stats.total.requests == 2 and stats.total.hits == 12
    assert stats.hit_rate == pytest.approx(12 / 26)


def test_a_request_that_does_not_fit_gets_nothing_and_leaks_nothing() -> None:
    m = CPUKVCacheManager(BS, 2)
    req = FakeRequest("big", list(range(13)))  # three full blocks, two host blocks
    m.get_matched_num_and_touch(req)
    assert m.allocate_slots({"big": 13}, set()) == {}
    assert m.block_manager.num_free == 2
    # a failed request stays skipped until it is freed
    assert m.allocate_slots({"big": 13}, set()) == {}
    m.record_request_cache_and_free_slots(req)
    m.cache_and_free_slots("big")
    assert m.block_manager.num_free == 2 and m.block_manager.num_cached == 0
    m.block_manager.check()


def test_unconfirmed_slots_are_given_back_when_the_request_is_dropped() -> None:
    m = CPUKVCacheManager(BS, 4)
    req = FakeRequest("a", list(range(9)))
    m.get_matched_num_and_touch(req)
    assert len(m.allocate_slots({"a": 9}, set())["a"]) == 2
    m.allocate_slots({}, {"a"})  # unallocated: freed, the copies never happened
    assert m.block_manager.num_free == 4
    m.block_manager.check()
    m.cache_and_free_slots("unknown")  # logged, ignored


def test_lru_eviction_makes_room_for_new_prefixes() -> None:
    m = CPUKVCacheManager(BS, 2)
    cache(m, FakeRequest("a", list(range(9))))
    ids = cache(m, FakeRequest("b", list(range(50, 59))))
    assert len(ids) == 2
    assert m.get_matched_num_and_touch(FakeRequest("a2", list(range(9)))) == (0, False)
    assert m.get_matched_num_and_touch(FakeRequest("b2", list(range(50, 59)))) == (8, False)


def test_cpu_cache_stats_log_every_ten_seconds(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    stats = CPUCacheStats(enable_prefix_caching=True, log_stats=True, clock=lambda: now[0])
    stats.update(10, 5)
    assert stats.make_prefix_cache_stats() == PrefixStats(1, 10, 5)
    assert stats.make_prefix_cache_stats() == PrefixStats()
    with caplog.at_level(logging.INFO):
        stats.log()
        assert "hit rate" not in caplog.text
        now[0] = 10.0
        stats.log()
    assert "CPU Prefix cache hit rate: 50.0%" in caplog.text
    off = CPUCacheStats(enable_prefix_caching=False)
    off.update(10, 5)
    assert off.make_prefix_cache_stats() is None and off.hit_rate == 0.0


def _vllm_config(kv: Any, tmp_path: Path, *, prefix_caching: bool = True, tp: int = 1,
                 pp: int = 1) -> Any:
    return SimpleNamespace(
        kv_transfer_config=kv,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                        data_parallel_rank=0),
        cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching, block_size=BS))


def _offload_kv(tmp_path: Path) -> Any:
    extra = {"metadata_endpoint": f"ipc://{tmp_path}/md.ipc", "cpu_swap_space": "64KB"}
    return SimpleNamespace(kv_connector="CPUOffloadingConnector", engine_id="e",
                           kv_connector_extra_config=extra)


def test_get_cpu_offload_connector_finds_it_directly_or_in_a_multi_connector(
        tmp_path: Path) -> None:
    kv = _offload_kv(tmp_path)
    assert get_cpu_offload_connector(_vllm_config(kv, tmp_path)) is kv
    multi = SimpleNamespace(kv_connector="MultiConnector", kv_connector_extra_config={
        "connectors": [{"kv_connector": "MooncakeConnectorV1"},
                       {"kv_connector": "CPUOffloadingConnector",
                        "kv_connector_extra_config": {"cpu_swap_space": "1MB"}}]})
    child = get_cpu_offload_connector(_vllm_config(multi, tmp_path))
    assert child.kv_connector == "CPUOffloadingConnector"
    assert child.kv_connector_extra_config == {"cpu_swap_space": "1MB"}
    other = SimpleNamespace(kv_connector="AscendStoreConnector", kv_connector_extra_config={})
    assert get_cpu_offload_connector(_vllm_config(other, tmp_path)) is None
    assert get_cpu_offload_connector(SimpleNamespace(kv_transfer_config=None)) is None


def test_metadata_server_from_vllm_config_is_our_server(tmp_path: Path) -> None:
    assert MetadataServer is server.MetadataServer
    srv = MetadataServer.from_vllm_config(_vllm_config(_offload_kv(tmp_path), tmp_path, tp=2,
                                                       pp=2))
    try:
        assert srv.world_size == 4 and srv.budget_bytes == 64 << 10
        assert srv.endpoint == f"ipc://{tmp_path}/md.ipc"
    finally:
        srv.shutdown()
    other = SimpleNamespace(kv_connector="AscendStoreConnector", kv_connector_extra_config={})
    with pytest.raises(ValueError, match="names no CPUOffloadingConnector"):
        MetadataServer.from_vllm_config(_vllm_config(other, tmp_path))


#: This package's modules at upstream's file names: vLLM-Ascend's wheel ships its own files
#: there and, installed after ours, overwrites them.
UPSTREAM_PATHS = {"metadata", "cpu_kv_cache_manager"}
PKG = "vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload"


def test_metadata_re_exports_ours() -> None:
    assert metadata.MetadataServer is server.MetadataServer
    assert metadata.MetadataServerProc is server.MetadataServerProc
    assert metadata.get_cpu_offload_connector is config.get_cpu_offload_connector


def _imported_upstream_paths(source: str) -> set[str]:
    """The upstream paths of this package that ``source`` imports (relatively or by name)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level or module.startswith(PKG):
                parts = {*module.split("."), *(a.name for a in node.names)}
                found |= parts & UPSTREAM_PATHS
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PKG):
                    found |= set(alias.name.split(".")) & UPSTREAM_PATHS
    return found


def test_no_module_of_ours_imports_an_upstream_path() -> None:
    """What runs imports only files we ship: an upstream path re-exports ours, never the
    other way (``MetadataServer.from_vllm_config`` once imported ``metadata.py``)."""
    assert _imported_upstream_paths("from ..metadata import x\nfrom . import metadata") == {
        "metadata"}
    root = Path(metadata.__file__).parent
    importers = {str(path.relative_to(root)): found for path in sorted(root.rglob("*.py"))
                 if path.stem not in UPSTREAM_PATHS
                 and (found := _imported_upstream_paths(path.read_text()))}
    assert importers == {}


def test_run_metadata_server_serves_until_stopped_and_cleans_up(tmp_path: Path) -> None:
    vc = _vllm_config(_offload_kv(tmp_path), tmp_path)
    stop = threading.Event()
    t = threading.Thread(target=MetadataServerProc.run_metadata_server, args=(vc, stop),
                         daemon=True)
    t.start()
    client = MetadataClient(f"ipc://{tmp_path}/md.ipc", timeout_s=5.0)
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(tmp_path / "md.ipc") and time.monotonic() < deadline:
            time.sleep(0.02)
        assert client.stats().ready is False  # serving; no rank registered yet
    finally:
        client.close()
        stop.set()
        t.join(10)
    assert not t.is_alive()
    assert not os.path.exists(tmp_path / "md.ipc")


def test_run_metadata_server_does_nothing_without_prefix_caching_or_connector(
        tmp_path: Path) -> None:
    off = _vllm_config(_offload_kv(tmp_path), tmp_path, prefix_caching=False)
    MetadataServerProc.run_metadata_server(off)  # returns at once
    none = _vllm_config(None, tmp_path)
    MetadataServerProc.run_metadata_server(none)
    assert not os.path.exists(tmp_path / "md.ipc")
