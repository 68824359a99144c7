# SPDX-License-Identifier: Apache-2.0
"""Pull mode (``MooncakeConnectorV1``): P first, then D, which pulls P's KV.

A request goes to a P instance with ``max_tokens=1`` and ``kv_transfer_params={
"do_remote_decode": true}``; P's answer carries the params D needs; the original request
then goes to a D instance with those params, and D's answer (streamed or not) is the
client's. While D has the request, the proxy renews P's lease on its blocks
(:mod:`.leases`).

When D answers a KV-load error (vLLM's default ``kv_load_failure_policy: fail``: HTTP 500,
or in a stream an error event before the first token; see :mod:`.fallback`), the request is
re-sent once to a D instance as a plain request, which D prefills itself: the client gets
tokens, not the error. A stream is held back until its first token, so the client never
sees the failed attempt. Counted in ``vllm_ascend_pd_proxy_fallbacks{reason}``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi.responses import Response, StreamingResponse

from .fallback import is_kv_load_error, plain_headers, read_stream_start
from .model import ProxyError, prefill_body
from .routing import RouteRequest

if TYPE_CHECKING:
    from .instances import Instance, InstanceSet
    from .leases import DecodeLeases
    from .metrics import Metrics
    from .routing import PrefillRouting
    from .upstream import Upstream

logger = logging.getLogger(__name__)

#: Keys the proxy puts in P's ``kv_transfer_params`` (the upstream proxy's request).
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class PullFlow:
    """The pull-mode request: P's prefill, then D with P's params (and the fallback).

    Args:
        routing: the P order of a request.
        decode: the D instances.
        upstream: the calls to P and D.
        leases: P's leases renewed while D has a request.
        metrics: the stage times and fallbacks.
        kv_error_fallback: re-send a request D failed to load once as a plain request.
    """

    def __init__(self, routing: PrefillRouting, decode: InstanceSet, upstream: Upstream,
                 leases: DecodeLeases, metrics: Metrics, *, kv_error_fallback: bool) -> None:
        self.routing = routing
        self.prefill = routing.prefill
        self.decode = decode
        self.upstream = upstream
        self.leases = leases
        self.metrics = metrics
        self.kv_error_fallback = kv_error_fallback
        self.records: dict[str, int] = {"fallbacks": 0}

    async def handle(self, path: str, body: dict[str, Any], headers: dict[str, str], *,
                     stream: bool, request_id: str) -> Response:
        kv_params = await self.prefill_step(path, body, headers)
        d_body = dict(body)
        d_body.pop("kv_transfer_params", None)
        plain: dict[str, Any] | None = None
        if kv_params is not None:
            plain = dict(d_body) if self.kv_error_fallback else None
            d_body["kv_transfer_params"] = kv_params
            self.leases.renew_while_decoding(request_id, kv_params)
        try:
            response = await self.decode_step(path, d_body, headers, stream=stream,
                                              request_id=request_id, plain=plain)
        except BaseException:
            self.leases.stop_renewing(request_id)
            raise
        if not isinstance(response, StreamingResponse):
            self.leases.stop_renewing(request_id)  # a stream stops renewing when it ends
        return response

    async def prefill_step(self, path: str, body: dict[str, Any],
                           headers: dict[str, str]) -> dict[str, Any] | None:
        """Run the prompt on P; return the ``kv_transfer_params`` for D (None: D recomputes)."""
        p_body = prefill_body(body, dict(PREFILL_PARAMS))
        start = time.perf_counter()
        route = await self.routing.route(RouteRequest(path, body, self.upstream.client))
        inst, resp = await self.upstream.post_json(self.prefill, path, p_body, headers,
                                                   route.order)
        self.metrics.stage.labels("prefill").observe(time.perf_counter() - start)
        self.routing.observe(route, inst, resp)
        if resp.status_code != 200:
            raise ProxyError(resp.status_code, f"prefill instance {inst.url} answered "
                             f"{resp.status_code}: {resp.text[:2000]}", "prefill_error")
        try:
            params = resp.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict):
            logger.info("prefill %s returned no kv_transfer_params; decode recomputes", inst.url)
            return None
        return params

    async def decode_step(self, path: str, body: dict[str, Any], headers: dict[str, str], *,
                          stream: bool, request_id: str,
                          plain: dict[str, Any] | None = None) -> Response:
        """Send the request to D and relay its answer. ``plain``: the request without
        ``kv_transfer_params``, re-sent once if D answers a KV-load error."""
        start = time.perf_counter()
        if not stream:
            inst, resp = await self.upstream.post_json(self.decode, path, body, headers)
            if plain is not None and is_kv_load_error(resp.status_code, resp.content):
                self._fall_back(request_id, inst, "http_error", f"HTTP {resp.status_code}")
                inst, resp = await self.upstream.post_json(self.decode, path, plain,
                                                           plain_headers(headers))
            self.metrics.stage.labels("decode").observe(time.perf_counter() - start)
            return Response(content=resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"),
                            headers={"X-Request-Id": request_id})
        inst, resp = await self.upstream.open_stream(self.decode, path, body, headers)
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            if plain is not None and is_kv_load_error(resp.status_code, content):
                self._fall_back(request_id, inst, "http_error", f"HTTP {resp.status_code}")
                return await self.decode_step(path, plain, plain_headers(headers),
                                              stream=True, request_id=request_id)
            return Response(content=content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"))
        self.decode.begin(inst)
        chunks = resp.aiter_raw()
        if plain is not None:
            # Hold the stream back until its first token: an error before it is re-sent.
            try:
                first = await read_stream_start(chunks)
            except BaseException:
                await resp.aclose()
                self.decode.end(inst, ok=False, error="stream interrupted")
                raise
            if first.error:
                await resp.aclose()
                self.decode.end(inst, ok=False, error="KV-load error")
                self._fall_back(request_id, inst, "stream_error", "an error event before "
                                "the first token")
                return await self.decode_step(path, plain, plain_headers(headers),
                                              stream=True, request_id=request_id)
            head, chunks = first.head, first.rest
        else:
            head = b""

        async def relay() -> AsyncIterator[bytes]:
            ok = False
            try:
                if head:
                    yield head
                async for chunk in chunks:
                    yield chunk
                ok = True
            finally:
                self.leases.stop_renewing(request_id)
                await resp.aclose()
                self.decode.end(inst, ok=ok, error="" if ok else "stream interrupted")
                self.metrics.stage.labels("decode").observe(time.perf_counter() - start)

        return StreamingResponse(relay(), status_code=200,
                                 media_type=resp.headers.get("content-type",
                                                             "text/event-stream"),
                                 headers={"X-Request-Id": request_id})

    def _fall_back(self, request_id: str, inst: Instance, reason: str, what: str) -> None:
        """D failed the request's KV load: count and log the plain re-send."""
        self.leases.stop_renewing(request_id)  # P's blocks are not read any more
        self.records["fallbacks"] += 1
        self.metrics.fallbacks.labels(reason).inc()
        logger.warning("request %s: decode instance %s answered a KV-load error (%s); "
                       "re-sending it once as a plain request (D prefills it itself)",
                       request_id, inst.url, what)
