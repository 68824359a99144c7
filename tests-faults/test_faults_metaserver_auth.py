# SPDX-License-Identifier: Apache-2.0
"""With a deployment key, the layerwise proxy's ``POST /v1/metaserver`` serves only D.

A real ``--mode layerwise`` proxy with a key, in front of a stub P and a stub D that holds
each completion pending. Hypothesis sends valid-looking posts for the pending request
(D's exact params, fuzzed bodies) with every bearer an outsider has: none, a wrong token,
the token of another key, a token for another purpose, a malformed header. Every one is
answered 401 and counted; none reaches P; the pending request is untouched. Then D's own
post (the right token) goes to P once, and the client gets its completion.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ascend_kv_testing.faults import evil_pickles, wait_for
from ascend_kv_testing.fuzzing import json_bodies
from ascend_kv_testing.procs import free_port
from ascend_kv_testing.serving import MODEL_NAME, StubInstance, http, proxy, serve_env
from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.auth import Authenticator
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.routes import PURPOSE_ADMIN

KEY = "metaserver-fuzz-deployment-key-0123456789"
BS = 32
EXAMPLES = max(30, int(os.environ.get("VLLM_ASCEND_KV_FUZZ_EXAMPLES", "40")) // 4)
UNAUTHORIZED = 'vllm_ascend_pd_proxy_requests_total{endpoint="metaserver",outcome="unauthorized"}'


def bearer(key: str, purpose: str = auth.PURPOSE_METASERVER) -> str:
    return Authenticator([key.encode()]).bearer_token(purpose)


#: What an outsider can put in the Authorization header.
OUTSIDER_HEADERS: list[dict[str, str]] = [
    {},
    {"Authorization": "Bearer " + "0" * 64},
    {"Authorization": "Bearer " + bearer("an-outsiders-guess-at-the-key-0000")},
    {"Authorization": "Bearer " + bearer(KEY, purpose="something-else")},
    {"Authorization": bearer(KEY)},  # the right token without the scheme
    {"Authorization": "Basic " + bearer(KEY)},
    {"Authorization": "Bearer"},
]


def admin() -> dict[str, str]:
    """The header of the proxy's operator: with a key, /status and /metrics want it."""
    return {"Authorization": "Bearer " + bearer(KEY, purpose=PURPOSE_ADMIN)}


def unauthorized(url: str) -> float:
    status, text = http(url + "/metrics", headers=admin())
    assert status == 200
    total = 0.0
    for line in str(text).splitlines():
        if line.startswith(UNAUTHORIZED):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def keyed_proxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    logs = tmp_path_factory.mktemp("proxy-lw-keyed-logs")
    p, d = StubInstance(), StubInstance(hold=True)
    env = serve_env(VLLM_ASCEND_KV_AUTH_KEY=KEY)
    env.pop(auth.ENV_KEY_FILE, None)
    px = proxy("proxy-lw-keyed", logs, [p.url], [d.url], "--mode", "layerwise", env=env)
    try:
        px.wait_ready(60)
        yield {"p": p, "d": d, "proxy": px}
    finally:
        px.stop()
        p.close()
        d.close()


def test_keyed_metaserver_refuses_every_outsider(keyed_proxy: dict[str, Any], tmp_path: Path,
                                                 fault_report: Any) -> None:
    from vllm_ascend.distributed.kv_transfer.kv_p2p.params import params_for_prefill

    p, d, px = keyed_proxy["p"], keyed_proxy["d"], keyed_proxy["proxy"]
    valid = params_for_prefill(proxy_request_id="placeholder", block_ids=[3, 4, 5],
                               block_size=BS, engine_id="stub-d", host="127.0.0.1",
                               port=free_port(), request_id="stub-d-1", tp_size=1,
                               cached_tokens=0, push_token=auth.capability_token())
    good = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2}
    counted0 = unauthorized(px.url)
    sent = [0]
    slowest = [0.0]
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        client = pool.submit(http, px.url + "/v1/completions", good, timeout=120)
        rid = d.next_request(timeout=30)
        n_p = len(p.bodies)

        @settings(max_examples=EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(body=json_bodies({**valid, "request_id": rid}),
               headers=st.sampled_from(OUTSIDER_HEADERS), exact=st.booleans())
        def fuzz(body: bytes, headers: dict[str, str], exact: bool) -> None:
            data = json.dumps({**valid, "request_id": rid}).encode() if exact else body
            start = time.monotonic()
            status, answer = http(px.url + "/v1/metaserver", raw=data, headers=headers,
                                  timeout=30)
            slowest[0] = max(slowest[0], time.monotonic() - start)
            sent[0] += 1
            assert px.proc.poll() is None, "the proxy died"
            assert status == 401, (status, answer, headers)
            assert len(p.bodies) == n_p, "an outsider's post reached P"

        fuzz()
        fault_report.check("deadline", slowest[0] < 30, f"slowest answer {slowest[0]:.2f}s")
        marker = tmp_path / "pwned-keyed-metaserver"
        for payload in evil_pickles(marker):
            status, _answer = http(px.url + "/v1/metaserver", raw=payload,
                                   headers={"Content-Type": "application/octet-stream"})
            sent[0] += 1
            assert status == 401
        assert not marker.exists()
        counted = unauthorized(px.url) - counted0
        fault_report.check("zero", len(p.bodies) == n_p, f"{len(p.bodies) - n_p} posts reached P")
        assert counted == sent[0], (counted, sent[0])
        # D's own post, with the deployment's token: P gets exactly it, once
        post = {**valid, "request_id": rid}
        status, answer = http(px.url + "/v1/metaserver", post,
                              headers={"Authorization": "Bearer " + bearer(KEY)})
        assert status == 200, answer
        assert wait_for(lambda: len(p.bodies) == n_p + 1, 10)
        assert p.bodies[-1]["kv_transfer_params"] == post
        d.release(rid)
        answer_c = client.result(120)
    assert fault_report.check("survivor", answer_c[0] == 200, f"client got {answer_c[0]}")
    assert fault_report.check("zero", wait_for(
        lambda: http(px.url + "/status", headers=admin())[1]["pending"] == 0, 10),
        "requests left pending")
    # the proxy still answers /metrics, to its operator only
    assert http(px.url + "/metrics", headers=admin())[0] == 200
    assert http(px.url + "/metrics")[0] == 401
    fault_report(fault="posts to a keyed proxy's /v1/metaserver without the deployment's "
                       "bearer token (none, wrong, another key's, another purpose's, "
                       "malformed; fuzzed bodies and D's exact params; pickles)",
                 happened=f"{sent[0]} posts answered 401 and counted in "
                          "vllm_ascend_pd_proxy_requests_total{outcome=unauthorized}; none "
                          "reached P; the pending request then completed with D's own post",
                 deadline=f"yes (slowest answer {slowest[0]:.2f}s)",
                 client="the outsider: 401; the client: its completion")
