# SPDX-License-Identifier: Apache-2.0
"""The P/D proxy and ``vllm serve`` instances under bad input and a proxy killed mid-request.

Real processes on loopback: P and D are ``vllm serve`` with ``MooncakeConnectorV1``
(D recomputes a failed load), the proxy is ``vllm-ascend-pd-proxy --mode pull``.

* malformed ``kv_transfer_params`` from a client, through the proxy: the proxy never passes
  a client's params on, every request gets the single-instance tokens;
* malformed ``kv_transfer_params`` sent straight to D (wrong types, negative or huge block
  ids, lists longer than the prompt, unknown keys): only that request is affected, the
  others beside it get exactly their tokens, D holds nothing afterwards;
* the proxy's HTTP socket fuzzed (mutated request bodies, other JSON, bytes that are not
  JSON, pickles): every request answered, no pickle run, memory bounded, valid traffic
  served afterwards;
* the proxy killed (SIGKILL) while streaming: the client sees the connection end, D aborts
  the request and frees its blocks, P holds nothing, a new proxy on the same port serves;
* the layerwise proxy's ``POST /v1/metaserver`` fuzzed (``--mode layerwise`` in front of
  stub instances: D's posts arrive while the request is really pending) and sent pickles.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_kv_testing.faults import evil_pickles, listening_sockets, rss_bytes, wait_for
from ascend_kv_testing.fuzzing import json_bodies
from ascend_kv_testing.models import make_served_llama
from ascend_kv_testing.pd import prompts_of as prompts
from ascend_kv_testing.procs import free_port
from ascend_kv_testing.serving import (
    MODEL_NAME,
    Server,
    StubInstance,
    completion,
    http,
    metrics,
    proxy,
    token_ids,
    vllm_serve,
)

BS = 32
LEASE_S = 3.0
#: Proxy fuzz examples (each one a request through real P and D); the soak session runs
#: many more.
EXAMPLES = max(40, int(os.environ.get("VLLM_ASCEND_KV_FUZZ_EXAMPLES", "40")) // 4)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    return make_served_llama(tmp_path_factory.mktemp("proxy-faults-model"))


@pytest.fixture(scope="module")
def cluster(model: tuple[Path, int],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    logs = tmp_path_factory.mktemp("proxy-faults-logs")
    kv = {"kv_connector": "MooncakeConnectorV1", "kv_connector_extra_config": {
        "load_timeout_s": 20, "lease_ttl_s": LEASE_S, "handshake_timeout_s": 2}}
    servers: dict[str, Server] = {}
    try:
        servers["p"] = vllm_serve("prefill", model[0], logs, {
            **kv, "kv_role": "kv_producer", "kv_port": free_port(), "engine_id": "fx-p"})
        servers["d"] = vllm_serve("decode", model[0], logs, {
            **kv, "kv_role": "kv_consumer", "kv_port": free_port(), "engine_id": "fx-d",
            "kv_load_failure_policy": "recompute"})
        servers["proxy"] = proxy("proxy", logs, [servers["p"].url], [servers["d"].url])
        for s in servers.values():
            s.wait_ready()
        yield servers
    finally:
        for s in reversed(list(servers.values())):
            s.stop()


def reference(d: Server, batch: list[list[int]]) -> list[list[int]]:
    """Single-instance tokens (D asked without params), then D's prefix cache reset."""
    want = []
    for p in batch:
        status, body = completion(d.url, p)
        assert status == 200, body
        want.append(token_ids(body))
    assert http(d.url + "/reset_prefix_cache", {})[0] == 200
    return want


def idle(server: Server, timeout: float = 30.0, report: Any = None) -> dict[str, float]:
    """Wait until the instance runs nothing and uses no KV block; its metrics (observed as
    ``zero`` on ``report``)."""
    keys = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    ok = wait_for(lambda: all(metrics(server.url).get(k, 0) == 0 for k in keys), timeout,
                  interval_s=0.5)
    if report is not None:
        report.check("zero", ok, f"{ {k: metrics(server.url).get(k) for k in keys} }")
    assert ok, {k: metrics(server.url).get(k) for k in keys}
    return metrics(server.url)


def no_held(p: Server, report: Any) -> bool:
    """P holds no request within its lease (observed as ``zero`` on ``report``)."""
    return report.check("zero", wait_for(lambda: held(p) == 0, LEASE_S + 10, interval_s=0.5),
                        f"P still held {held(p):.0f} request(s)")


def held(p: Server) -> float:
    return metrics(p.url).get("vllm:ascend_kv_p2p_held_requests", 0.0)


#: Malformed params sent straight to D (each beside good requests).
BAD_PARAMS: list[tuple[str, dict[str, Any]]] = [
    ("block ids of the wrong type", {"remote_block_ids": "0,1,2"}),
    ("negative block id", {"remote_block_ids": [-1, 2, 3, 4]}),
    ("huge block id", {"remote_block_ids": [2**62, 1, 2, 3]}),
    ("more block ids than the prompt has blocks", {"remote_block_ids": list(range(40))}),
    ("port of the wrong type", {"remote_port": "8000"}),
    ("port out of range", {"remote_port": 70000}),
    ("host of the wrong type", {"remote_host": ["10.0.0.1"]}),
    ("tp size zero", {"remote_tp_size": 0}),
    ("engine id missing", {"remote_engine_id": None}),
]


def valid_looking_params(prompt_len: int) -> dict[str, Any]:
    """Params of the right shape that no P holds (D must not trust them either)."""
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_block_ids": list(range(1, -(-prompt_len // BS) + 1)),
            "remote_engine_id": "nobody", "remote_host": "127.0.0.1",
            "remote_port": free_port(), "remote_request_id": "nothing-here",
            "remote_tp_size": 1}


def test_client_params_never_pass_the_proxy(cluster: dict[str, Server],
                                            model: tuple[Path, int], fault_report: Any) -> None:
    """Whatever kv_transfer_params a client sends, the proxy replaces them: P gets the
    prefill params, D gets P's answer; every request gets the single-instance tokens."""
    d, px = cluster["d"], cluster["proxy"]
    batch = prompts([70] * len(BAD_PARAMS) + [45, 100], seed=501, vocab=model[1])
    want = reference(d, batch)
    hostile = [{**valid_looking_params(70), **change} for _n, change in BAD_PARAMS]
    hostile += [{"do_remote_prefill": True, "remote_block_ids": [0] * 10**4}, {"x": {"y": []}}]
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda args: completion(px.url, args[0],
                                                        kv_transfer_params=args[1]),
                                zip(batch, hostile, strict=True)))
    took = time.monotonic() - start
    assert fault_report.check("deadline", [a[0] for a in answers] == [200] * len(batch),
                              f"HTTP statuses {sorted({a[0] for a in answers})}"), answers
    assert fault_report.check("survivor", [token_ids(a[1]) for a in answers] == want,
                              "tokens differ from the single instance's")
    idle(d, report=fault_report)
    assert no_held(cluster["p"], fault_report)
    fault_report(fault=f"malformed kv_transfer_params from a client, through the proxy "
                       f"({len(hostile)} kinds)",
                 happened="the proxy sent P its prefill params and D P's answer, never the "
                          "client's; every request gave the single-instance tokens",
                 deadline=f"yes ({len(batch)} requests in {took:.1f}s)",
                 client="the right tokens")


@pytest.mark.parametrize(("what", "change"), BAD_PARAMS, ids=[n for n, _c in BAD_PARAMS])
def test_malformed_params_straight_to_d(cluster: dict[str, Server], model: tuple[Path, int],
                                        what: str, change: dict[str, Any],
                                        fault_report: Any) -> None:
    d = cluster["d"]
    batch = prompts([100, 40, 75], seed=502, vocab=model[1])
    want = reference(d, batch)
    failures0 = metrics(d.url).get("vllm:ascend_kv_p2p_failures_total", 0)
    bad = {**valid_looking_params(len(batch[0])), **change}
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(completion, d.url, batch[0], kv_transfer_params=bad),
                   pool.submit(completion, d.url, batch[1]),
                   pool.submit(completion, d.url, batch[2])]
        answers = [f.result() for f in futures]
    # recompute policy: the bad request is computed locally; with "fail" it would be an error
    assert fault_report.check("deadline", answers[0][0] == 200,
                              f"HTTP {answers[0][0]} for the bad request"), answers[0]
    assert fault_report.check("survivor", token_ids(answers[0][1]) == want[0],
                              "the bad request's tokens"), answers[0]
    assert fault_report.check("survivor", [token_ids(a[1]) for a in answers[1:]] == want[1:],
                              "the requests beside it")
    m = idle(d, report=fault_report)
    assert wait_for(lambda: metrics(d.url).get("vllm:ascend_kv_p2p_failures_total", 0)
                    - failures0 == 1, 10, interval_s=0.5)
    assert fault_report.check("zero", m.get("vllm:ascend_kv_p2p_pending_loads", 0) == 0,
                              f"{m.get('vllm:ascend_kv_p2p_pending_loads')} pending loads")
    if what == BAD_PARAMS[0][0]:
        fault_report(fault="malformed kv_transfer_params straight to D (wrong types, negative "
                           "or huge block ids, too many blocks, bad port/host/tp, missing keys)",
                     happened="that request's load failed at once (cause bad_params, counted, "
                              "logged with the key and value) and was recomputed; the requests "
                              "beside it were untouched",
                     client="the right tokens (recompute policy; with `fail`, vLLM answers "
                            "HTTP 500)")


def test_unknown_keys_in_params_are_ignored(cluster: dict[str, Server],
                                            model: tuple[Path, int]) -> None:
    p, d = cluster["p"], cluster["d"]
    batch = prompts([90], seed=503, vocab=model[1])
    want = reference(d, batch)
    status, body = completion(p.url, batch[0], max_tokens=1, kv_transfer_params={
        "do_remote_decode": True, "do_remote_prefill": False, "made_up_key": [1, 2]})
    assert status == 200
    params = {**body["kv_transfer_params"], "another_unknown": {"x": 1}, "remote_extra": None}
    loaded0 = metrics(d.url).get("vllm:ascend_kv_p2p_requests_loaded_total", 0)
    status, body = completion(d.url, batch[0], kv_transfer_params=params)
    assert status == 200 and token_ids(body) == want[0]
    assert wait_for(lambda: metrics(d.url).get("vllm:ascend_kv_p2p_requests_loaded_total", 0)
                    == loaded0 + 1, 10, interval_s=0.5)
    idle(d)


def test_proxy_http_fuzz(cluster: dict[str, Server], model: tuple[Path, int],
                         tmp_path: Path, fault_report: Any) -> None:
    d, px = cluster["d"], cluster["proxy"]
    good = {"model": MODEL_NAME, "prompt": prompts([40], seed=504, vocab=model[1])[0],
            "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}
    rss0 = rss_bytes(px.proc.pid)
    statuses: dict[int, int] = {}
    slowest = [0.0]

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=json_bodies(good),
           path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/metaserver",
                                 "/v1/completions/../../x", "/status?x=%00"]))
    def fuzz(body: bytes, path: str) -> None:
        start = time.monotonic()
        status, answer = http(px.url + path, raw=body, timeout=120)
        slowest[0] = max(slowest[0], time.monotonic() - start)
        statuses[status] = statuses.get(status, 0) + 1
        assert px.proc.poll() is None, "the proxy died"
        # an unhandled exception in the proxy is Starlette's bare-text 500; the proxy's own
        # errors and the instances' errors it relays are JSON bodies
        assert isinstance(answer, dict) or status < 500, (status, answer, body[:200])

    fuzz()
    fault_report.check("deadline", slowest[0] < 120, f"slowest answer {slowest[0]:.1f}s")
    marker = tmp_path / "pwned-proxy"
    for payload in evil_pickles(marker):
        for path in ("/v1/completions", "/v1/metaserver"):
            status, _answer = http(px.url + path, raw=payload,
                                   headers={"Content-Type": "application/octet-stream"})
            assert status in (400, 404, 422)
    assert not marker.exists()
    grown = rss_bytes(px.proc.pid) - rss0
    assert grown < 64 << 20, f"the proxy grew by {grown >> 20} MiB"
    status, answer = completion(px.url, good["prompt"], max_tokens=4)
    assert fault_report.check("survivor", status == 200 and len(token_ids(answer)) == 4,
                              f"a valid request afterwards: HTTP {status}")
    assert http(px.url + "/health")[0] == 200
    idle(d, report=fault_report)
    assert no_held(cluster["p"], fault_report)
    fault_report(fault="fuzzing the proxy's HTTP socket (mutated bodies, other JSON, "
                       "non-JSON, pickles)",
                 happened=f"{sum(statuses.values())} requests answered "
                          f"({', '.join(f'{k}: {v}' for k, v in sorted(statuses.items()))}); no "
                          f"pickle ran; proxy memory {grown / (1 << 20):+.1f} MiB; a valid "
                          "request worked afterwards",
                 deadline=f"yes (slowest answer {slowest[0]:.1f}s)",
                 client="an HTTP status with an error body naming the problem")


def test_proxy_binds_the_given_host_only(cluster: dict[str, Server]) -> None:
    px = cluster["proxy"]
    sockets = [s for s in listening_sockets(px.proc.pid) if s.kind != "unix"]
    assert sockets and all(s.host == "127.0.0.1" for s in sockets), [str(s) for s in sockets]


def test_proxy_killed_while_streaming(cluster: dict[str, Server], model: tuple[Path, int],
                                      fault_report: Any) -> None:
    p, d, px = cluster["p"], cluster["d"], cluster["proxy"]
    prompt = prompts([120], seed=505, vocab=model[1])[0]
    body = json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1500,
                       "temperature": 0.0, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(px.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    resp = urllib.request.urlopen(req, timeout=60)
    chunks = [resp.readline() for _ in range(6)]  # D is decoding now
    assert any(c.startswith(b"data:") for c in chunks)
    assert metrics(d.url).get("vllm:num_requests_running", 0) == 1
    px.kill()
    start = time.monotonic()
    client_error = ""
    try:
        while resp.readline():
            pass
        client_error = "the stream ended without [DONE]"
    except OSError as exc:
        client_error = f"{type(exc).__name__}"
    finally:
        resp.close()
    m = idle(d, timeout=30, report=fault_report)  # D noticed the closed connection, aborted
    aborted_s = time.monotonic() - start
    fault_report.check("deadline", aborted_s < 30, f"D aborted after {aborted_s:.1f}s")
    assert no_held(p, fault_report)
    idle(p, report=fault_report)
    assert fault_report.check("zero", m.get("vllm:ascend_kv_p2p_pending_loads", 0) == 0,
                              f"{m.get('vllm:ascend_kv_p2p_pending_loads')} pending loads")
    px.restart().wait_ready()
    status, answer = completion(px.url, prompt, max_tokens=4)
    assert fault_report.check("survivor", status == 200 and len(token_ids(answer)) == 4,
                              f"the restarted proxy: HTTP {status}")
    fault_report(fault="proxy killed (SIGKILL) while streaming a response",
                 happened=f"the client's stream ended ({client_error}); D saw the closed "
                          f"connection and aborted the request ({aborted_s:.1f}s), freeing its "
                          "blocks; P held nothing; a proxy restarted on the same port served",
                 client="the stream ends (connection closed)")


@pytest.fixture(scope="module")
def lw_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A real ``--mode layerwise`` proxy in front of a stub P and a stub D; the stub D
    holds each completion until the test released it (the request stays pending)."""
    logs = tmp_path_factory.mktemp("proxy-lw-logs")
    p, d = StubInstance(), StubInstance(hold=True)
    px = proxy("proxy-lw", logs, [p.url], [d.url], "--mode", "layerwise")
    try:
        px.wait_ready(60)
        yield {"p": p, "d": d, "proxy": px}
    finally:
        px.stop()
        p.close()
        d.close()


def test_layerwise_metaserver_fuzz(lw_proxy: dict[str, Any], tmp_path: Path,
                                   fault_report: Any) -> None:
    """Each example: a completion through the proxy (pending at the stub D), then a fuzzed
    post to /v1/metaserver, carrying the pending request's id or not. The proxy answers
    every post, forwards a well-addressed one to P as its kv_transfer_params, never runs a
    pickle, stays bounded, and forgets every request once D answered."""
    from vllm_ascend.distributed.kv_transfer.kv_p2p.params import params_for_prefill

    p, d, px = lw_proxy["p"], lw_proxy["d"], lw_proxy["proxy"]
    valid = params_for_prefill(proxy_request_id="placeholder", block_ids=[3, 4, 5],
                               block_size=BS, engine_id="stub-d", host="127.0.0.1",
                               port=free_port(), request_id="stub-d-1", tp_size=1,
                               cached_tokens=0)
    good = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2}
    rss0 = rss_bytes(px.proc.pid)
    statuses: dict[int, int] = {}
    clients: dict[int, int] = {}
    forwarded = [0]
    slowest = [0.0]

    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(body=json_bodies(valid), address=st.booleans())
    def fuzz(body: bytes, address: bool) -> None:
        answer_box: dict[str, Any] = {}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            client = pool.submit(http, px.url + "/v1/completions", good, timeout=60)
            rid = d.next_request(timeout=30)
            data = body
            if address:
                try:
                    doc = json.loads(body)
                except ValueError:
                    doc = None
                if isinstance(doc, dict):
                    data = json.dumps({**doc, "request_id": rid}).encode()
            n_p = len(p.bodies)
            start = time.monotonic()
            status, answer = http(px.url + "/v1/metaserver", raw=data, timeout=30)
            slowest[0] = max(slowest[0], time.monotonic() - start)
            statuses[status] = statuses.get(status, 0) + 1
            assert px.proc.poll() is None, "the proxy died"
            assert isinstance(answer, dict) and status in (200, 400, 404), (status, answer,
                                                                            data[:200])
            if status == 200:  # P gets the post as its kv_transfer_params, once
                assert wait_for(lambda: len(p.bodies) > n_p, 10)
                assert len(p.bodies) == n_p + 1
                assert p.bodies[-1]["kv_transfer_params"] == json.loads(data)
                forwarded[0] += 1
            d.release(rid)
            answer_box["c"] = client.result(60)
        code = answer_box["c"][0]
        clients[code] = clients.get(code, 0) + 1
        assert code == 200, answer_box["c"]

    fuzz()
    fault_report.check("deadline", slowest[0] < 30, f"slowest answer {slowest[0]:.1f}s")
    marker = tmp_path / "pwned-metaserver"
    for payload in evil_pickles(marker):
        status, _answer = http(px.url + "/v1/metaserver", raw=payload,
                               headers={"Content-Type": "application/octet-stream"})
        assert status == 400
    assert not marker.exists()
    grown = rss_bytes(px.proc.pid) - rss0
    assert grown < 64 << 20, f"the proxy grew by {grown >> 20} MiB"
    assert fault_report.check("zero", wait_for(
        lambda: http(px.url + "/status")[1]["pending"] == 0, 10), "requests left pending")
    # valid traffic afterwards: D posts its blocks, P gets exactly them
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        client = pool.submit(http, px.url + "/v1/completions", good, timeout=60)
        rid = d.next_request(timeout=30)
        post = {**valid, "request_id": rid}
        assert http(px.url + "/v1/metaserver", post)[0] == 200
        assert wait_for(lambda: p.bodies and p.bodies[-1].get("kv_transfer_params") == post, 10)
        d.release(rid)
        assert fault_report.check("survivor", client.result(60)[0] == 200,
                                  "a valid post afterwards")
    assert fault_report.check("zero", http(px.url + "/status")[1]["pending"] == 0,
                              "requests left pending")
    fault_report(fault="fuzzing the layerwise proxy's POST /v1/metaserver (mutated D posts "
                       "for pending and unknown requests, other JSON, non-JSON, pickles)",
                 happened=f"{sum(statuses.values())} posts answered "
                          f"({', '.join(f'{k}: {v}' for k, v in sorted(statuses.items()))}; "
                          f"{forwarded[0]} well-addressed ones went to P once); no pickle ran; "
                          f"proxy memory {grown / (1 << 20):+.1f} MiB; no request left pending; "
                          "a valid post worked afterwards",
                 deadline=f"yes (slowest answer {slowest[0]:.1f}s)",
                 client="D's post: an HTTP status with a JSON error; the client: D's answer")
