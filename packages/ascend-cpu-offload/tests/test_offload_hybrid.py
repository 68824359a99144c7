# SPDX-License-Identifier: Apache-2.0
"""CPUOffloadingConnector's scheduler side under vLLM's hybrid KV cache manager: a
sliding-window group (window of 2 blocks) and a full-attention group, against a real metadata
server. What is saved per group (a window's: the blocks vLLM keeps), what a hit is (the longest
prefix every group serves), what is loaded into which device blocks, asynchronously, and the
wait for a queued save of a window's block vLLM gives out again. The bytes on engines:
``tests-e2e/test_hybrid_offload_e2e.py``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from vllm_ascend.distributed.kv_transfer.core.kv_groups import NULL_BLOCK, KVGroups
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.contract import (
    CPUOffloadingConnectorMetadata,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager import (
    MetadataClient,
    MetadataServer,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager.protocol import (
    RegisterRank,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.metrics import OFFLOAD_METRICS
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.scheduler import CPUOffloadScheduler

BS = 4
WINDOW = 2 * BS
SWA, FULL = 0, 1


class FakeRequest:
    """The attributes of ``vllm.v1.request.Request`` the scheduler side reads."""

    def __init__(self, request_id: str, tokens: list[int]) -> None:
        self.request_id = request_id
        self.all_token_ids = tokens
        self.num_prompt_tokens = len(tokens)
        self.num_computed_tokens = 0
        self.lora_request = self.cache_salt = self.prompt_embeds = None
        self.mm_features: list[Any] = []

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def confirm_all(meta: CPUOffloadingConnectorMetadata, endpoint: str) -> None:
    """Play the worker: confirm every save job of a step."""
    c = MetadataClient(endpoint)
    c.save_done(0, [s.job_id for s in meta.saves])
    c.close()


def hybrid_config() -> KVCacheConfig:
    spec = {"block_size": BS, "num_kv_heads": 2, "head_size": 8, "dtype": torch.float32}
    return KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn"],
                         SlidingWindowSpec(**spec, sliding_window=WINDOW)),
        KVCacheGroupSpec(["model.layers.1.self_attn.attn"], FullAttentionSpec(**spec))])


GROUPS = KVGroups.from_config(hybrid_config())


class Blocks:
    def __init__(self, ids: list[list[int]]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(list(g) for g in self.ids)


def step(new: list[tuple[FakeRequest, list[list[int]]]] = (),  # type: ignore[assignment]
         scheduled: dict[str, int] | None = None,
         cached: list[tuple[str, list[list[int]]]] = ()) -> Any:  # type: ignore[assignment]
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=tuple(ids))
                            for r, ids in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[r for r, _ in cached],
                                              new_block_ids=[tuple(ids) for _, ids in cached],
                                              resumed_req_ids=set()),
        num_scheduled_tokens=scheduled or {}, preempted_req_ids=None)


@pytest.fixture
def server(tmp_path: Any) -> Iterator[MetadataServer]:
    srv = MetadataServer(f"ipc://{tmp_path}/meta.ipc", world_size=1, budget_bytes=256 * 1024,
                         segment_dir=str(tmp_path / "shm")).start()
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
    s = CPUOffloadScheduler(vc, offload_cfg(vc), hybrid_config(), MetricsRecorder(OFFLOAD_METRICS))
    yield s
    s.shutdown()


def prompt(rid: str, n: int, seed: int = 0) -> FakeRequest:
    return FakeRequest(rid, [(seed * 7919 + i * 31) % 1000 + 1 for i in range(n)])


def prefill(s: CPUOffloadScheduler, req: FakeRequest, ids: list[list[int]], endpoint: str) -> Any:
    """A prompt computed in one step (vLLM taking no hit), its saves confirmed, the request
    finished."""
    s.get_num_new_matched_tokens(req, 0)
    s.update_state_after_alloc(req, Blocks(ids), 0)
    meta = s.build_connector_meta(step([(req, ids)], {req.request_id: req.num_tokens}))
    confirm_all(meta, endpoint)
    req.num_computed_tokens = req.num_tokens
    assert s.request_finished(req, tuple(ids))[0]
    return meta


def test_saves_each_group_and_a_second_request_loads_what_every_group_serves(
        sched: CPUOffloadScheduler, server: MetadataServer) -> None:
    n = 10 * BS + 2
    swa = list(range(1, 12))
    full = list(range(20, 31))
    assert sched.get_num_new_matched_tokens(prompt("a", n), 0) == (0, False)
    meta = prefill(sched, prompt("a", n), [swa, full], server.endpoint)
    # both groups' full blocks, each a host block of its own
    assert sorted((s.device_ids[0], len(s.device_ids)) for s in meta.saves) == [(1, 10), (20, 10)]
    assert len({h for s in meta.saves for h in s.host_ids}) == 20

    again = prompt("b", n)
    ext, is_async = sched.get_num_new_matched_tokens(again, 0)
    assert ext == 10 * BS and is_async  # the full blocks; loaded between steps
    kept = GROUPS.groups[SWA].first_kept(ext)
    assert kept == 8
    ids = [[NULL_BLOCK] * kept + [40, 41, 42], list(range(50, 61))]
    sched.update_state_after_alloc(again, Blocks(ids), ext)
    load_meta = sched.build_connector_meta(step())
    (load,) = load_meta.loads
    assert load.is_async and not load.failed_ids and not load.sync_tail
    # of the window's group only the two blocks vLLM keeps, into their device blocks, with
    # the host blocks the first request's saves of those positions went to
    assert load.device_ids == [40, 41] + list(range(50, 60))
    saved = {d: h for s in meta.saves for d, h in zip(s.device_ids, s.host_ids, strict=True)}
    assert load.host_ids == [saved[swa[8]], saved[swa[9]]] + [saved[f] for f in full[:10]]


def test_a_missing_window_block_shortens_the_hit(sched: CPUOffloadScheduler,
                                                 server: MetadataServer) -> None:
    n = 10 * BS + 2
    # 9 blocks of both groups in host memory, then the 10th of the full group only (its
    # request had the window's block 9 freed: nothing of the window saved there)
    prefill(sched, prompt("a", 9 * BS + 2, seed=1), [list(range(1, 11)), list(range(20, 30))],
            server.endpoint)
    meta = prefill(sched, prompt("b", n, seed=1),
                   [[NULL_BLOCK] * 10 + [11], list(range(30, 41))], server.endpoint)
    assert [s.device_ids for s in meta.saves] == [[39]]
    # the full group serves 10 blocks, but 40 tokens need the window's blocks 8 and 9: the hit
    # is 36 tokens, whose window needs blocks 7 and 8
    ext, is_async = sched.get_num_new_matched_tokens(prompt("c", n, seed=1), 0)
    assert (ext, is_async) == (9 * BS, True)


def test_saves_skip_the_null_block_and_a_reused_window_block_waits_for_its_save(
        sched: CPUOffloadScheduler, server: MetadataServer) -> None:
    req = prompt("a", 4 * BS, seed=2)
    sched.get_num_new_matched_tokens(req, 0)
    ids = [[NULL_BLOCK, NULL_BLOCK, 5, 6], [1, 2, 3, 4]]
    sched.update_state_after_alloc(req, Blocks(ids), 0)
    meta = sched.build_connector_meta(step([(req, ids)], {"a": 4 * BS}))
    assert sorted(s.device_ids for s in meta.saves) == [[1, 2, 3, 4], [5, 6]]
    other = prompt("b", BS, seed=3)
    sched.get_num_new_matched_tokens(other, 0)
    sched.update_state_after_alloc(other, Blocks([[9], [5]]), 0)
    assert sched.build_connector_meta(step([(other, [[9], [5]])], {"b": BS})).wait_saves == {"a"}
    later = sched.build_connector_meta(step(cached=[("b", [[5], [7]])], scheduled={"b": 1}))
    assert later.wait_saves == set()  # waited for once
