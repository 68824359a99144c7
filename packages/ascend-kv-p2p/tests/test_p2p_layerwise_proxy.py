# SPDX-License-Identifier: Apache-2.0
"""The P/D proxy in layerwise mode against stand-in P and D servers on loopback.

The stand-in D posts to the proxy's metaserver like D's scheduler does and answers
only once the stand-in P "pushed" (received the request with D's params).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ascend_kv_testing.serving import AppThread
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.app import ProxyConfig, build_app
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.cli import build_parser, metaserver_url


class Cluster:
    """Stand-in D and P instances sharing what P pushed."""

    def __init__(self, *, p_status: int = 200, post_twice: bool = False) -> None:
        self.pushed: dict[str, threading.Event] = {}
        self.d_seen: list[dict[str, Any]] = []
        self.p_seen: list[dict[str, Any]] = []
        self.d_cancelled: list[str] = []
        self.p_status = p_status
        self.post_twice = post_twice
        self.d = AppThread(self._decode_app())
        self.p = AppThread(self._prefill_app())

    def _event(self, rid: str) -> threading.Event:
        return self.pushed.setdefault(rid, threading.Event())

    def _decode_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"ok": "yes"}

        @app.post("/v1/completions")
        async def complete(request: Request) -> Any:
            body = await request.json()
            body["_request_id"] = request.headers.get("x-request-id")
            self.d_seen.append(body)
            kv = body["kv_transfer_params"]
            rid = kv["request_id"]
            if not kv.get("do_virtual"):
                posted = {"request_id": rid, "do_remote_decode": True,
                          "remote_block_ids": [3, 4], "remote_request_id": f"d-{rid}"}
                async with httpx.AsyncClient() as client:
                    for _ in range(2 if self.post_twice else 1):
                        r = await client.post(kv["metaserver"], json=posted)
                        assert r.status_code == 200, r.text
                event = self._event(rid)
                while not event.is_set():
                    if await request.is_disconnected():
                        self.d_cancelled.append(rid)
                        return JSONResponse(status_code=499, content={})
                    await asyncio.sleep(0.01)
            if body.get("stream"):
                async def gen() -> Any:
                    for word in ("hello", " world"):
                        yield f"data: {json.dumps({'choices': [{'text': word}]})}\n\n"
                    yield "data: [DONE]\n\n"
                return StreamingResponse(gen(), media_type="text/event-stream")
            return {"choices": [{"text": "decoded"}], "virtual": bool(kv.get("do_virtual"))}

        return app

    def _prefill_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"ok": "yes"}

        @app.post("/v1/completions")
        async def complete(request: Request) -> Any:
            body = await request.json()
            body["_request_id"] = request.headers.get("x-request-id")
            self.p_seen.append(body)
            if self.p_status != 200:
                return JSONResponse(status_code=self.p_status, content={"error": "boom"})
            self._event(body["kv_transfer_params"]["request_id"]).set()
            return {"choices": [{"text": "p"}]}

        return app

    def __enter__(self) -> Cluster:
        self.d.start()
        self.p.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.d.stop()
        self.p.stop()


@pytest.fixture
def proxy_for() -> Iterator[Any]:
    started: list[AppThread] = []

    def make(cluster: Cluster, *, prefill: list[str] | None = None) -> AppThread:
        port = free_port()
        cfg = ProxyConfig(prefill=prefill or [cluster.p.url], decode=[cluster.d.url],
                          health_interval_s=60, mode="layerwise", timeout_s=30,
                          metaserver_url=f"http://127.0.0.1:{port}/v1/metaserver")
        bg = AppThread(build_app(cfg), port=port)
        started.append(bg.start())
        return bg

    yield make
    for bg in started:
        bg.stop()


def test_layerwise_flow_goes_to_d_first_then_p_with_ds_blocks(proxy_for: Any) -> None:
    with Cluster() as c:
        proxy = proxy_for(c)
        r = httpx.post(proxy.url + "/v1/completions",
                       json={"prompt": "hi", "max_tokens": 12, "stream_options": {"x": 1}},
                       timeout=20)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded"
        d_body, p_body = c.d_seen[-1], c.p_seen[-1]
        kv = d_body["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert kv["metaserver"] == proxy.url + "/v1/metaserver" and "do_virtual" not in kv
        assert d_body["max_tokens"] == 12
        assert p_body["max_tokens"] == 1 and p_body["stream"] is False
        assert "stream_options" not in p_body
        assert p_body["kv_transfer_params"]["remote_block_ids"] == [3, 4]  # what D posted
        assert p_body["_request_id"] == d_body["_request_id"] == r.headers["x-request-id"]
        status = httpx.get(proxy.url + "/status").json()
        assert status["mode"] == "layerwise" and status["pending"] == 0
        assert status["metaserver_posts"] == 1 and status["prefill_dispatched"] == 1
        assert status["recent"][-1] == {"request_id": kv["request_id"], "virtual": False,
                                        "metaserver_post": True, "prefill": 200}


@pytest.mark.parametrize("how", ["header", "body", "kv_transfer_params"])
def test_virtual_requests_skip_the_metaserver_and_p(proxy_for: Any, how: str) -> None:
    with Cluster() as c:
        proxy = proxy_for(c)
        body: dict[str, Any] = {"prompt": "warm up", "max_tokens": 3}
        headers = {}
        if how == "header":
            headers["X-KV-Virtual"] = "true"
        elif how == "body":
            body["do_virtual"] = True
        else:
            body["kv_transfer_params"] = {"do_virtual": True}
        r = httpx.post(proxy.url + "/v1/completions", json=body, headers=headers, timeout=20)
        assert r.status_code == 200 and r.json()["virtual"] is True
        assert c.d_seen[-1]["kv_transfer_params"]["do_virtual"] is True
        assert "do_virtual" not in c.d_seen[-1]  # the proxy's own field is not forwarded
        assert c.p_seen == []
        status = httpx.get(proxy.url + "/status").json()
        assert status["virtual"] == 1 and status["metaserver_posts"] == 0
        assert status["recent"][-1]["virtual"] is True
        assert status["recent"][-1]["metaserver_post"] is False
        # an ordinary request right after is unaffected
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, timeout=20)
        assert r.status_code == 200 and r.json()["virtual"] is False and len(c.p_seen) == 1


@pytest.mark.parametrize("broken", ["status", "unreachable"])
def test_prefill_failure_cancels_d_and_reports(proxy_for: Any, broken: str) -> None:
    with Cluster(p_status=500) as c:
        prefill = [f"http://127.0.0.1:{free_port()}"] if broken == "unreachable" else None
        proxy = proxy_for(c, prefill=prefill)
        start = time.monotonic()
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, timeout=20)
        assert r.status_code == 502 and "prefill failed" in r.json()["error"]["message"]
        assert time.monotonic() - start < 10
        deadline = time.monotonic() + 5
        while not c.d_cancelled and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.d_cancelled == [c.d_seen[-1]["kv_transfer_params"]["request_id"]]
        status = httpx.get(proxy.url + "/status").json()
        assert status["prefill_failures"] == 1 and status["pending"] == 0


def test_duplicate_posts_reach_p_once(proxy_for: Any) -> None:
    with Cluster(post_twice=True) as c:
        proxy = proxy_for(c)
        r = httpx.post(proxy.url + "/v1/completions", json={"prompt": "x"}, timeout=20)
        assert r.status_code == 200 and len(c.p_seen) == 1
        assert httpx.get(proxy.url + "/status").json()["metaserver_posts"] == 2


def test_streaming_is_relayed(proxy_for: Any) -> None:
    with Cluster() as c:
        proxy = proxy_for(c)
        with httpx.stream("POST", proxy.url + "/v1/completions",
                          json={"prompt": "hi", "stream": True}, timeout=20) as r:
            text = "".join(r.iter_text())
        assert r.status_code == 200 and '"hello"' in text and "[DONE]" in text
        assert c.p_seen[-1]["stream"] is False and c.d_seen[-1]["stream"] is True
        deadline = time.monotonic() + 5
        while httpx.get(proxy.url + "/status").json()["pending"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert httpx.get(proxy.url + "/status").json()["pending"] == 0


def test_metaserver_rejects_bad_and_unknown_posts(proxy_for: Any) -> None:
    with Cluster() as c:
        proxy = proxy_for(c)
        url = proxy.url + "/v1/metaserver"
        r = httpx.post(url, json={"request_id": "nobody"})
        assert r.status_code == 404 and "nobody" in r.json()["error"]["message"]
        assert httpx.post(url, content=b"{oops").status_code == 400
        assert httpx.post(url, json=[1]).status_code == 400
        assert c.p_seen == []


def test_pull_mode_has_no_metaserver() -> None:
    from ascend_kv_testing.serving import local_test_client

    with local_test_client(build_app(ProxyConfig(prefill=["http://a"], decode=["http://b"],
                                          health_interval_s=60))) as client:
        assert client.post("/v1/metaserver", json={"request_id": "x"}).status_code == 404


def test_config_and_command_line() -> None:
    with pytest.raises(ValueError, match="needs metaserver_url"):
        ProxyConfig(prefill=["http://a"], decode=["http://b"], mode="layerwise")
    with pytest.raises(ValueError, match="unknown proxy mode"):
        ProxyConfig(prefill=["http://a"], decode=["http://b"], mode="push")
    args = build_parser().parse_args(["--prefill", "p:1", "--decode", "d:2", "--mode",
                                      "layerwise", "--host", "0.0.0.0", "--port", "9000"])
    assert args.mode == "layerwise" and metaserver_url(args) == (
        "http://127.0.0.1:9000/v1/metaserver")
    args = build_parser().parse_args(["--prefill", "p:1", "--decode", "d:2", "--mode",
                                      "layerwise", "--ssl-certfile", "c", "--ssl-keyfile", "k",
                                      "--host", "10.0.0.5"])
    assert metaserver_url(args) == "https://10.0.0.5:8000/v1/metaserver"
    args = build_parser().parse_args(["--prefill", "p:1", "--decode", "d:2",
                                      "--metaserver-url", "https://proxy:1/v1/metaserver"])
    assert args.mode == "pull" and metaserver_url(args) == "https://proxy:1/v1/metaserver"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--prefill", "p", "--decode", "d", "--mode", "push"])
