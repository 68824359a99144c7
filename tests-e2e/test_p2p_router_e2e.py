# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-pd-proxy --policy kv_aware`` on real engines: two P ``vllm serve`` with
``--kv-events-config`` (vLLM's ZeroMQ publisher, with replay) and one D, pull mode.

A request whose prompt shares its first blocks with an earlier one lands on the P that
cached them (the proxy learned them from P's BlockStored events and hashed the new prompt,
tokenized by P's ``/tokenize``, with vLLM's functions); the prediction equals the hit P
reports (``--enable-prompt-tokens-details``), and the completion equals a single
instance's. One set of engines, about two minutes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.models import make_tiny_llama, make_tokenizer
from ascend_kv_testing.pd import kv_config
from ascend_kv_testing.procs import free_port
from ascend_kv_testing.serving import (
    BLOCK_SIZE,
    MODEL_NAME,
    Server,
    http,
    metrics,
    proxy,
    started,
    vllm_serve,
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
    path = tmp_path_factory.mktemp("router-model")
    make_tokenizer(path)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    return make_tiny_llama(path, vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id)


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

    try:
        for i in range(2):
            servers[f"p{i}"] = started(lambda i=i: prefill(i))
            events.append(where_of[i])
        servers["d"] = started(lambda: vllm_serve("decode", model, logs,
                                                  kv_config("kv_consumer", "router-d")))
        extra = ["--policy", "kv_aware"]
        for where in events:
            extra += ["--prefill-events", where]
        servers["proxy"] = started(lambda: proxy(
            "proxy", logs, [servers["p0"].url, servers["p1"].url], [servers["d"].url], *extra))
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
    d, router = cluster["d"], cluster["proxy"]
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
