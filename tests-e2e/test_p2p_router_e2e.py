# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-pd-proxy --policy kv_aware`` on real engines: two P ``vllm serve`` with
``--kv-events-config`` (vLLM's ZeroMQ publisher, with replay) and two D, pull mode.

A request whose prompt shares its first blocks with an earlier one lands on the P that
cached them (the proxy learned them from P's BlockStored events and hashed the new prompt,
tokenized by P's ``/tokenize``, with vLLM's functions); the prediction equals the hit P
reports (``--enable-prompt-tokens-details``), and the completion equals a single
instance's. Requests without a shared prefix spread over all four instances (the proxy's
counts and the engines' own); a short run of vLLM's benchmark client through the proxy
fails nothing and leaves no block held on either P. One set of engines, about three minutes
(the longer fleet runs, layerwise and failover: ``test_p2p_fleet_e2e``, ``nox -s e2e-fleet``).
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.models import make_served_llama
from ascend_kv_testing.pd import kv_config
from ascend_kv_testing.procs import free_port
from ascend_kv_testing.serving import (
    BLOCK_SIZE,
    HELD,
    LOADED,
    MODEL_NAME,
    REQUESTS_DONE,
    Server,
    bench_client,
    http,
    metrics,
    proxy,
    start_all,
    started,
    vllm_serve,
    wait_metric,
)

TEXT = ("the quick brown fox jumps over the lazy dog while the small cat sleeps near "
        "the warm fire and the old man reads a long book about ships sailing far across "
        "the cold northern sea in the winter of a year nobody remembers any more ") * 3


def events_config() -> tuple[dict[str, Any], str]:
    port, replay = free_port(), free_port()
    cfg = {"enable_kv_cache_events": True, "publisher": "zmq",
           "endpoint": f"tcp://*:{port}", "replay_endpoint": f"tcp://*:{replay}"}
    return cfg, f"tcp://127.0.0.1:{port},tcp://127.0.0.1:{replay}"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_served_llama(tmp_path_factory.mktemp("router-model"))[0]


@pytest.fixture(scope="module")
def cluster(model: Path, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("router-logs")
    servers: dict[str, Server] = {}
    events: list[str] = []
    where_of: dict[int, str] = {}

    def prefill(i: int) -> Server:
        cfg, where_of[i] = events_config()  # fresh ports on every attempt
        return vllm_serve(f"prefill{i}", model, logs, kv_config("kv_producer", f"router-p{i}"),
                          "--kv-events-config", json.dumps(cfg), "--enable-prompt-tokens-details")

    try:  # the four engines start side by side
        start_all({"p0": lambda: prefill(0), "p1": lambda: prefill(1),
                   **{f"d{i}": (lambda i=i: vllm_serve(  # type: ignore[misc]
                       f"decode{i}", model, logs, kv_config("kv_consumer", f"router-d{i}")))
                      for i in range(2)}}, servers)
        events += [where_of[0], where_of[1]]
        extra = ["--policy", "kv_aware"]
        for where in events:
            extra += ["--prefill-events", where]
        servers["proxy"] = started(lambda: proxy(
            "proxy", logs, [servers["p0"].url, servers["p1"].url],
            [servers["d0"].url, servers["d1"].url], *extra))
        yield servers
    finally:
        for s in reversed(list(servers.values())):
            s.stop()


def complete(base: str, prompt: str) -> Any:
    status, out = http(base + "/v1/completions", {
        "model": MODEL_NAME, "prompt": prompt, "max_tokens": 6, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True})
    assert status == 200, out
    return list(out["choices"][0]["token_ids"])


def prefill_status(base: str) -> list[dict[str, Any]]:
    status, out = http(base + "/status")
    assert status == 200, out
    return list(out["prefill"])


def test_shared_prefix_lands_on_the_p_that_cached_it(cluster: dict[str, Server]) -> None:
    d, router = cluster["d0"], cluster["proxy"]
    second = TEXT + "and then a different ending for the second request"
    want = [complete(d.url, TEXT), complete(d.url, second)]  # a plain single instance
    assert http(d.url + "/reset_prefix_cache", {})[0] == 200

    deadline = time.monotonic() + 60
    while [p["events"]["state"] for p in prefill_status(router.url)] != ["live", "live"]:
        assert time.monotonic() < deadline, prefill_status(router.url)
        time.sleep(0.5)
    assert complete(router.url, TEXT) == want[0]
    served = [p["served"] for p in prefill_status(router.url)]
    owner = served.index(1)
    deadline = time.monotonic() + 30
    while prefill_status(router.url)[owner]["prefix_index"]["blocks"] < 2:
        assert time.monotonic() < deadline, prefill_status(router.url)
        time.sleep(0.25)

    for _ in range(2):  # the same P both times, though the other one is idle
        assert complete(router.url, second) == want[1]
    status = prefill_status(router.url)
    assert [p["served"] for p in status][owner] == 3, status
    assert status[owner]["prefix_index"]["aligned"], status  # our hashes are vLLM's
    assert status[owner]["prefix_index"]["hash_verified"] >= 1, status
    m = metrics(router.url)
    assert m["vllm_ascend_pd_proxy_routing_decisions_total"] == 3
    assert m["vllm_ascend_pd_proxy_predicted_hit_tokens_total"] >= 2 * 2 * BLOCK_SIZE
    # P reported exactly the hit the proxy predicted, every time
    assert m["vllm_ascend_pd_proxy_predicted_hit_tokens_total"] == \
        m["vllm_ascend_pd_proxy_reported_hit_tokens_total"]
    status_code, text = http(router.url + "/metrics")
    assert 'reason="prefix"' in str(text) and 'outcome="exact"' in str(text)


ENGINES = ("p0", "p1", "d0", "d1")


def done_counts(cluster: dict[str, Server]) -> dict[str, float]:
    """Each engine's own count of finished requests."""
    return {k: metrics(cluster[k].url).get(REQUESTS_DONE, 0.0) for k in ENGINES}


def served_counts(base: str) -> dict[str, int]:
    """The proxy's count of requests each instance answered (p0, p1, d0, d1)."""
    status, out = http(base + "/status")
    assert status == 200, out
    return {f"{role[0]}{i}": int(inst["served"])
            for role in ("prefill", "decode") for i, inst in enumerate(out[role])}


def test_requests_spread_over_all_four_instances(cluster: dict[str, Server]) -> None:
    """Prompts without a shared block (shorter than one) go to both P and both D, the
    proxy's counts and the engines' agreeing, and every completion equals a single
    instance's."""
    d, router = cluster["d0"], cluster["proxy"]
    batch = [f"request {i}: the {w} sat on the mat" for i, w in
             enumerate(["cat", "dog", "owl", "fox", "hen", "ram", "elk", "yak"])]
    want = [complete(d.url, x) for x in batch]
    assert http(d.url + "/reset_prefix_cache", {})[0] == 200
    served0, done0 = served_counts(router.url), done_counts(cluster)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda x: complete(router.url, x), batch))
    assert got == want
    served = {k: v - served0[k] for k, v in served_counts(router.url).items()}
    assert served["p0"] + served["p1"] == len(batch), served
    assert served["d0"] + served["d1"] == len(batch), served
    assert min(served.values()) >= 1, served  # every instance took a share
    for k in ENGINES:  # and the engines say so themselves
        got_done = wait_metric(cluster[k].url, REQUESTS_DONE,
                               lambda v, k=k: v >= done0[k] + served[k])  # type: ignore[misc]
        assert got_done == done0[k] + served[k], (k, got_done, done0[k], served)


def test_vllm_bench_client_through_the_router(cluster: dict[str, Server], model: Path,
                                              tmp_path: Path) -> None:
    """vLLM's benchmark client (random dataset, 16 requests at concurrency 8): nothing
    fails, D loaded every request's KV from P, and neither P holds a block afterwards."""
    router = cluster["proxy"]
    loaded0 = sum(metrics(cluster[k].url).get(LOADED, 0.0) for k in ("d0", "d1"))
    row = bench_client(router.url, model, tmp_path, num_prompts=16, concurrency=8,
                       input_len=64, output_len=8, seed=3)
    assert row["failed"] == 0 and row["completed"] == 16, row
    deadline = time.monotonic() + 30
    loaded = 0.0
    while time.monotonic() < deadline:
        loaded = sum(metrics(cluster[k].url).get(LOADED, 0.0) for k in ("d0", "d1")) - loaded0
        if loaded >= 16:
            break
        time.sleep(0.25)
    assert loaded >= 16, loaded  # the client's requests (and its test request) moved KV
    for k in ("p0", "p1"):
        assert wait_metric(cluster[k].url, HELD, lambda v: v == 0) == 0, k
    status, out = http(router.url + "/status")
    assert out["fallbacks"] == 0, out
