# SPDX-License-Identifier: Apache-2.0
"""MooncakeLayerwiseConnector inside vLLM's real Scheduler: request lifecycles on P and D.

The worker side is simulated by the ``KVConnectorOutput`` a worker would report; block
allocation, chunked prefill, WAITING_FOR_REMOTE_KVS, delayed frees and
kv_load_failure_policy are vLLM's own code. D's metaserver posts go to a real HTTP server.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
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
from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.contract import (
    MooncakeLayerwiseConnectorMetadata,
)

BS = 32
NUM_BLOCKS = 64


class Metaserver:
    """The proxy's ``POST /v1/metaserver`` stand-in: records bodies, answers ``statuses``."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        self.posts: list[dict[str, Any]] = []
        self.statuses = list(statuses or [])
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.posts.append(body)
                code = outer.statuses.pop(0) if outer.statuses else 200
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1/metaserver"

    def wait_posts(self, n: int, timeout: float = 5.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while len(self.posts) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        return self.posts

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def metaserver() -> Iterator[Metaserver]:
    m = Metaserver()
    yield m
    m.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ascend_kv_testing.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("model"))


def make_scheduler(model_dir: Path, role: str, policy: str = "fail", *,
                   batch_tokens: int = 1024, **extra: Any) -> Scheduler:
    register()
    mc = ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32",
                     max_model_len=1024, enforce_eager=True, seed=0)
    vc = VllmConfig(
        model_config=mc,
        cache_config=CacheConfig(block_size=BS, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=batch_tokens,
                                         max_model_len=1024, is_encoder_decoder=False,
                                         enable_chunked_prefill=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="MooncakeLayerwiseConnector", kv_role=role,
            engine_id=f"engine-{role}", kv_load_failure_policy=policy,
            kv_connector_extra_config={"metaserver_retries": 1, **extra}),
        device_config=DeviceConfig("cpu"))
    vc.cache_config.num_gpu_blocks = NUM_BLOCKS
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["model.layers.0.self_attn.attn"],
                                                          spec)])
    return Scheduler(vc, kcc, StructuredOutputManager(vc), block_size=BS, log_stats=True)


def request(rid: str, n_tokens: int, kv: dict[str, Any] | None, max_tokens: int = 4, *,
            first: int = 100) -> Request:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                        extra_args={"kv_transfer_params": kv} if kv is not None else None)
    return Request(rid, list(range(first, first + n_tokens)), sp, None,
                   block_hasher=get_request_block_hasher(BS, sha256))


def step(s: Scheduler, *, kv: KVConnectorOutput | None = None) -> tuple[Any, dict[int, Any]]:
    """One engine step: schedule, then feed back a fake model-runner output."""
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    # a request still inside its prompt (chunked prefill) samples nothing this step
    sampled = [[] if s.requests[r].num_computed_tokens < s.requests[r].num_prompt_tokens
               else [7] for r in ids]
    mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=sampled, kv_connector_output=kv)
    return out, s.update_from_output(out, mro)


def finished(engine_outputs: dict[int, Any]) -> dict[str, Any]:
    return {o.request_id: o for outs in engine_outputs.values() for o in outs.outputs
            if o.finish_reason is not None}


def free_blocks(s: Scheduler) -> int:
    return s.kv_cache_manager.block_pool.get_num_free_blocks()


def d_params(url: str, **change: Any) -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, "metaserver": url,
            "request_id": "proxy-1", **change}


# ================================================================================ D side
def test_decode_posts_its_blocks_then_waits_for_the_push(model_dir: Path,
                                                         metaserver: Metaserver) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    req = request("d1", 70, d_params(metaserver.url))
    s.add_request(req)
    out, _ = step(s)
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    meta = out.kv_connector_metadata
    assert isinstance(meta, MooncakeLayerwiseConnectorMetadata)
    m = meta.requests["d1"]
    assert len(m.local_block_ids) == 3 and m.cached_tokens == 0
    assert m.do_virtual is False and m.error is None
    post = metaserver.wait_posts(1)[0]
    assert post["request_id"] == "proxy-1" and post["remote_request_id"] == "d1"
    assert post["remote_block_ids"] == m.local_block_ids and post["remote_block_size"] == BS
    assert post["do_remote_decode"] is True and post["do_remote_prefill"] is False
    assert post["remote_cached_tokens"] == 0 and post["remote_engine_id"] == "engine-kv_consumer"
    # the request's capability goes to P with the post and to D's worker with the metadata
    assert len(m.push_token) >= 32 and post["remote_push_token"] == m.push_token
    assert req.kv_transfer_params["do_remote_prefill"] is False  # never loaded twice
    # the step ran no token (the request waits): the worker may wait for its KV a little
    assert out.total_num_scheduled_tokens == 0 and meta.idle is True
    step(s, kv=KVConnectorOutput(finished_recving={"d1"}))
    out, _ = step(s)
    assert out.num_scheduled_tokens.get("d1") == 1  # only the last prompt token is computed
    assert out.kv_connector_metadata.idle is False


def test_virtual_request_is_not_posted_and_runs_after_its_fake_load(
        model_dir: Path, metaserver: Metaserver) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    v = request("v", 70, d_params(metaserver.url, do_virtual=True))
    o = request("o", 40, d_params(metaserver.url, request_id="proxy-2", do_virtual=False),
                first=500)
    s.add_request(v)
    s.add_request(o)
    out, _ = step(s)
    reqs = out.kv_connector_metadata.requests
    assert reqs["v"].do_virtual is True and reqs["o"].do_virtual is False
    posts = metaserver.wait_posts(1)
    time.sleep(0.2)
    assert [p["request_id"] for p in posts] == ["proxy-2"]  # the virtual one never posted
    # the worker reports the virtual request loaded at once; the other keeps waiting
    step(s, kv=KVConnectorOutput(finished_recving={"v"}))
    out, _ = step(s)
    assert out.num_scheduled_tokens.get("v") == 1 and "o" not in out.num_scheduled_tokens
    assert o.status == RequestStatus.WAITING_FOR_REMOTE_KVS


def test_virtual_blocks_stay_out_of_the_prefix_cache(model_dir: Path,
                                                    metaserver: Metaserver) -> None:
    """A virtual request's blocks hold no real KV: an ordinary request with the same prompt
    must not be served from them."""
    s = make_scheduler(model_dir, "kv_consumer")
    v = request("v", 96, d_params(metaserver.url, do_virtual=True))
    s.add_request(v)
    step(s)
    step(s, kv=KVConnectorOutput(finished_recving={"v"}))
    step(s)  # v runs: its blocks are cached now, under re-keyed hashes
    assert v.num_computed_tokens >= 96
    same = request("same", 96, None)
    assert s.kv_cache_manager.get_computed_blocks(same)[1] == 0  # no prefix hit at all
    s.add_request(same)
    out, _ = step(s)
    assert out.num_scheduled_tokens.get("same") == 96  # computed, not served from v's blocks


@pytest.mark.parametrize("role", ["kv_consumer", "kv_producer"])
@pytest.mark.parametrize("params", [None, {}, {"do_virtual": True}, {"unrelated": 1}])
def test_params_without_a_pd_role_are_ordinary_requests(model_dir: Path, role: str,
                                                        params: Any) -> None:
    """``kv_transfer_params`` None / empty / do_virtual without do_remote_*: plain requests on
    every path (upstream once raised AttributeError on None here)."""
    s = make_scheduler(model_dir, role)
    start = free_blocks(s)
    s.add_request(request("plain", 50, params, max_tokens=1))
    out, eo = step(s)
    assert out.num_scheduled_tokens["plain"] == 50
    meta = out.kv_connector_metadata
    assert not meta.requests and not meta.pushes and not meta.failed_posts
    assert "plain" in finished(eo)
    assert free_blocks(s) == start  # freed at once: nothing held for a peer


@pytest.mark.parametrize(("change", "needle"), [
    ({"metaserver": None}, "'metaserver' must be the proxy's metaserver URL"),
    ({"metaserver": "ftp://x/y"}, "must be an http:// or https:// URL"),
    ({"do_virtual": "no"}, "'do_virtual' must be true or false"),
])
def test_bad_decode_params_fail_only_that_request(model_dir: Path, metaserver: Metaserver,
                                                  change: dict[str, Any], needle: str) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    bad = request("bad", 70, d_params(metaserver.url, **change))
    good = request("good", 40, None, first=600)
    s.add_request(bad)
    s.add_request(good)
    out, _ = step(s)
    m = out.kv_connector_metadata.requests["bad"]
    assert m.error is not None and needle in m.error
    assert out.num_scheduled_tokens.get("good") == 40
    _o, eo = step(s, kv=KVConnectorOutput(finished_recving={"bad"},
                                         invalid_block_ids=set(m.local_block_ids)))
    assert "bad" in finished(eo) and "good" not in finished(eo)
    assert metaserver.posts == []


def test_a_post_that_fails_for_good_reaches_the_worker(model_dir: Path) -> None:
    server = Metaserver(statuses=[503, 503, 503])
    try:
        s = make_scheduler(model_dir, "kv_consumer")  # 1 retry: two attempts
        s.add_request(request("d", 40, d_params(server.url)))
        step(s)
        reasons: dict[str, str] = {}
        deadline = time.monotonic() + 5
        while not reasons and time.monotonic() < deadline:
            out, _ = step(s)
            reasons = out.kv_connector_metadata.failed_posts
            time.sleep(0.02)
        assert "HTTP 503" in reasons["d"] and "2 attempt(s)" in reasons["d"]
        assert len(server.posts) == 2
    finally:
        server.close()


def test_decode_prefix_hit_is_posted_as_cached_tokens(model_dir: Path,
                                                      metaserver: Metaserver) -> None:
    s = make_scheduler(model_dir, "kv_consumer")
    s.add_request(request("warm", 80, None, max_tokens=1))
    step(s)  # computed and cached locally: 2 full blocks
    req = request("d", 80, d_params(metaserver.url))
    s.add_request(req)
    out, _ = step(s)
    m = out.kv_connector_metadata.requests["d"]
    assert m.cached_tokens == 2 * BS and len(m.local_block_ids) == 3
    post = metaserver.wait_posts(1)[0]
    assert post["remote_cached_tokens"] == 2 * BS
    assert post["remote_block_ids"] == m.local_block_ids


# ================================================================================ P side
def p_params(n_tokens: int, *, cached: int = 0, **change: Any) -> dict[str, Any]:
    params = {"do_remote_decode": True, "do_remote_prefill": False,
              "remote_block_ids": list(range(40, 40 + -(-n_tokens // BS))),
              "remote_block_size": BS, "remote_engine_id": "engine-d",
              "remote_host": "127.0.0.1", "remote_port": 31000, "remote_request_id": "d-req",
              "remote_tp_size": 1, "remote_cached_tokens": cached, "request_id": "proxy-1"}
    params.update(change)
    return params


@pytest.mark.parametrize(("cached", "expect"), [
    (0, [[0, 1], [2, 3], [4]]),
    (BS, [[1], [2, 3], [4]]),          # D holds block 0 already
    (3 * BS, [[3], [4]]),              # the first chunk has nothing to push
])
def test_chunked_prefill_is_pushed_chunk_by_chunk(model_dir: Path, cached: int,
                                                  expect: list[list[int]]) -> None:
    s = make_scheduler(model_dir, "kv_producer", batch_tokens=64)
    start = free_blocks(s)
    req = request("p", 150, p_params(150, cached=cached), max_tokens=1)
    s.add_request(req)
    seen: list[tuple[list[int], bool]] = []
    done: dict[str, Any] = {}
    while not done:
        out, eo = step(s)
        push = out.kv_connector_metadata.pushes.get("p")
        assert out.kv_connector_metadata.idle is (out.total_num_scheduled_tokens == 0)
        if push is not None:
            assert push.abort is None and push.target.request_id == "d-req"
            seen.append((push.positions, push.last))
        done = finished(eo)
    assert [p for p, _ in seen] == expect
    assert [last for _, last in seen] == [False] * (len(expect) - 1) + [True]
    assert free_blocks(s) < start  # held until the workers' pushes are over
    step(s, kv=KVConnectorOutput(finished_sending={"p"}))
    assert free_blocks(s) == start


def test_requests_sharing_a_step_push_each_block_once(model_dir: Path) -> None:
    """Two prompts share 64-token steps, so a step ends inside a block: that block goes out
    with the step that fills it (or ends the prompt), not with both."""
    s = make_scheduler(model_dir, "kv_producer", batch_tokens=64)
    lengths = {"a": 50, "b": 90}
    for rid, n in lengths.items():
        s.add_request(request(rid, n, p_params(n, remote_request_id=f"d-{rid}"), max_tokens=1))
    seen: dict[str, list[list[int]]] = {rid: [] for rid in lengths}
    lasts: dict[str, list[bool]] = {rid: [] for rid in lengths}
    ends: dict[str, list[int]] = {rid: [] for rid in lengths}
    done: set[str] = set()
    while done != set(lengths):
        out, eo = step(s)
        for rid, push in out.kv_connector_metadata.pushes.items():
            seen[rid].append(push.positions)
            lasts[rid].append(push.last)
        for rid in out.num_scheduled_tokens:
            ends[rid].append(s.requests[rid].num_computed_tokens)
        done |= set(finished(eo))
    # a step ended inside a block of b (the premise of this test)
    assert any(0 < end < lengths["b"] and end % BS for end in ends["b"]), ends
    for rid, n in lengths.items():
        flat = [j for positions in seen[rid] for j in positions]
        assert sorted(flat) == list(range(-(-n // BS))), (rid, seen[rid])  # each block once
        assert lasts[rid][-1] is True and not any(lasts[rid][:-1])


def test_positions_map_to_the_requests_blocks(model_dir: Path) -> None:
    s = make_scheduler(model_dir, "kv_producer", batch_tokens=64)
    req = request("p", 100, p_params(100), max_tokens=1)
    s.add_request(req)
    pushed: dict[int, int] = {}
    while True:
        out, eo = step(s)
        push = out.kv_connector_metadata.pushes.get("p")
        if push is not None:
            pushed.update(zip(push.positions, push.local_block_ids, strict=True))
        if finished(eo):
            break
    assert pushed == dict(enumerate(s.kv_cache_manager.get_block_ids("p")[0][:4]))


def test_bad_prefill_params_tell_d_at_once_and_free_normally(model_dir: Path) -> None:
    s = make_scheduler(model_dir, "kv_producer")
    start = free_blocks(s)
    s.add_request(request("p", 70, p_params(70, remote_block_ids=[1, 2]), max_tokens=1))
    out, eo = step(s)
    push = out.kv_connector_metadata.pushes["p"]
    assert push.target is None and "'remote_block_ids' has 2 blocks" in (push.abort or "")
    assert push.endpoint == ("127.0.0.1", 31000, "d-req", 1, "engine-d")
    assert "p" in finished(eo)
    assert free_blocks(s) == start  # nothing was pushed: nothing to hold


def test_prefill_aborted_before_scheduling_tells_d(model_dir: Path) -> None:
    s = make_scheduler(model_dir, "kv_producer")
    s.add_request(request("p", 70, p_params(70), max_tokens=1))
    s.finish_requests("p", RequestStatus.FINISHED_ABORTED)
    out = s.schedule()
    push = out.kv_connector_metadata.pushes["p"]
    assert push.abort and "before it was scheduled" in push.abort
    assert push.endpoint == ("127.0.0.1", 31000, "d-req", 1, "engine-d")


def test_decode_aborted_while_waiting_frees_only_after_the_worker_lets_go(
        model_dir: Path, metaserver: Metaserver) -> None:
    """P may still be writing into an aborted request's blocks: vLLM keeps them until the
    worker reports the request (which it does once no write lease is left)."""
    s = make_scheduler(model_dir, "kv_consumer")
    start = free_blocks(s)
    s.add_request(request("d", 70, d_params(metaserver.url)))
    step(s)
    s.finish_requests("d", RequestStatus.FINISHED_ABORTED)
    out, _ = step(s)
    assert "d" in out.finished_req_ids  # what the worker sees in get_finished
    assert free_blocks(s) < start and "d" in s.requests
    step(s, kv=KVConnectorOutput(finished_recving={"d"}))
    assert free_blocks(s) == start and "d" not in s.requests
