# SPDX-License-Identifier: Apache-2.0
"""The connectors' metrics on real ``vllm serve`` ``/metrics`` endpoints, and the pool's KV
cache events on vLLM's own ZeroMQ event stream.

* P/D (``MooncakeConnectorV1``): a prefill and a decode ``vllm serve`` behind
  ``vllm-ascend-pd-proxy``; after a batch of prompts, D's and P's ``vllm:ascend_kv_p2p_*``
  series hold exactly what moved: requests loaded and served, KV bytes equal to the prompts'
  blocks times the model's block size, one transfer-time and one request-bytes observation
  per request, no failures, nothing left held or pending.
* KV pool (``AscendStoreConnector``, embedded ``local`` backend, small capacity): a prompt is
  saved, loaded back from the pool after the device prefix cache was reset (same tokens), and
  its last two blocks pushed out by another prompt (prefix-aware eviction, the default);
  ``vllm:ascend_kv_pool_*`` count the tokens asked, hit and
  missed, blocks and bytes saved and loaded, lookups and their latency, and vLLM's event
  publisher carries the pool's ``BlockStored`` / ``BlockRemoved`` (``medium: "cpu"``) under the
  same block hashes as the engine's own device-cache events.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.models import make_served_llama, tiny_llama_block_bytes
from ascend_kv_testing.pd import prompts_of as prompts
from ascend_kv_testing.procs import free_port
from ascend_kv_testing.serving import BLOCK_SIZE as BS
from ascend_kv_testing.serving import HOST, Server, completion, proxy, token_ids, vllm_serve
from ascend_kv_testing.serving import http_ok as http

#: KV bytes of one block of the tiny model (float32)
BLOCK_BYTES = tiny_llama_block_bytes(BS)


# ---------------------------------------------------------------------- helpers
def metrics(base: str) -> dict[str, float]:
    """Every sample of ``base/metrics``: ``name`` summed over label sets, and
    ``name{label=value}`` for each labelled sample of our series."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(http(base + "/metrics")):
        for sample in family.samples:
            out[sample.name] = out.get(sample.name, 0.0) + sample.value
            extra = {k: v for k, v in sample.labels.items()
                     if k not in ("model_name", "engine", "le")}
            if extra and sample.name.startswith("vllm:ascend_kv_"):
                key = sample.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(extra.items())) \
                    + "}"
                out[key] = out.get(key, 0.0) + sample.value
    return out


def wait_for(base: str, name: str, want: float, timeout: float = 20.0) -> dict[str, float]:
    """Scrape until ``name`` reaches ``want`` (stats reach Prometheus once per engine step)."""
    deadline = time.monotonic() + timeout
    m = metrics(base)
    while m.get(name, 0.0) < want and time.monotonic() < deadline:
        time.sleep(0.25)
        m = metrics(base)
    return m


def complete(base: str, prompt: list[int], max_tokens: int = 6) -> list[int]:
    status, answer = completion(base, prompt, max_tokens=max_tokens, timeout=180.0)
    assert status == 200, answer
    return token_ids(answer)


def blocks_of(n: int) -> int:
    return -(-n // BS)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A tiny Llama with a locally trained tokenizer (``vllm serve`` wants one); its vocab."""
    return make_served_llama(tmp_path_factory.mktemp("metrics-model"))


# ---------------------------------------------------------------------- P/D
@pytest.fixture
def pd(model: tuple[Path, int], tmp_path: Path) -> Iterator[dict[str, Server]]:
    kv = {"kv_connector": "MooncakeConnectorV1", "kv_connector_extra_config":
          {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}}}
    servers: dict[str, Server] = {}
    try:
        servers["p"] = vllm_serve("prefill", model[0], tmp_path, {
            **kv, "kv_role": "kv_producer", "kv_port": free_port(), "engine_id": "metrics-p"})
        servers["d"] = vllm_serve("decode", model[0], tmp_path, {
            **kv, "kv_role": "kv_consumer", "kv_port": free_port(), "engine_id": "metrics-d"})
        servers["proxy"] = proxy("proxy", tmp_path, [servers["p"].url], [servers["d"].url])
        for s in servers.values():
            s.wait_ready()
        yield servers
    finally:
        for s in reversed(list(servers.values())):
            s.stop()


def test_pd_metrics_on_both_instances(pd: dict[str, Server], model: tuple[Path, int]) -> None:
    p, d, proxy = pd["p"], pd["d"], pd["proxy"]
    lengths = [5, BS, BS + 1, 70, 150]
    batch = prompts(lengths, seed=41, vocab=model[1])
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        got = list(pool.map(lambda x: complete(proxy.url, x), batch))
    assert all(len(t) == 6 for t in got)
    n = len(batch)

    dm = wait_for(d.url, "vllm:ascend_kv_p2p_requests_loaded_total", n)
    pm = wait_for(p.url, "vllm:ascend_kv_p2p_requests_served_total", n)
    # D pulled every prompt block of every request, once
    assert dm["vllm:ascend_kv_p2p_requests_loaded_total"] == n
    moved = sum(blocks_of(x) for x in lengths) * BLOCK_BYTES
    assert dm["vllm:ascend_kv_p2p_transfer_bytes_total"] == moved
    assert dm["vllm:ascend_kv_p2p_transfer_request_bytes_count"] == n
    assert dm["vllm:ascend_kv_p2p_transfer_request_bytes_sum"] == moved
    assert dm["vllm:ascend_kv_p2p_transfer_seconds_count"] == n
    # P's params carry its read window and engine start (the scheduler's and the worker's
    # are one vLLM config): D read requests without claiming them (a read that ended after
    # the window on this loaded machine was claimed instead, so not all of them need be)
    assert 1 <= dm.get("vllm:ascend_kv_p2p_window_reads_total", 0.0) <= n
    assert 0 < dm["vllm:ascend_kv_p2p_transfer_seconds_sum"] < 60 * n
    assert dm.get("vllm:ascend_kv_p2p_failures_total", 0.0) == 0
    assert dm.get("vllm:ascend_kv_p2p_load_deadlines_total", 0.0) == 0
    # P handed every request over and holds nothing any more (Done freed the blocks)
    assert pm["vllm:ascend_kv_p2p_requests_served_total"] == n
    assert pm.get("vllm:ascend_kv_p2p_expired_leases_total", 0.0) == 0
    deadline = time.monotonic() + 20
    while metrics(p.url).get("vllm:ascend_kv_p2p_held_requests", 0.0) and \
            time.monotonic() < deadline:
        time.sleep(0.25)
    assert metrics(p.url).get("vllm:ascend_kv_p2p_held_requests", 0.0) == 0
    assert metrics(d.url).get("vllm:ascend_kv_p2p_pending_loads", 0.0) == 0
    # the decode side moved the bytes; the prefill side read none
    assert pm.get("vllm:ascend_kv_p2p_transfer_bytes_total", 0.0) == 0
    proxy_metrics = metrics(proxy.url)
    assert proxy_metrics["vllm_ascend_pd_proxy_stage_seconds_count"] == 2 * n


# ---------------------------------------------------------------------- KV pool
class EventSubscriber:
    """Collects vLLM's published KV cache events (ZeroMQ SUB, msgspec ``KVEventBatch``).

    It binds ``endpoint``: vLLM's publisher binds wildcard endpoints (``tcp://*:port``) and
    connects to any other, so with an explicit loopback address the subscriber is the one
    that listens (and nothing published after the engine connected is lost).
    """

    def __init__(self, endpoint: str, topic: str) -> None:
        import zmq

        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVTIMEO, 200)
        self._sock.bind(endpoint)
        self._sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.events: list[Any] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        while not self._stop.is_set():
            try:
                _topic, _seq, payload = self._sock.recv_multipart()
            except zmq.Again:
                continue
            batch = decoder.decode(payload)
            with self._lock:
                self.events.extend(batch.events)

    def take(self) -> list[Any]:
        with self._lock:
            out, self.events = self.events, []
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


@pytest.fixture
def pool(model: tuple[Path, int], tmp_path: Path) -> Iterator[tuple[Server, EventSubscriber]]:
    events_port = free_port()
    endpoint = f"tcp://{HOST}:{events_port}"
    kv = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
          "engine_id": "metrics-pool",
          # room for four blocks of the tiny model: the third prompt pushes two out
          "kv_connector_extra_config": {"local_pool_size": 4 * BLOCK_BYTES}}
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                         "endpoint": endpoint, "topic": "kv"})
    sub = EventSubscriber(endpoint, "kv")
    server = None
    try:
        server = vllm_serve("pool", model[0], tmp_path, kv, "--kv-events-config", events)
        server.wait_ready()
        yield server, sub
    finally:
        if server is not None:
            server.stop()
        sub.close()


def wait_events(sub: EventSubscriber, pred: Any, timeout: float = 20.0) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got += sub.take()
        if pred(got):
            break
        time.sleep(0.2)
    return got


def ours(events: list[Any], kind: str) -> list[Any]:
    return [e for e in events if type(e).__name__ == kind and e.medium == "cpu"]


def test_pool_metrics_and_kv_events(pool: tuple[Server, EventSubscriber],
                                    model: tuple[Path, int]) -> None:
    server, sub = pool
    url = server.url
    a, b = prompts([3 * BS + 5, 3 * BS + 5], seed=42, vocab=model[1])

    # 1. a cold prompt: a miss, its three full blocks saved to the pool
    first = complete(url, a)
    m = wait_for(url, "vllm:ascend_kv_pool_saved_blocks_total", 3)
    assert m["vllm:ascend_kv_pool_query_tokens_total"] == len(a)
    assert m["vllm:ascend_kv_pool_miss_tokens_total"] == len(a)
    assert m.get("vllm:ascend_kv_pool_hit_tokens_total", 0.0) == 0
    assert m["vllm:ascend_kv_pool_saved_blocks_total"] == 3
    assert m["vllm:ascend_kv_pool_save_bytes_total"] == 3 * BLOCK_BYTES
    assert m["vllm:ascend_kv_pool_save_batch_bytes_sum"] == 3 * BLOCK_BYTES
    events = wait_events(sub, lambda ev: len(ours(ev, "BlockStored")) >= 3)
    stored = ours(events, "BlockStored")
    device = [e for e in events if type(e).__name__ == "BlockStored" and e.medium != "cpu"]
    device_hashes = [h for e in device for h in e.block_hashes]
    # the pool announces its three blocks under vLLM's own hashes, chained, with their tokens
    assert [e.block_hashes[0] for e in stored] == device_hashes[:3]
    assert [e.parent_block_hash for e in stored] == [None, *device_hashes[:2]]
    assert [list(e.token_ids) for e in stored] == [a[i * BS:(i + 1) * BS] for i in range(3)]
    assert {e.block_size for e in stored} == {BS}

    # 2. the same prompt once the device prefix cache is gone: 96 tokens from the pool
    assert http(url + "/reset_prefix_cache", {})["success"] is True
    again = complete(url, a)
    assert again == first  # the loaded KV gives the same greedy tokens
    m = wait_for(url, "vllm:ascend_kv_pool_loaded_blocks_total", 3)
    assert m["vllm:ascend_kv_pool_hit_tokens_total"] == 3 * BS
    assert m["vllm:ascend_kv_pool_miss_tokens_total"] == len(a) + (len(a) - 3 * BS)
    assert m["vllm:ascend_kv_pool_query_tokens_total"] == 2 * len(a)
    assert m["vllm:ascend_kv_pool_loaded_blocks_total"] == 3
    assert m["vllm:ascend_kv_pool_load_bytes_total"] == 3 * BLOCK_BYTES
    assert m["vllm:ascend_kv_pool_load_batch_bytes_sum"] == 3 * BLOCK_BYTES
    assert m["vllm:ascend_kv_pool_saved_blocks_total"] == 3  # nothing saved twice
    assert m.get("vllm:ascend_kv_pool_failed_load_blocks_total", 0.0) == 0
    lookups = m["vllm:ascend_kv_pool_lookups_total"]
    assert lookups >= 2
    assert m["vllm:ascend_kv_pool_lookup_seconds_count"] == lookups
    assert 0 < m["vllm:ascend_kv_pool_lookup_seconds_sum"] < 5 * lookups
    time.sleep(1.0)
    assert ours(sub.take(), "BlockStored") == []  # loaded blocks are not announced again

    # 3. another prompt: its three blocks push two of the first prompt's out; the default
    # prefix-aware policy evicts leaves first (the chain's last block, then the one before),
    # keeping the first block, a prefix that still hits
    complete(url, b)
    m = wait_for(url, "vllm:ascend_kv_pool_saved_blocks_total", 6)
    assert m["vllm:ascend_kv_pool_saved_blocks_total"] == 6
    assert m.get("vllm:ascend_kv_pool_pending_saves", 0.0) == 0
    events = wait_events(sub, lambda ev: len(ours(ev, "BlockRemoved")) >= 2
                         and len(ours(ev, "BlockStored")) >= 3)
    removed = [h for e in ours(events, "BlockRemoved") for h in e.block_hashes]
    assert removed == [stored[2].block_hashes[0], stored[1].block_hashes[0]]
    assert len(ours(events, "BlockStored")) == 3
