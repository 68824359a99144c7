# SPDX-License-Identifier: Apache-2.0
"""Layerwise P/D behind the proxy: two ``vllm serve`` instances and ``vllm-ascend-pd-proxy
--mode layerwise``, all real, on loopback.

The proxy sends each request to D first; D posts its blocks to the proxy's metaserver;
the proxy hands them to P, which pushes every layer into D's blocks. Completions must
equal the single-instance ones; a virtual request completes on D with no metaserver post
and no bytes moved while ordinary requests beside it are unaffected.

Every process runs with a deployment key (``VLLM_ASCEND_KV_AUTH_KEY``), as a production
deployment should: signed side-channel frames, the metaserver's bearer token, each push
presenting its request's ``remote_push_token``, and D's regions coming with each grant.
(The unkeyed path runs in ``test_p2p_layerwise_engine_e2e``.)
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing import serving
from ascend_kv_testing.models import make_served_llama, tiny_llama_block_bytes
from ascend_kv_testing.pd import prompts_of as prompts
from ascend_kv_testing.procs import free_port
from ascend_kv_testing.serving import BLOCK_SIZE as BS
from ascend_kv_testing.serving import (
    Server,
    completion,
    metrics,
    proxy,
    serve_env,
    token_ids,
    vllm_serve,
)
from ascend_kv_testing.serving import http_ok as http
from vllm_ascend.distributed.kv_transfer.core.auth import Authenticator
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.routes import PURPOSE_ADMIN

#: KV bytes of one block of the tiny model (float32)
BLOCK_BYTES = tiny_llama_block_bytes(BS)
KEY = "layerwise-proxy-e2e-deployment-key-0123"
#: with a key, the proxy's /status wants the admin bearer token
ADMIN = {"Authorization": "Bearer " + Authenticator([KEY.encode()]).bearer_token(PURPOSE_ADMIN)}


def proxy_status(base: str) -> Any:
    """The proxy's ``/status``, read as its operator (the admin bearer token)."""
    return http(base + "/status", headers=ADMIN)


def scrape(base: str, name: str) -> float:
    """Sum of a Prometheus series (all label sets)."""
    return metrics(base).get(name, 0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A tiny Llama with a locally trained tokenizer (``vllm serve`` wants one); its vocab."""
    return make_served_llama(tmp_path_factory.mktemp("lw-proxy-model"))


@pytest.fixture(scope="module")
def cluster(model: tuple[Path, int],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("lw-proxy-logs")
    env = serve_env(VLLM_ASCEND_KV_AUTH_KEY=KEY)
    env.pop("VLLM_ASCEND_KV_AUTH_KEY_FILE", None)
    kv = {"kv_connector": "MooncakeLayerwiseConnector", "kv_connector_extra_config":
          {"load_timeout_s": 60, "prefill": {"tp_size": 1}, "decode": {"tp_size": 1}}}
    servers: dict[str, Server] = {}
    try:
        servers["p"] = vllm_serve("prefill", model[0], logs, {
            **kv, "kv_role": "kv_producer", "kv_port": free_port(), "engine_id": "lw-p"},
            "--max-num-batched-tokens", "64", env=env)
        servers["d"] = vllm_serve("decode", model[0], logs, {
            **kv, "kv_role": "kv_consumer", "kv_port": free_port(), "engine_id": "lw-d"},
            env=env)
        servers["proxy"] = proxy("proxy", logs, [servers["p"].url], [servers["d"].url],
                                 "--mode", "layerwise", env=env)
        for s in servers.values():
            s.wait_ready()
        yield servers
    finally:
        for s in reversed(list(servers.values())):
            s.stop()


def complete(base: str, prompt: list[int], *, headers: dict[str, str] | None = None
             ) -> list[int]:
    status, answer = completion(base, prompt, headers=headers)
    assert status == 200, answer
    return token_ids(answer)


def reference(d: Server, prompts: list[list[int]]) -> list[list[int]]:
    """Single-instance tokens (D without kv params is a plain engine), then a clean cache."""
    want = [complete(d.url, p) for p in prompts]
    assert http(d.url + "/reset_prefix_cache", {})["success"] is True
    return want


def wait_metric(base: str, name: str, at_least: float, timeout: float = 15.0) -> float:
    return serving.wait_metric(base, name, lambda v: v >= at_least, timeout=timeout)


def settled_bytes(p: Server, quiet_s: float = 1.0, timeout: float = 30.0) -> float:
    """P's bytes-moved counter once P holds no request and the counter kept still for
    ``quiet_s``: on 2 shared cores the last push of an earlier test can still be counted
    (or its step's stats still be on their way to P's frontend) when the next test starts."""
    name = "vllm:ascend_kv_p2p_transfer_bytes_total"
    deadline = time.monotonic() + timeout
    value = scrape(p.url, name)
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        again = scrape(p.url, name)
        if again == value and scrape(p.url, "vllm:ascend_kv_p2p_held_requests") == 0:
            return value
        value = again
    raise AssertionError(f"P's moved bytes did not settle in {timeout}s (last {value})")


def test_proxy_layerwise_equals_single_instance(cluster: dict[str, Server],
                                                model: tuple[Path, int]) -> None:
    p, d, proxy = cluster["p"], cluster["d"], cluster["proxy"]
    batch = prompts([5, BS + 1, 70, 150], seed=31, vocab=model[1])
    want = reference(d, batch)
    loaded0 = scrape(d.url, "vllm:ascend_kv_p2p_requests_loaded_total")
    moved0 = settled_bytes(p)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda x: complete(proxy.url, x), batch))
    assert got == want
    status = proxy_status(proxy.url)
    assert status["metaserver_posts"] == len(batch) and status["prefill_failures"] == 0
    assert serving.http(proxy.url + "/status")[0] == 401  # not without the token
    assert wait_metric(d.url, "vllm:ascend_kv_p2p_requests_loaded_total",
                       loaded0 + len(batch)) == loaded0 + len(batch)
    # every block of every prompt went out once, though the prompts shared P's 64-token
    # steps (a block a step left partly filled goes with the step that fills it)
    assert settled_bytes(p) - moved0 == BLOCK_BYTES * sum(-(-len(x) // BS) for x in batch)
    assert scrape(d.url, "vllm:ascend_kv_p2p_failures_total") == 0
    for server in (p, d):  # keyed, tokens presented: nothing was refused
        assert scrape(server.url, "vllm:ascend_kv_auth_refused_total") == 0


def test_virtual_request_through_the_proxy(cluster: dict[str, Server],
                                           model: tuple[Path, int]) -> None:
    p, d, proxy = cluster["p"], cluster["d"], cluster["proxy"]
    batch = prompts([80, 45, 100], seed=32, vocab=model[1])
    want = reference(d, batch)
    virtual0 = scrape(d.url, "vllm:ascend_kv_p2p_virtual_requests_total")
    posts0 = proxy_status(proxy.url)["metaserver_posts"]
    moved0 = settled_bytes(p)
    tokens = complete(proxy.url, batch[0], headers={"X-KV-Virtual": "true"})
    assert len(tokens) == 8
    assert wait_metric(d.url, "vllm:ascend_kv_p2p_virtual_requests_total",
                       virtual0 + 1) == virtual0 + 1
    status = proxy_status(proxy.url)
    assert status["metaserver_posts"] == posts0  # D posted nothing, P saw nothing
    assert status["recent"][-1]["virtual"] is True
    assert status["recent"][-1]["metaserver_post"] is False
    assert status["recent"][-1]["prefill"] is None
    time.sleep(1.0)
    assert scrape(p.url, "vllm:ascend_kv_p2p_transfer_bytes_total") == moved0  # no bytes
    assert http(d.url + "/reset_prefix_cache", {})["success"] is True  # no real KV there
    # the same virtual request beside ordinary ones: those get exactly their tokens
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(complete, proxy.url, batch[0], headers={"X-KV-Virtual": "1"}),
                   pool.submit(complete, proxy.url, batch[1]),
                   pool.submit(complete, proxy.url, batch[2])]
        got = [f.result() for f in futures]
    assert got[1:] == want[1:] and len(got[0]) == 8
    assert proxy_status(proxy.url)["metaserver_posts"] == posts0 + 2
    assert http(d.url + "/reset_prefix_cache", {})["success"] is True
