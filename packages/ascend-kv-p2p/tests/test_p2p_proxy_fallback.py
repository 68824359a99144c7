# SPDX-License-Identifier: Apache-2.0
"""The proxy re-sends a request once as a plain request when D fails its KV load.

Stand-in P and D servers on loopback. D answers a request that carries
``kv_transfer_params`` the way vLLM does when the KV load failed under
``kv_load_failure_policy: fail`` (HTTP 500 ``InternalServerError``; in a stream, an error
event before the first token), and a plain request with tokens.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from ascend_kv_testing.serving import AppThread
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.app import ProxyConfig, build_app
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.fallback import (
    is_kv_load_error,
    read_stream_start,
)

#: vLLM 0.32's answer to a generation that finished with finish_reason "error"
VLLM_ERROR = {"error": {"message": "Internal server error", "type": "InternalServerError",
                        "param": None, "code": 500}}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class Stub:
    """P gives kv_transfer_params; D fails every KV load (``how``) and serves plain
    requests."""

    def __init__(self, role: str, how: str = "http") -> None:
        self.role, self.how = role, how
        self.seen: list[dict[str, Any]] = []
        self.port = free_port()
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"ok": "yes"}

        async def complete(request: Request) -> Any:
            body = await request.json()
            body["_request_id"] = request.headers.get("x-request-id")
            self.seen.append(body)
            if self.role == "prefill":
                return {"choices": [{"text": "p"}], "kv_transfer_params": {
                    "do_remote_prefill": True, "remote_request_id": body["_request_id"],
                    "remote_block_ids": [1, 2]}}
            failing = body.get("kv_transfer_params") is not None or self.how == "always"
            chat = request.url.path.endswith("/chat/completions")
            if not body.get("stream"):
                if failing and self.how == "other_500":
                    return JSONResponse(status_code=500, content={"error": "nope"})
                if failing:
                    return JSONResponse(status_code=500, content=VLLM_ERROR)
                return {"choices": [{"text": "plain tokens", "finish_reason": "length"}]}

            async def gen() -> AsyncIterator[str]:
                if chat:
                    yield sse({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""}}]})
                if failing and self.how == "late":
                    yield sse({"choices": [{"index": 0, "text": "tok"}]})
                if failing:
                    yield sse(VLLM_ERROR)
                    yield "data: [DONE]\n\n"
                    return
                for word in ("plain", " stream"):
                    key = {"delta": {"content": word}} if chat else {"text": word}
                    yield sse({"choices": [{"index": 0, **key}]})
                yield "data: [DONE]\n\n"

            return StreamingResponse(gen(), media_type="text/event-stream")

        app.post("/v1/completions")(complete)
        app.post("/v1/chat/completions")(complete)
        self.app = AppThread(app, port=self.port)

    @property
    def url(self) -> str:
        return self.app.url

    def __enter__(self) -> Stub:
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
                                             health_interval_s=60, lease_renew_interval_s=0,
                                             **kw)))
        c.__enter__()
        clients.append(c)
        return c

    yield make
    for c in clients:
        c.__exit__(None, None, None)


def fallbacks(client: Any, reason: str) -> float:
    text = client.get("/metrics").text
    key = f'vllm_ascend_pd_proxy_fallbacks_total{{reason="{reason}"}} '
    line = next((li for li in text.splitlines() if li.startswith(key)), None)
    return float(line.split()[-1]) if line else 0.0


def test_a_kv_load_error_is_re_sent_once_as_a_plain_request(client_for: Any,
                                                             caplog: Any) -> None:
    with Stub("prefill") as p, Stub("decode") as d:
        client = client_for([p.url], [d.url])
        with caplog.at_level("WARNING"):
            r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == "plain tokens"
        assert [("kv_transfer_params" in b) for b in d.seen] == [True, False]
        rid = r.headers["x-request-id"]
        assert [b["_request_id"] for b in d.seen] == [rid, f"{rid}-plain"]
        assert d.seen[1]["max_tokens"] == 4 and d.seen[1]["prompt"] == "hi"
        assert len(p.seen) == 1  # D prefills the plain request itself
        assert fallbacks(client, "http_error") == 1
        assert client.get("/status").json()["fallbacks"] == 1
        assert [r.levelname for r in caplog.records if "KV-load error" in r.getMessage()] == [
            "WARNING"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_stream_failing_before_its_first_token_is_re_sent(client_for: Any, path: str) -> None:
    with Stub("prefill") as p, Stub("decode") as d:
        client = client_for([p.url], [d.url])
        body = {"prompt": "hi", "messages": [], "stream": True}
        with client.stream("POST", path, json=body) as r:
            text = "".join(r.iter_text())
        assert r.status_code == 200
        assert "plain" in text and " stream" in text and text.endswith("data: [DONE]\n\n")
        assert "error" not in text and text.count("[DONE]") == 1
        assert [("kv_transfer_params" in b) for b in d.seen] == [True, False]
        assert fallbacks(client, "stream_error") == 1


def test_a_stream_failing_after_a_token_is_not_re_sent(client_for: Any) -> None:
    with Stub("prefill") as p, Stub("decode", how="late") as d:
        client = client_for([p.url], [d.url])
        with client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as r:
            text = "".join(r.iter_text())
        assert '"tok"' in text and "InternalServerError" in text
        assert len(d.seen) == 1 and fallbacks(client, "stream_error") == 0


def test_other_errors_are_passed_through(client_for: Any) -> None:
    with Stub("prefill") as p, Stub("decode", how="other_500") as d:
        client = client_for([p.url], [d.url])
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500 and r.json() == {"error": "nope"}
        assert len(d.seen) == 1 and fallbacks(client, "http_error") == 0


def test_only_once(client_for: Any) -> None:
    """The plain request fails too: its answer is the client's, nothing is sent again."""
    with Stub("prefill") as p, Stub("decode", how="always") as d:
        client = client_for([p.url], [d.url])
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500 and r.json() == VLLM_ERROR
        with client.stream("POST", "/v1/completions", json={"prompt": "x", "stream": True}) as s:
            text = "".join(s.iter_text())
        assert "InternalServerError" in text
        assert [("kv_transfer_params" in b) for b in d.seen] == [True, False, True, False]
        assert fallbacks(client, "http_error") == 1 and fallbacks(client, "stream_error") == 1


def test_the_fallback_can_be_turned_off(client_for: Any) -> None:
    with Stub("prefill") as p, Stub("decode") as d:
        client = client_for([p.url], [d.url], kv_error_fallback=False)
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 500 and r.json() == VLLM_ERROR
        assert len(d.seen) == 1


def test_the_plain_request_goes_to_the_next_decode_instance(client_for: Any) -> None:
    with Stub("prefill") as p, Stub("decode") as d1, Stub("decode") as d2:
        client = client_for([p.url], [d1.url, d2.url])
        r = client.post("/v1/completions", json={"prompt": "x"})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "plain tokens"
        firsts = [s.seen[0] for s in (d1, d2)]
        assert sorted("kv_transfer_params" in b for b in firsts) == [False, True]


def test_kv_load_error_recognition() -> None:
    assert is_kv_load_error(500, json.dumps(VLLM_ERROR).encode())
    retryable = {"error": {"message": "m", "type": "ServiceUnavailableError", "code": 503}}
    assert is_kv_load_error(503, json.dumps(retryable).encode())
    assert not is_kv_load_error(500, b'{"error": "nope"}')
    assert not is_kv_load_error(500, b"Internal Server Error")
    assert not is_kv_load_error(400, json.dumps(VLLM_ERROR).encode())
    bad_request = {"error": {"message": "m", "type": "BadRequestError", "code": 500}}
    assert not is_kv_load_error(500, json.dumps(bad_request).encode())


@pytest.mark.parametrize(("events", "error"), [
    ([sse(VLLM_ERROR), "data: [DONE]\n\n"], True),
    ([sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]}), sse(VLLM_ERROR)],
     True),
    ([sse({"choices": [{"text": "a"}]}), sse(VLLM_ERROR)], False),
    ([sse({"choices": [{"text": "", "finish_reason": "length"}]})], False),
    (["data: [DONE]\n\n"], False),
    (["data: not json\n\n", sse(VLLM_ERROR)], False),
    ([sse({"error": {"message": "m", "type": "BadRequestError", "code": 400}})], False),
])
def test_stream_start(events: list[str], error: bool) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for e in events:  # split events across chunks to test the buffering
            data = e.encode()
            yield data[:7]
            yield data[7:]

    async def run() -> tuple[bool, bytes]:
        start = await read_stream_start(chunks())
        rest = b"".join([c async for c in start.rest])
        return start.error, start.head + rest

    got_error, data = asyncio.run(run())
    assert got_error is error
    if not error:
        assert data == "".join(events).encode()  # nothing lost or reordered


def test_cli_flag() -> None:
    from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.cli import build_parser

    base = ["--prefill", "p:1", "--decode", "d:2"]
    assert build_parser().parse_args(base).kv_error_fallback is True
    assert build_parser().parse_args([*base, "--no-kv-error-fallback"]).kv_error_fallback is False
