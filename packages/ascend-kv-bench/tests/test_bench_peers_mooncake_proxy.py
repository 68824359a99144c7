# SPDX-License-Identifier: Apache-2.0
"""The proxy ``bench client`` runs in front of vLLM's own ``MooncakeConnector`` P/D pair
(``bench/peers/vllm_mooncake_proxy.py``, a script of the peers' directory, not a module of
the package): what P and D are sent, and what the client gets back, against stand-ins of
P and D."""

from __future__ import annotations

import json
import sys
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from vllm_ascend.distributed.kv_transfer.bench.serve.needs import PEERS_DIR

sys.path.insert(0, str(PEERS_DIR))
import vllm_mooncake_proxy as proxy

P, D = "http://p:1", "http://d:2"
BOOT = "http://127.0.0.1:8998"


class Upstreams:
    """P and D as httpx sees them: the requests they got, and their answers."""

    def __init__(self, p_status: int = 200, d_down: bool = False) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.p_status, self.d_down = p_status, d_down

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        role = "p" if host == P else "d"
        if request.url.path == "/health":
            down = role == "d" and self.d_down
            return httpx.Response(503 if down else 200)
        body = json.loads(request.content)
        self.seen.append((role, body))
        if role == "p":
            return httpx.Response(self.p_status, json={"choices": [{"text": "x"}]})
        if body.get("stream"):
            chunks = b"".join(f"data: {json.dumps({'choices': [{'text': t}]})}\n\n".encode()
                              for t in ("a", "b")) + b"data: [DONE]\n\n"

            async def events() -> Any:  # streamed, as D's server sends them
                for line in chunks.split(b"\n\n")[:-1]:
                    yield line + b"\n\n"

            return httpx.Response(200, content=events(),
                                  headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"choices": [{"text": "ab"}]})


def client(up: Upstreams) -> TestClient:
    app = proxy.build_app(P, D, "eng-p", BOOT, transport=httpx.MockTransport(up))
    return TestClient(app)


@pytest.mark.parametrize("stream", [False, True])
def test_p_and_d_get_vllms_protocol_with_one_transfer_id(stream: bool) -> None:
    up = Upstreams()
    body = {"model": "m", "prompt": "1 2 3", "max_tokens": 32, "stream": stream,
            "stream_options": {"include_usage": True}}
    with client(up) as c:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200
        if stream:
            assert r.text.count("data: ") == 3 and r.text.endswith("data: [DONE]\n\n")
        else:
            assert r.json()["choices"][0]["text"] == "ab"
        c.post("/v1/completions", json=body)
        status = c.get("/status").json()
    (p1, p_body), (d1, d_body) = sorted(up.seen[:2], key=lambda x: x[0] != "p")
    assert (p1, d1) == ("p", "d")
    tid = p_body["kv_transfer_params"]["transfer_id"]
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True,
                                            "do_remote_prefill": False, "transfer_id": tid}
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert "stream_options" not in p_body and p_body["prompt"] == "1 2 3"
    assert d_body["kv_transfer_params"] == {
        "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": "eng-p",
        "remote_bootstrap_addr": BOOT, "remote_dp_rank": 0, "transfer_id": tid}
    assert d_body["max_tokens"] == 32 and d_body["stream"] is stream
    # the second request has a transfer id of its own
    tids = {b["kv_transfer_params"]["transfer_id"] for _, b in up.seen}
    assert len(up.seen) == 4 and len(tids) == 2
    assert status["prefill"] == [{"url": P, "served": 2}]
    assert status["decode"] == [{"url": D, "served": 2}]
    assert status["fallbacks"] == 0 and status["prefill_errors"] == 0


def test_chat_and_max_completion_tokens() -> None:
    up = Upstreams()
    with client(up) as c:
        r = c.post("/v1/chat/completions", json={"model": "m", "messages": [],
                                                 "max_completion_tokens": 9})
    assert r.status_code == 200
    p_body = next(b for role, b in up.seen if role == "p")
    d_body = next(b for role, b in up.seen if role == "d")
    assert p_body["max_completion_tokens"] == 1 and d_body["max_completion_tokens"] == 9


def test_a_failed_prefill_is_counted_and_bad_bodies_refused() -> None:
    up = Upstreams(p_status=500)
    with client(up) as c:
        assert c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code \
            == 200  # D's answer is the client's
        assert c.get("/status").json()["prefill_errors"] == 1
        assert c.post("/v1/completions", json=[1, 2]).status_code == 400


def test_health_needs_p_and_d() -> None:
    with client(Upstreams()) as c:
        assert c.get("/health").status_code == 200
    with client(Upstreams(d_down=True)) as c:
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["down"] == D
