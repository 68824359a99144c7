# SPDX-License-Identifier: Apache-2.0
"""MooncakeConnectorV1 inside vLLM's real Scheduler: request lifecycles on P and on D.

The worker side is simulated by the ``KVConnectorOutput`` a worker would report;
everything else (block allocation, WAITING_FOR_REMOTE_KVS, delayed frees,
kv_load_failure_policy) is vLLM's own code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from vllm_ascend.distributed.kv_transfer.kv_p2p import register
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import (
    MooncakeConnectorMetadata,
)

BS = 32
NUM_BLOCKS = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ascend_kv_testing.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("model"))


def make_scheduler(model_dir: Path, role: str, policy: str = "fail") -> Scheduler:
    register()
    mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                     max_model_len=1024, enforce_eager=True, seed=0)
    vc = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024,
                                         max_model_len=1024, is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MooncakeConnectorV1", kv_role=role, engine_id=f"engine-{role}",
            kv_load_failure_policy=policy,
            kv_connector_extra_config={"lease_ttl_s": 30}),
        device_config=DeviceConfig("cpu"))
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"],
                                                          spec)])
    return Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=BS, log_stats=True)


def request(rid: str, n_tokens: int, kv: dict[str, Any] | None, max_tokens: int = 4) -> Request:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                        extra_args={"kv_transfer_params": kv} if kv is not None else None)
    return Request(rid, list(range(100, 100 + n_tokens)), sp, None,
                   block_hasher=get_request_block_hasher(BS, sha256))


def remote_params(n_tokens: int, **change: Any) -> dict[str, Any]:
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_block_ids": list(range(10, 10 + -(-n_tokens // BS))),
              "remote_engine_id": "engine-p", "remote_host": "127.0.0.1", "remote_port": 30000,
              "remote_request_id": "p-req", "remote_tp_size": 1}
    params.update(change)
    return params


def step(s: Scheduler, *, sampled: dict[str, int] | None = None,
         kv: KVConnectorOutput | None = None) -> tuple[Any, dict[int, Any]]:
    """One engine step: schedule, then feed back a fake model-runner output."""
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = sampled or {}
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=[[sampled.get(r, 7)] for r in ids],
                            kv_connector_output=kv)
    return out, s.update_from_output(out, mro)


def finished(engine_outputs: dict[int, Any]) -> dict[str, Any]:
    res = {}
    for outs in engine_outputs.values():
        for o in outs.outputs:
            if o.finish_reason is not None:
                res[o.request_id] = o
    return res


def free_blocks(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def test_decode_pulls_then_runs(model_dir: Path) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    req = request("d1", 70, remote_params(70))
    s.add_request(req)
    out, _ = step(s)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    meta = out.kv_connector_metadata
    assert isinstance(meta, MooncakeConnectorMetadata)
    m = meta.requests["d1"]
    assert len(m.local_block_ids) == 3 and m.remote_block_ids == [10, 11, 12] and m.error is None
    assert req.kv_transfer_params["do_remote_prefill"] is False  # never pulled twice
    # the worker reports the load done: next step computes only the last prompt token
    step(s, kv=KVConnectorOutput(finished_recving={"d1"}))
    out, _ = step(s)
    assert out.num_scheduled_tokens.get("d1") == 1
    assert req.num_computed_tokens >= 69


@pytest.mark.parametrize(("policy", "expect_error"), [("fail", True), ("recompute", False)])
def test_failed_load_follows_the_policy(model_dir: Path, policy: str, expect_error: bool) -> None:
    s = make_scheduler(model_dir, "kv_consumer", policy)
    req = request("d2", 70, remote_params(70))
    s.add_request(req)
    out, _ = step(s)
    local = out.kv_connector_metadata.requests["d2"].local_block_ids
    _out, eo = step(s, kv=KVConnectorOutput(finished_recving={"d2"},
                                           invalid_block_ids=set(local)))
    if expect_error:
        done = finished(eo)
        assert done["d2"].finish_reason is not None and str(done["d2"].finish_reason) in (
            "error", "FinishReason.ERROR", "4")
        assert "d2" not in s.requests or s.requests["d2"].is_finished()
    else:
        out, _ = step(s)
        assert out.num_scheduled_tokens.get("d2") == 70  # recomputed locally


@pytest.mark.parametrize("change", [
    {"remote_block_ids": [1, 2, 3, 4, 5]},     # longer than the prompt needs
    {"remote_block_ids": [1, -1, 2]},
    {"remote_port": "x"},
    {"remote_host": None},
])
def test_malformed_params_fail_only_that_request(model_dir: Path, change: dict[str, Any]) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    bad = request("bad", 70, remote_params(70, **change))
    good = request("good", 40, None)
    s.add_request(bad)
    s.add_request(good)
    out, _ = step(s)
    m = out.kv_connector_metadata.requests["bad"]
    assert m.error and m.remote is None
    assert out.num_scheduled_tokens.get("good") == 40  # the other request runs normally
    _o, eo = step(s, kv=KVConnectorOutput(finished_recving={"bad"},
                                         invalid_block_ids=set(m.local_block_ids)))
    assert "bad" in finished(eo)
    assert "good" not in finished(eo)


def test_abort_before_allocation_releases_p(model_dir: Path) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    req = request("d3", 70, remote_params(70))
    s.add_request(req)
    s.finish_requests("d3", RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    m = out.kv_connector_metadata.requests["d3"]
    assert m.release_only and m.remote is not None and m.remote.request_id == "p-req"


def test_prefill_holds_blocks_until_decode_is_done(model_dir: Path) -> None:
    s = make_scheduler(model_dir, "kv_producer")
    start_free = free_blocks(s)
    req = request("p1", 70, {"do_remote_decode": True, "do_remote_prefill": False},
                  max_tokens=1)
    s.add_request(req)
    _out, eo = step(s, sampled={"p1": 42})
    out = finished(eo)["p1"]
    params = out.kv_transfer_params
    assert params["do_remote_prefill"] is True and params["remote_request_id"] == "p1"
    assert len(params["remote_block_ids"]) == 3 and params["last_token_id"] == 42
    assert params["remote_engine_id"] == "engine-kv_producer"
    assert free_blocks(s) < start_free  # still held for D
    out2, _ = step(s)
    sends = out2.kv_connector_metadata.requests_to_send
    assert sends["p1"].block_ids == params["remote_block_ids"]
    step(s, kv=KVConnectorOutput(finished_sending={"p1"}))
    assert free_blocks(s) == start_free


def test_prefill_without_remote_decode_frees_at_once(model_dir: Path) -> None:
    s = make_scheduler(model_dir, "kv_producer")
    start_free = free_blocks(s)
    s.add_request(request("p2", 70, None, max_tokens=1))
    _out, eo = step(s)
    assert finished(eo)["p2"].kv_transfer_params is None
    assert free_blocks(s) == start_free
