# SPDX-License-Identifier: Apache-2.0
"""The P/D proxy against stand-in P and D servers on loopback."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ascend_kv_testing.serving import AppThread
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.app import ProxyConfig, build_app
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.instances import InstanceSet
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.policies import LeastLoaded


class FakeVLLM:
    """A stand-in ``vllm serve``: P answers with kv_transfer_params, D with a completion."""

    def __init__(self, role: str, *, give_params: bool = True, status: int = 200,
                 health_held: threading.Event | None = None) -> None:
        self.role = role
        self.give_params = give_params
        self.status = status
        self.seen: list[dict[str, Any]] = []
        self.port = free_port()
        self.health_pending = 0  # /health calls not answered yet
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            self.health_pending += 1
            try:  # a busy instance: /health answers once health_held is set (2.5 s at most)
                deadline = time.monotonic() + 2.5
                while (health_held is not None and not health_held.is_set()
                       and time.monotonic() < deadline):
                    await asyncio.sleep(0.01)
            finally:
                self.health_pending -= 1
            return {"ok": "yes"}

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"data": [{"id": "tiny"}]}

        async def complete(request: Request) -> Any:
            body = await request.json()
            body["_request_id"] = request.headers.get("x-request-id")
            self.seen.append(body)
            if self.status != 200:
                return JSONResponse(status_code=self.status, content={"error": "nope"})
            if self.role == "prefill":
                params = ({"do_remote_prefill": True, "remote_request_id": body["_request_id"],
                           "remote_block_ids": [1, 2]} if self.give_params else None)
                return {"choices": [{"text": "p"}], "kv_transfer_params": params}
            if body.get("stream"):
                async def gen() -> Any:
                    for word in ("hello", " world"):
                        yield f"data: {json.dumps({'choices': [{'text': word}]})}\n\n"
                    yield "data: [DONE]\n\n"
                return StreamingResponse(gen(), media_type="text/event-stream")
            return {"choices": [{"text": f"decoded-{self.port}"}],
                    "echo_params": body.get("kv_transfer_params")}

        app.post("/v1/completions")(complete)
        app.post("/v1/chat/completions")(complete)
        self.app = AppThread(app, port=self.port)

    @property
    def url(self) -> str:
        return self.app.url

    def __enter__(self) -> FakeVLLM:
        self.app.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.app.stop()


@pytest.fixture
def client_for() -> Iterator[Any]:
    from ascend_kv_testing.serving import local_test_client

    clients = []

    def make(prefill: list[str], decode: list[str], **kw: Any) -> Any:
        c = local_test_client(build_app(ProxyConfig(prefill=prefill, decode=decode,
                                             health_interval_s=60, **kw)))
        c.__enter__()
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def test_pull_flow_and_request_ids(client_for: Any) -> None:
    with FakeVLLM("prefill") as p, FakeVLLM("decode") as d:
        client = client_for([p.url], [d.url])
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 12,
                                                 "stream_options": {"x": 1}})
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == f"decoded-{d.port}"
        sent_p, sent_d = p.seen[-1], d.seen[-1]
        assert sent_p["max_tokens"] == 1 and sent_p["stream"] is False
        assert "stream_options" not in sent_p
        assert sent_p["kv_transfer_params"]["do_remote_decode"] is True
        assert sent_d["max_tokens"] == 12
        assert sent_d["kv_transfer_params"]["remote_request_id"] == sent_p["_request_id"]
        assert sent_p["_request_id"] == sent_d["_request_id"] == r.headers["x-request-id"]
        r2 = client.post("/v1/chat/completions", json={"messages": [], "max_completion_tokens": 5})
        assert r2.status_code == 200 and p.seen[-1]["max_completion_tokens"] == 1
        assert r2.headers["x-request-id"] != r.headers["x-request-id"]  # unique per request


def test_streaming_is_relayed(client_for: Any) -> None:
    with FakeVLLM("prefill") as p, FakeVLLM("decode") as d:
        client = client_for([p.url], [d.url])
        with client.stream("POST", "/v1/completions",
                           json={"prompt": "hi", "stream": True}) as r:
            text = "".join(r.iter_text())
        assert r.status_code == 200
        assert '"hello"' in text and '" world"' in text and "[DONE]" in text
        assert p.seen[-1]["stream"] is False and d.seen[-1]["stream"] is True


def test_round_robin_and_failover(client_for: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with FakeVLLM("prefill") as p, FakeVLLM("decode") as d1, FakeVLLM("decode") as d2:
        client = client_for([dead, p.url], [d1.url, d2.url])
        texts = {client.post("/v1/completions", json={"prompt": "x"}).json()["choices"][0]["text"]
                 for _ in range(4)}
        assert texts == {f"decoded-{d1.port}", f"decoded-{d2.port}"}
        status = client.get("/status").json()
        assert status["prefill"][0]["healthy"] is False  # the dead P was skipped and marked
        assert status["prefill"][1]["served"] == 4


def test_nothing_reachable_is_a_clear_503(client_for: Any) -> None:
    dead_p, dead_d = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    with FakeVLLM("prefill") as p:
        client = client_for([dead_p], [dead_d])
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503
        assert "no prefill instance reachable" in r.json()["error"]["message"]
        assert dead_p in r.json()["error"]["message"]
        client2 = client_for([p.url], [dead_d])
        r = client2.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and "no decode instance reachable" in r.text
        # P up, D dead: the health round marks D and /health says it cannot serve
        deadline = time.monotonic() + 10
        while client2.get("/health").status_code != 503 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client2.get("/health").json() == {"status": "unavailable"}


def test_upstream_errors_and_bad_requests(client_for: Any) -> None:
    with FakeVLLM("prefill", status=400) as p, FakeVLLM("decode") as d:
        client = client_for([p.url], [d.url])
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 400 and "prefill instance" in r.json()["error"]["message"]
        assert client.post("/v1/completions", content=b"{not json").status_code == 400
        assert client.post("/v1/completions", json=[1, 2]).status_code == 400
        metrics = client.get("/metrics").text
        assert "vllm_ascend_pd_proxy_requests_total" in metrics
        assert 'outcome="bad_request"' in metrics


def test_prefill_without_params_lets_decode_recompute(client_for: Any) -> None:
    with FakeVLLM("prefill", give_params=False) as p, FakeVLLM("decode") as d:
        client = client_for([p.url], [d.url])
        r = client.post("/v1/completions", json={"prompt": "x", "kv_transfer_params": {"a": 1}})
        assert r.status_code == 200 and "kv_transfer_params" not in d.seen[-1]


def test_least_loaded_prefers_idle_instances() -> None:
    decode = InstanceSet("decode", ["http://a", "http://b", "http://c"], LeastLoaded())
    a, b, c = decode.instances
    decode.begin(a)
    decode.begin(a)
    decode.begin(b)
    assert decode.pick()[0] is c
    decode.mark(c, False)
    assert decode.pick()[0] is b and decode.pick()[-1] is c
    with pytest.raises(ValueError, match="no decode instance"):
        InstanceSet("decode", [], LeastLoaded())


def test_a_slow_health_answer_delays_no_other_instance(client_for: Any) -> None:
    """The health round probes the instances side by side: one slow to answer ``/health``
    (a starved engine; each probe may take up to 3 s) does not hold back marking the
    others, nor the proxy's lease bookkeeping that runs after each round."""
    dead = f"http://127.0.0.1:{free_port()}"
    held = threading.Event()
    with FakeVLLM("prefill", health_held=held) as slow, FakeVLLM("decode") as d:
        client = client_for([slow.url, dead], [d.url])  # slow is probed first
        try:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if client.get("/status").json()["prefill"][1]["healthy"] is False:
                    break
                time.sleep(0.02)
            h = client.get("/status").json()
            assert h["prefill"][1]["healthy"] is False, h
            assert slow.health_pending == 1  # marked while the slow probe still waits
        finally:
            held.set()


def test_health_loop_marks_instances(client_for: Any) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with FakeVLLM("prefill") as p, FakeVLLM("decode") as d:
        client = client_for([p.url, dead], [d.url])  # the first health round runs at start
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            h = client.get("/status").json()
            if h["prefill"][1]["healthy"] is False:
                break
            time.sleep(0.1)
        assert h["prefill"][0]["healthy"] is True and h["prefill"][1]["healthy"] is False
        # /health says only whether the proxy can serve: nothing of its instances
        assert client.get("/health").json() == {"status": "ok"}
        models = client.get("/v1/models")
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"


def test_proxy_starts_without_torch_or_vllm() -> None:
    """The proxy is a router: its command line and everything it starts (kv_aware's event
    decoder and block hashes, the lease renewer's messages) import neither torch nor vLLM,
    each seconds of a start on a loaded host (a fleet's proxy replaced or scaled out)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.cli\n"
            "from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.events import event_decoder\n"
            "from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.prefix_index import "
            "PrefixCacheHasher\n"
            "event_decoder()\n"
            "assert len(PrefixCacheHasher('sha256_cbor').keys(list(range(64)), 16)) == 4\n"
            "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
