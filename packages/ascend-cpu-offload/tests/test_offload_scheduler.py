# SPDX-License-Identifier: Apache-2.0
"""Scheduler side against a real metadata server, with stand-ins for vLLM's request objects."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

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


@dataclass
class FakeRequest:
    """The attributes of ``vllm.v1.request.Request`` the scheduler side reads."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    lora_request: Any = None
    cache_salt: str | None = None
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or len(self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class FakeBlocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.ids),)


def sched_output(new: list[tuple[FakeRequest, list[int]]] = (),  # type: ignore[assignment]
                 cached: list[tuple[FakeRequest, list[int] | None]] = (),  # type: ignore[assignment]
                 scheduled: dict[str, int] | None = None, preempted: set[str] | None = None,
                 resumed: set[str] | None = None) -> Any:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=(ids,))
                            for r, ids in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r.request_id for r, _ in cached],
            new_block_ids=[(ids,) if ids is not None else None for _, ids in cached],
            resumed_req_ids=resumed or set()),
        num_scheduled_tokens=scheduled or {},
        preempted_req_ids=preempted)


@pytest.fixture
def server(tmp_path: Any) -> Iterator[MetadataServer]:
    srv = MetadataServer(f"ipc://{tmp_path}/meta.ipc", world_size=1, budget_bytes=64 * 1024,
                         segment_dir=str(tmp_path / "shm")).start()
    c = MetadataClient(srv.endpoint)
    c.register(RegisterRank(rank=0, world_size=1, layer_names=["l0"], layer_block_bytes=[1024]),
               timeout_s=5)
    c.attached(0)
    c.close()
    yield srv
    srv.stop()


@pytest.fixture
def make_sched(server: MetadataServer, make_vllm_config: Callable[..., Any],
               offload_cfg: Callable[..., Any]) -> Iterator[Callable[..., CPUOffloadScheduler]]:
    made: list[CPUOffloadScheduler] = []

    def make(**extra: Any) -> CPUOffloadScheduler:
        vc = make_vllm_config({"metadata_endpoint": server.endpoint, **extra}, block_size=BS)
        s = CPUOffloadScheduler(vc, offload_cfg(vc), None, MetricsRecorder(OFFLOAD_METRICS))
        made.append(s)
        return s

    yield make
    for s in made:
        s.shutdown()


def confirm_all(meta: CPUOffloadingConnectorMetadata, endpoint: str) -> None:
    """Play the worker: confirm every save job of a step."""
    c = MetadataClient(endpoint)
    c.save_done(0, [s.job_id for s in meta.saves])
    c.close()


def run_prefill(s: CPUOffloadScheduler, req: FakeRequest, blocks: list[int], endpoint: str,
                num_computed: int = 0) -> tuple[int, CPUOffloadingConnectorMetadata]:
    """One admission + one step that computes the whole prompt, the way vLLM drives it."""
    ext, is_async = s.get_num_new_matched_tokens(req, num_computed)
    assert is_async is False
    s.update_state_after_alloc(req, FakeBlocks(blocks), ext)
    req.num_computed_tokens = num_computed + ext
    meta = s.build_connector_meta(sched_output(
        new=[(req, blocks)], scheduled={req.request_id: req.num_tokens - req.num_computed_tokens}))
    confirm_all(meta, endpoint)
    req.num_computed_tokens = req.num_tokens
    return ext, meta


def pool_stats(server: MetadataServer) -> Any:
    c = MetadataClient(server.endpoint)
    try:
        return c.stats()
    finally:
        c.close()


def test_cold_prompt_saves_every_full_block_and_holds_its_blocks(
        make_sched: Callable[..., CPUOffloadScheduler], server: MetadataServer) -> None:
    s = make_sched()
    req = FakeRequest("a", list(range(100, 118)))  # 18 tokens: 4 full blocks + 2
    ext, meta = run_prefill(s, req, [10, 11, 12, 13, 14], server.endpoint)
    assert ext == 0 and meta.loads == []
    (save,) = meta.saves
    assert save.req_id == "a" and save.device_ids == [10, 11, 12, 13]
    assert pool_stats(server).cached_blocks == 4
    assert s.request_finished(req, []) == (True, None), "saves may still read its blocks"
    assert s.recorder.total("offload_miss_tokens") == 18


def test_repeated_prompt_loads_beyond_the_device_hit(make_sched: Callable[..., CPUOffloadScheduler],
                                                     server: MetadataServer) -> None:
    s = make_sched()
    prompt = list(range(200, 217))  # 17 = 4 * 4 + 1: the hit covers every block
    run_prefill(s, FakeRequest("a", prompt), [0, 1, 2, 3, 4], server.endpoint)
    b = FakeRequest("b", list(prompt))
    ext, meta = run_prefill(s, b, [7, 8, 9, 5, 6], server.endpoint)
    assert ext == 16
    (load,) = meta.loads
    assert load.device_ids == [7, 8, 9, 5] and not load.sync_tail
    assert meta.saves == [], "everything was in host memory already"
    assert s.request_finished(b, []) == (False, None)
    # with 8 tokens on the device (vLLM's own prefix cache) only the rest is offered
    c = FakeRequest("c", list(prompt))
    ext, meta = run_prefill(s, c, [20, 21, 22, 23, 24], server.endpoint, num_computed=8)
    assert ext == 8 and meta.loads[0].device_ids == [22, 23]
    assert s.recorder.total("offload_hit_tokens") == 24
    assert pool_stats(server).pinned_blocks == 0, "the step's pins are released"


def test_full_block_aligned_hit_leaves_the_last_token_to_compute(
        make_sched: Callable[..., CPUOffloadScheduler], server: MetadataServer) -> None:
    s = make_sched()
    prompt = list(range(300, 316))  # 16 tokens: 4 full blocks, nothing after
    run_prefill(s, FakeRequest("a", prompt), [0, 1, 2, 3], server.endpoint)
    b = FakeRequest("b", list(prompt))
    ext, meta = run_prefill(s, b, [4, 5, 6, 7], server.endpoint)
    assert ext == 15, "vLLM must compute at least one token"
    (load,) = meta.loads
    assert load.device_ids == [4, 5, 6, 7] and load.sync_tail, \
        "the last block is loaded before the forward rewrites its last token"


def test_threshold_and_unadmitted_requests_release_their_pins(
        make_sched: Callable[..., CPUOffloadScheduler], server: MetadataServer) -> None:
    s = make_sched(swap_in_threshold=9)
    prompt = list(range(400, 413))  # 13 tokens, 3 blocks
    run_prefill(s, FakeRequest("a", prompt), [0, 1, 2, 3], server.endpoint)
    short = FakeRequest("b", list(prompt))
    assert s.get_num_new_matched_tokens(short, 4) == (0, False), "8 < threshold 9"
    assert s.get_num_new_matched_tokens(short, 0) == (12, False)
    # vLLM did not admit it this step (no update_state_after_alloc): the pin goes at step end
    assert pool_stats(server).pinned_blocks == 3
    s.build_connector_meta(sched_output())
    assert pool_stats(server).pinned_blocks == 0


def test_decode_blocks_are_saved_as_they_fill(make_sched: Callable[..., CPUOffloadScheduler],
                                              server: MetadataServer) -> None:
    s = make_sched()
    req = FakeRequest("a", list(range(500, 507)))  # 7 tokens: 1 full block
    _, meta = run_prefill(s, req, [0, 1], server.endpoint)
    assert [x.device_ids for x in meta.saves] == [[0]]
    saved = []
    for step, tok in enumerate([1, 2, 3, 4]):
        req.all_token_ids.append(tok)  # the token sampled last step is this step's input
        new_blocks = [2] if req.num_tokens > 8 and step == 1 else None
        meta = s.build_connector_meta(sched_output(cached=[(req, new_blocks)],
                                                   scheduled={"a": 1}))
        confirm_all(meta, server.endpoint)
        req.num_computed_tokens += 1
        saved += [x.device_ids for x in meta.saves]
    assert saved == [[1]], "block 1 is saved in the step that computes its last token"


def test_decode_saves_can_be_disabled(make_sched: Callable[..., CPUOffloadScheduler],
                                      server: MetadataServer) -> None:
    s = make_sched(save_decode_blocks=False)
    req = FakeRequest("a", list(range(600, 606)))
    run_prefill(s, req, [0, 1], server.endpoint)
    req.all_token_ids += [1, 2, 3]
    meta = s.build_connector_meta(sched_output(cached=[(req, None)], scheduled={"a": 3}))
    assert meta.saves == []


def test_spec_decode_tokens_beyond_the_known_tokens_are_not_saved(
        make_sched: Callable[..., CPUOffloadScheduler], server: MetadataServer) -> None:
    s = make_sched()
    req = FakeRequest("a", list(range(700, 707)))
    run_prefill(s, req, [0, 1, 2], server.endpoint)
    # 1 real token + 3 drafts scheduled: block 1 would be full only with the drafts
    meta = s.build_connector_meta(sched_output(cached=[(req, None)], scheduled={"a": 4}))
    assert meta.saves == []


def test_lora_and_cache_salt_separate_the_caches(make_sched: Callable[..., CPUOffloadScheduler],
                                                 server: MetadataServer) -> None:
    s = make_sched()
    prompt = list(range(800, 809))
    run_prefill(s, FakeRequest("a", prompt, cache_salt="alice"), [0, 1, 2], server.endpoint)
    assert s.get_num_new_matched_tokens(FakeRequest("b", list(prompt), cache_salt="bob"), 0)[0] == 0
    assert s.get_num_new_matched_tokens(FakeRequest("c", list(prompt)), 0)[0] == 0
    lora = SimpleNamespace(lora_name="adapter")
    assert s.get_num_new_matched_tokens(FakeRequest("d", list(prompt), lora_request=lora),
                                        0)[0] == 0
    assert s.get_num_new_matched_tokens(FakeRequest("e", list(prompt), cache_salt="alice"),
                                        0)[0] == 8


def test_multimodal_requests_are_left_alone(make_sched: Callable[..., CPUOffloadScheduler],
                                            server: MetadataServer) -> None:
    s = make_sched()
    req = FakeRequest("a", list(range(900, 912)), mm_features=[object()])
    ext, meta = run_prefill(s, req, [0, 1, 2], server.endpoint)
    assert ext == 0 and meta.saves == [] and s.request_finished(req, []) == (False, None)


def test_preemption_and_resume(make_sched: Callable[..., CPUOffloadScheduler],
                               server: MetadataServer) -> None:
    s = make_sched()
    req = FakeRequest("a", list(range(1000, 1010)))
    run_prefill(s, req, [0, 1, 2], server.endpoint)
    meta = s.build_connector_meta(sched_output(preempted={"a"}))
    assert meta.preempted_req_ids == {"a"}
    # resumed with new blocks: its save scan starts over, nothing is saved twice
    req.num_computed_tokens = 8
    req.all_token_ids += [5, 6]
    meta = s.build_connector_meta(sched_output(cached=[(req, [7, 8, 9])], scheduled={"a": 4},
                                               resumed={"a"}))
    assert [x.device_ids for x in meta.saves] == [[9]]


def test_a_dead_server_means_no_hits_no_saves_and_no_waiting(
        make_vllm_config: Callable[..., Any], offload_cfg: Callable[..., Any],
        tmp_path: Any) -> None:
    vc = make_vllm_config({"metadata_endpoint": f"ipc://{tmp_path}/dead.ipc",
                           "rpc_timeout_s": 0.2, "retry_after_s": 60}, block_size=BS)
    s = CPUOffloadScheduler(vc, offload_cfg(vc), None, MetricsRecorder(OFFLOAD_METRICS))
    req = FakeRequest("a", list(range(20)))
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    s.update_state_after_alloc(req, FakeBlocks([0, 1, 2, 3, 4]), 0)
    start = time.monotonic()
    meta = s.build_connector_meta(sched_output(new=[(req, [0, 1, 2, 3, 4])], scheduled={"a": 20}))
    assert meta.saves == [] and time.monotonic() - start < 0.1, "no second wait on a dead server"
    assert s.request_finished(req, []) == (False, None)
    assert s.recorder.total("offload_failures", op="lookup") == 1
    s.shutdown()



def test_admitting_more_than_offered_becomes_load_errors_not_a_crash(
        make_sched: Callable[..., CPUOffloadScheduler], server: MetadataServer) -> None:
    s = make_sched()
    prompt = list(range(1100, 1113))  # 3 full blocks
    run_prefill(s, FakeRequest("a", prompt[:8] + [1, 2, 3, 4, 5]), [0, 1, 2, 3], server.endpoint)
    b = FakeRequest("b", list(prompt))
    assert s.get_num_new_matched_tokens(b, 0) == (8, False), "2 blocks in common"
    s.update_state_after_alloc(b, FakeBlocks([4, 5, 6, 7]), 12)  # vLLM takes 12 anyway
    (load,) = s.build_connector_meta(sched_output(new=[(b, [4, 5, 6, 7])],
                                                  scheduled={"b": 1})).loads
    assert load.device_ids == [4, 5] and load.failed_ids == [6] and not load.sync_tail
