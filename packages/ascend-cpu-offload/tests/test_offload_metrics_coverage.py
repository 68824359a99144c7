# SPDX-License-Identifier: Apache-2.0
"""Metrics the observability issue asks of every connector: lookup latency, load batch bytes
and expired save leases, recorded where they happen (real metadata server, real host pool)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.contract import (
    CPUOffloadingConnectorMetadata,
    HostLoad,
    HostSave,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager import (
    MetadataClient,
    MetadataServer,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager.protocol import (
    RegisterRank,
    SaveRequest,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.metrics import OFFLOAD_METRICS
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.scheduler import CPUOffloadScheduler
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.worker import CPUOffloadWorker

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def server(tmp_path: Any, clock: Clock) -> Iterator[MetadataServer]:
    srv = MetadataServer(f"ipc://{tmp_path}/meta.ipc", world_size=1, budget_bytes=64 * 1024,
                         save_ttl=5.0, segment_dir=str(tmp_path / "shm"), clock=clock).start()
    c = MetadataClient(srv.endpoint)
    c.register(RegisterRank(rank=0, world_size=1, layer_names=["l0"], layer_block_bytes=[1024]),
               timeout_s=5)
    c.attached(0)
    c.close()
    yield srv
    srv.stop()


@pytest.fixture
def sched(server: MetadataServer, make_vllm_config: Callable[..., Any],
          offload_cfg: Callable[..., Any]) -> Iterator[CPUOffloadScheduler]:
    vc = make_vllm_config({"metadata_endpoint": server.endpoint}, block_size=BS)
    s = CPUOffloadScheduler(vc, offload_cfg(vc), None, MetricsRecorder(OFFLOAD_METRICS))
    yield s
    s.shutdown()


def request(rid: str, tokens: list[int]) -> Any:
    return SimpleNamespace(request_id=rid, all_token_ids=tokens, num_prompt_tokens=len(tokens),
                           num_computed_tokens=0, lora_request=None, cache_salt=None,
                           mm_features=[], prompt_embeds=None, num_tokens=len(tokens))


def step(s: CPUOffloadScheduler, req: Any, blocks: list[int]) -> CPUOffloadingConnectorMetadata:
    ext, _ = s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), ext)
    return s.build_connector_meta(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=req.request_id, block_ids=(blocks,))],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens={req.request_id: req.num_tokens - ext}, preempted_req_ids=None))


def test_lookup_latency_is_observed_per_lookup(sched: CPUOffloadScheduler) -> None:
    step(sched, request("a", list(range(100, 113))), [0, 1, 2, 3])
    sched.get_num_new_matched_tokens(request("b", list(range(100, 113))), 0)
    lookups = sched.recorder.take()["histograms"]["offload_lookup_seconds"]
    assert len(lookups) == 2 and all(0 <= t < 5 for t in lookups)


def test_expired_save_leases_are_counted_once(sched: CPUOffloadScheduler, clock: Clock) -> None:
    # a save job no rank ever confirms (the rank died): its lease lapses after save_ttl
    meta = step(sched, request("a", list(range(200, 213))), [0, 1, 2, 3])
    assert len(meta.saves) == 1
    clock.now += 10.0
    step(sched, request("b", list(range(300, 309))), [4, 5, 6])
    assert sched.recorder.total("offload_expired_saves") == 1
    step(sched, request("c", list(range(400, 409))), [7, 8, 9])
    assert sched.recorder.total("offload_expired_saves") == 1  # reported as a delta


@pytest.fixture
def worker(make_vllm_config: Callable[..., Any], offload_cfg: Callable[..., Any]
           ) -> Iterator[CPUOffloadWorker]:
    from vllm_ascend.distributed.kv_transfer.core.ranks import RankInfo

    vc = make_vllm_config(None, block_size=BS)
    w = CPUOffloadWorker(vc, offload_cfg(vc), None, MetricsRecorder(OFFLOAD_METRICS),
                         rank_info=RankInfo())
    yield w
    w.shutdown()


def test_load_batch_bytes_match_the_bytes_loaded(worker: CPUOffloadWorker) -> None:
    caches = {f"l{i}": torch.randn(16, 2, BS, 8) for i in range(2)}
    worker.register_kv_caches(caches)
    hashes = [hashlib.sha256(f"x{i}".encode()).digest() for i in range(3)]
    client = MetadataClient(worker.endpoint)
    (planned,) = client.plan_step([SaveRequest(key="r1", hashes=hashes)], [], owner="test").saves
    client.close()
    save = HostSave(req_id="r1", job_id=planned.job_id, host_ids=planned.block_ids,
                    device_ids=[[3, 4, 7][p] for p in planned.positions])
    meta = CPUOffloadingConnectorMetadata(saves=[save])
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    assert worker.drain(5)
    meta2 = CPUOffloadingConnectorMetadata(
        loads=[HostLoad(req_id="r2", host_ids=save.host_ids, device_ids=[0, 1, 2])])
    worker.start_load_kv(meta2)
    for name in caches:
        worker.wait_for_layer_load(name)
    worker.wait_for_save(meta2)
    data = worker.recorder.take()
    (batch,) = data["histograms"]["offload_load_batch_bytes"]
    block_bytes = sum(t[0].numel() * t.element_size() for t in caches.values())
    assert batch == data["counters"]["offload_load_bytes"] == 3 * block_bytes
