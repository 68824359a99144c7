# SPDX-License-Identifier: Apache-2.0
"""The proxy's FastAPI application.

Pull mode (``MooncakeConnectorV1``): a request goes to a P instance with
``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``; P's
answer carries the params D needs; the original request then goes to a D
instance with those params, and D's answer (streamed or not) is the client's.

Layerwise mode (``MooncakeLayerwiseConnector``): the request goes to a D
instance first, with ``kv_transfer_params={"do_remote_prefill": true,
"metaserver": <this proxy>/v1/metaserver, "request_id": <id>}``. Once D has
allocated blocks it POSTs them to ``/v1/metaserver``; the proxy then sends the
request to a P instance with what D posted as its ``kv_transfer_params`` and
``max_tokens=1``, and P pushes the KV into D's blocks while it prefills. D's
answer is the client's. When P fails, the D request is cancelled (D frees its
blocks) and the client gets the error. A request marked virtual (a
``"do_virtual": true`` body field, ``kv_transfer_params.do_virtual``, or an
``X-KV-Virtual: true`` header) goes to D with ``do_virtual``: D posts nothing
and no P is involved (warm-up, testing). ``/status`` lists the recent requests
with whether D posted them and what P answered.

In pull mode, when D answers a KV-load error (vLLM's default ``kv_load_failure_policy:
fail``: HTTP 500, or in a stream an error event before the first token; see
:mod:`.fallback`), the request is re-sent once to a D instance as a plain request, which
D prefills itself: the client gets tokens, not the error. A stream is held back until
its first token, so the client never sees the failed attempt. Counted in
``vllm_ascend_pd_proxy_fallbacks{reason}``.

Each client request gets one unique id, sent to P and D as ``X-Request-Id``.
A P or D that cannot be reached is marked unhealthy and the next one is
tried; when none answers, the client gets a 503 naming what failed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm_ascend.distributed.kv_transfer.core import auth

from .balancer import Instance, Pool
from .fallback import is_kv_load_error, plain_headers, read_stream_start
from .leases import DecodeLeases
from .model import (
    LayerwiseRequest,
    Metrics,
    ProxyConfig,
    ProxyError,
    error_response,
    truthy,
)
from .router import Decision, KvAwareSettings, KvRouter, prompt_tokens
from .routes import add_operator_routes

logger = logging.getLogger(__name__)

#: Header that marks a request virtual in layerwise mode.
VIRTUAL_HEADER = "x-kv-virtual"
#: How many finished requests ``/status`` lists.
HISTORY = 256

#: Keys the proxy puts in P's ``kv_transfer_params`` (the upstream proxy's request).
PREFILL_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class Proxy:
    """State of a running proxy: instance pools, HTTP client, metrics."""

    def __init__(self, cfg: ProxyConfig) -> None:
        self.cfg = cfg
        self.prefill = Pool("prefill", cfg.prefill, cfg.policy)
        self.decode = Pool("decode", cfg.decode, cfg.policy)
        self.metrics = Metrics()
        #: the deployment key: with one, ``/v1/metaserver`` wants its bearer token
        self.auth = auth.from_env()
        self.client: httpx.AsyncClient | None = None
        self.records: dict[str, Any] = {"requests": 0, "virtual": 0, "metaserver_posts": 0,
                                        "prefill_dispatched": 0, "prefill_failures": 0,
                                        "fallbacks": 0}
        #: layerwise requests waiting for D's metaserver post or in flight
        self.pending: dict[str, LayerwiseRequest] = {}
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self._tasks: set[asyncio.Task[None]] = set()
        #: pull mode: P's leases renewed while D has the request
        self.leases = DecodeLeases(cfg)
        #: the kv_aware policy's prefix indexes (started with the app)
        self.router: KvRouter | None = None
        if cfg.policy == "kv_aware":
            self.router = KvRouter(cfg.kv or KvAwareSettings(), self.metrics)

    def pools(self) -> list[Pool]:
        return [self.prefill, self.decode]

    # ------------------------------------------------------------ instances
    def start_router(self) -> None:
        if self.router is not None:
            for inst in self.prefill.instances:
                self.router.add(inst.url, self.router.settings.events.get(inst.url))

    def prefetch_tokens(self, path: str, body: dict[str, Any]) -> asyncio.Task[Any] | None:
        """Layerwise: tokenize while D allocates, not after it posted (kv_aware)."""
        if self.router is None or self.client is None:
            return None
        healthy = [i for i in self.prefill.instances if i.healthy]
        if not self._predicts(healthy):
            return None
        return asyncio.create_task(prompt_tokens(self.client, healthy[0].url, path, body))

    def _predicts(self, instances: list[Instance]) -> bool:
        """Whether kv_aware can predict a hit on one of ``instances``: its own cache's index
        or its KV pool's is usable (else the prompt is not tokenized: load decides)."""
        assert self.router is not None
        return any(self.router.usable(i.url) is not None
                   or self.router.pool_usable(i.url) is not None for i in instances)

    async def route_prefill(self, path: str, body: dict[str, Any],
                            tokens_task: asyncio.Task[Any] | None = None
                            ) -> tuple[list[Instance], Decision | None]:
        """The P instances in the policy's order for this request (and, under kv_aware,
        the decision to check against P's answer)."""
        order = self.prefill.pick()
        policy = self.cfg.policy
        if self.router is None:
            self.metrics.decisions.labels("prefill", policy, policy).inc()
            return order, None
        assert self.client is not None
        tokens = None
        healthy = [i for i in order if i.healthy] or order
        if self._predicts(healthy):
            tokens = await (tokens_task or prompt_tokens(self.client, healthy[0].url, path,
                                                         body))
        order, decision = self.router.order(order, tokens)
        self.metrics.decisions.labels("prefill", policy, decision.reason).inc()
        return order, decision

    # ------------------------------------------------------------ upstream calls
    async def post_json(self, pool: Pool, path: str, body: dict[str, Any],
                        headers: dict[str, str], order: list[Instance] | None = None
                        ) -> tuple[Instance, httpx.Response]:
        """POST to the first instance of ``pool`` (or of ``order``) that answers; raises
        ProxyError if none does."""
        assert self.client is not None
        errors = []
        for inst in (order if order is not None else pool.pick()):
            pool.begin(inst)
            self.metrics.in_flight.labels(pool.role, inst.url).inc()
            try:
                resp = await self.client.post(inst.url + path, json=body, headers=headers)
            except httpx.HTTPError as exc:
                msg = f"{inst.url}: {type(exc).__name__}: {exc}"
                errors.append(msg)
                pool.end(inst, ok=False, error=msg)
                pool.mark(inst, False, msg)
                self.metrics.upstream.labels(pool.role, inst.url, "unreachable").inc()
                continue
            except BaseException:  # cancelled (layerwise: P failed): the instance is fine
                pool.end(inst, ok=False, error="cancelled")
                raise
            finally:
                self.metrics.in_flight.labels(pool.role, inst.url).dec()
            pool.end(inst, ok=resp.status_code < 500, error=f"HTTP {resp.status_code}")
            self.metrics.upstream.labels(pool.role, inst.url, str(resp.status_code)).inc()
            return inst, resp
        raise ProxyError(503, f"no {pool.role} instance reachable: " + "; ".join(errors),
                         "service_unavailable")

    async def open_stream(self, pool: Pool, path: str, body: dict[str, Any],
                          headers: dict[str, str]) -> tuple[Instance, httpx.Response]:
        """Like :meth:`post_json` but returns an open streaming response."""
        assert self.client is not None
        errors = []
        for inst in pool.pick():
            req = self.client.build_request("POST", inst.url + path, json=body, headers=headers)
            try:
                resp = await self.client.send(req, stream=True)
            except httpx.HTTPError as exc:
                msg = f"{inst.url}: {type(exc).__name__}: {exc}"
                errors.append(msg)
                pool.mark(inst, False, msg)
                self.metrics.upstream.labels(pool.role, inst.url, "unreachable").inc()
                continue
            self.metrics.upstream.labels(pool.role, inst.url, str(resp.status_code)).inc()
            return inst, resp
        raise ProxyError(503, f"no {pool.role} instance reachable: " + "; ".join(errors),
                         "service_unavailable")

    async def health_loop(self) -> None:
        """Probe every instance's ``/health`` periodically, side by side (one after the
        other, an instance slow to answer held back every later mark by up to the probe's
        3 s)."""
        while True:
            await asyncio.gather(*(self._probe(pool, inst) for pool in self.pools()
                                   for inst in pool.instances))
            self.leases.expire()
            await asyncio.sleep(self.cfg.health_interval_s)

    async def _probe(self, pool: Pool, inst: Instance) -> None:
        """One ``/health`` probe of ``inst``, marked in ``pool``."""
        assert self.client is not None
        try:
            r = await self.client.get(inst.url + "/health", timeout=3.0)
            ok, err = r.status_code == 200, f"/health answered {r.status_code}"
        except httpx.HTTPError as exc:
            ok, err = False, f"{type(exc).__name__}: {exc}"
        if not ok and pool is self.prefill and self.router is not None:
            self.router.instance_down(inst.url)  # it may come back empty
        pool.mark(inst, ok, "" if ok else err)
        self.metrics.healthy.labels(pool.role, inst.url).set(1 if ok else 0)

    # ------------------------------------------------------------ P/D flow
    async def handle(self, path: str, body: dict[str, Any],
                     client_headers: Any = None) -> Response:
        request_id = f"pd-{uuid.uuid4().hex}"
        headers = {"X-Request-Id": request_id}
        self.records["requests"] += 1
        stream = bool(body.get("stream"))
        if self.cfg.mode == "layerwise":
            return await self.handle_layerwise(path, body, headers, client_headers or {},
                                               stream=stream, request_id=request_id)
        kv_params = await self.prefill_step(path, body, headers)
        d_body = dict(body)
        d_body.pop("kv_transfer_params", None)
        plain: dict[str, Any] | None = None
        if kv_params is not None:
            plain = dict(d_body) if self.cfg.kv_error_fallback else None
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
        p_body = dict(body)
        p_body["max_tokens"] = 1
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        p_body["stream"] = False
        p_body.pop("stream_options", None)
        p_body["kv_transfer_params"] = dict(PREFILL_PARAMS)
        start = time.perf_counter()
        order, decision = await self.route_prefill(path, body)
        inst, resp = await self.post_json(self.prefill, path, p_body, headers, order)
        self.metrics.stage.labels("prefill").observe(time.perf_counter() - start)
        if decision is not None and self.router is not None:
            self.router.check(decision, inst.url, resp)
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

    # ------------------------------------------------------------ layerwise flow
    async def handle_layerwise(self, path: str, body: dict[str, Any], headers: dict[str, str],
                               client_headers: Any, *, stream: bool,
                               request_id: str) -> Response:
        """D first; P once D posted its blocks to the metaserver (see the module docstring)."""
        body = dict(body)
        client_kv = body.pop("kv_transfer_params", None)
        virtual = (truthy(body.pop("do_virtual", False))
                   or truthy(client_headers.get(VIRTUAL_HEADER, ""))
                   or (isinstance(client_kv, dict) and truthy(client_kv.get("do_virtual"))))
        kv: dict[str, Any] = {"do_remote_decode": False, "do_remote_prefill": True,
                              "metaserver": self.cfg.metaserver_url, "request_id": request_id}
        if virtual:
            kv["do_virtual"] = True
            self.records["virtual"] += 1
        d_body = {**body, "kv_transfer_params": kv}
        loop = asyncio.get_running_loop()
        entry = LayerwiseRequest(request_id, path, body, headers, virtual, loop.create_future(),
                                 record={"request_id": request_id, "virtual": virtual,
                                         "metaserver_post": False, "prefill": None})
        self.pending[request_id] = entry
        entry.tokens = None if virtual else self.prefetch_tokens(path, body)
        start = time.perf_counter()
        try:
            opener = self.open_stream if stream else self.post_json
            d_call = asyncio.ensure_future(opener(self.decode, path, d_body, headers))
            waits: set[asyncio.Future[Any]] = {d_call, entry.failed}
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if d_call not in done:
                d_call.cancel()  # closes the connection: D aborts the request, frees its blocks
                with contextlib.suppress(asyncio.CancelledError, ProxyError, httpx.HTTPError):
                    result = await d_call
                    if stream:
                        await result[1].aclose()
                raise ProxyError(502, f"prefill failed: {entry.failed.result()}",
                                 "prefill_error")
            inst, resp = d_call.result()
        except BaseException:
            self._finish_layerwise(entry)
            raise
        if not stream:
            self.metrics.stage.labels("decode").observe(time.perf_counter() - start)
            self._finish_layerwise(entry)
            return Response(content=resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"),
                            headers={"X-Request-Id": request_id})
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            self._finish_layerwise(entry)
            return Response(content=content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"))
        self.decode.begin(inst)

        async def relay() -> AsyncIterator[bytes]:
            ok = False

            async def close_on_failure() -> None:
                await asyncio.shield(entry.failed)
                await resp.aclose()

            watcher = asyncio.create_task(close_on_failure())
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
                ok = True
            except httpx.HTTPError:
                ok = False
            finally:
                watcher.cancel()
                await resp.aclose()
                self.decode.end(inst, ok=ok, error="" if ok else "stream interrupted")
                self.metrics.stage.labels("decode").observe(time.perf_counter() - start)
                self._finish_layerwise(entry)

        return StreamingResponse(relay(), status_code=200,
                                 media_type=resp.headers.get("content-type",
                                                             "text/event-stream"),
                                 headers={"X-Request-Id": request_id})

    def _finish_layerwise(self, entry: LayerwiseRequest) -> None:
        if entry.tokens is not None:
            entry.tokens.cancel()
        if self.pending.pop(entry.request_id, None) is not None:
            self.history.append(entry.record)

    async def metaserver_post(self, params: dict[str, Any]) -> Response:
        """D's blocks of a pending request: send the request to P with them."""
        rid = params.get("request_id")
        entry = self.pending.get(rid) if isinstance(rid, str) else None
        if entry is None:
            return error_response(404, f"no pending layerwise request {rid!r}",
                                  "unknown_request")
        self.records["metaserver_posts"] += 1
        entry.record["metaserver_post"] = True
        if entry.prefill is not None:
            return JSONResponse({"status": "duplicate"})  # D retried: P already has it
        p_body = dict(entry.body)
        p_body["max_tokens"] = 1
        if "max_completion_tokens" in p_body:
            p_body["max_completion_tokens"] = 1
        p_body["stream"] = False
        p_body.pop("stream_options", None)
        p_body["kv_transfer_params"] = params
        entry.prefill = asyncio.create_task(self._prefill_layerwise(entry, p_body))
        self._tasks.add(entry.prefill)
        entry.prefill.add_done_callback(self._tasks.discard)
        return JSONResponse({"status": "ok"})

    async def _prefill_layerwise(self, entry: LayerwiseRequest, p_body: dict[str, Any]) -> None:
        self.records["prefill_dispatched"] += 1
        start = time.perf_counter()
        try:
            order, decision = await self.route_prefill(entry.path, entry.body, entry.tokens)
            inst, resp = await self.post_json(self.prefill, entry.path, p_body, entry.headers,
                                              order)
        except ProxyError as exc:
            reason = str(exc)
        else:
            self.metrics.stage.labels("prefill").observe(time.perf_counter() - start)
            if decision is not None and self.router is not None:
                self.router.check(decision, inst.url, resp)
            entry.record["prefill"] = resp.status_code
            if resp.status_code == 200:
                return
            reason = f"prefill instance {inst.url} answered {resp.status_code}: {resp.text[:500]}"
        self.records["prefill_failures"] += 1
        entry.record["prefill"] = reason
        logger.warning("layerwise request %s: %s", entry.request_id, reason)
        if not entry.failed.done():
            entry.failed.set_result(reason)

    async def decode_step(self, path: str, body: dict[str, Any], headers: dict[str, str], *,
                          stream: bool, request_id: str,
                          plain: dict[str, Any] | None = None) -> Response:
        """Send the request to D and relay its answer. ``plain``: the request without
        ``kv_transfer_params``, re-sent once if D answers a KV-load error."""
        start = time.perf_counter()
        if not stream:
            inst, resp = await self.post_json(self.decode, path, body, headers)
            if plain is not None and is_kv_load_error(resp.status_code, resp.content):
                self._fall_back(request_id, inst, "http_error", f"HTTP {resp.status_code}")
                inst, resp = await self.post_json(self.decode, path, plain,
                                                  plain_headers(headers))
            self.metrics.stage.labels("decode").observe(time.perf_counter() - start)
            return Response(content=resp.content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type", "application/json"),
                            headers={"X-Request-Id": request_id})
        inst, resp = await self.open_stream(self.decode, path, body, headers)
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


def build_app(cfg: ProxyConfig) -> FastAPI:
    """The FastAPI application of a proxy over ``cfg``'s instances."""
    proxy = Proxy(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        proxy.client = httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout_s, connect=5.0),
                                         limits=limits)
        task = asyncio.create_task(proxy.health_loop())
        proxy.start_router()
        try:
            yield
        finally:
            if proxy.router is not None:
                proxy.router.stop()
            task.cancel()
            for t in list(proxy._tasks):
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            proxy.leases.stop()
            await proxy.client.aclose()

    app = FastAPI(title="vllm-ascend P/D proxy", lifespan=lifespan)
    app.state.proxy = proxy

    async def serve(path: str, request: Request) -> Response:
        endpoint = path.rsplit("/", 1)[-1]
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            proxy.metrics.requests.labels(endpoint, "bad_request").inc()
            return error_response(400, "request body is not valid JSON", "invalid_request_error")
        if not isinstance(body, dict):
            proxy.metrics.requests.labels(endpoint, "bad_request").inc()
            return error_response(400, "request body must be a JSON object",
                                  "invalid_request_error")
        try:
            resp = await proxy.handle(path, body, request.headers)
        except ProxyError as exc:
            proxy.metrics.requests.labels(endpoint, exc.kind).inc()
            logger.warning("%s: %s", path, exc)
            return error_response(exc.status, str(exc), exc.kind)
        proxy.metrics.requests.labels(endpoint, str(resp.status_code)).inc()
        return resp

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve("/v1/chat/completions", request)

    @app.post("/v1/metaserver")
    async def metaserver(request: Request) -> Response:
        if proxy.auth is not None and not proxy.auth.check_header(
                request.headers.get("authorization"), auth.PURPOSE_METASERVER):
            reason = "unauthenticated" if "authorization" not in request.headers else "bad_token"
            auth.count_refusal("proxy-metaserver", reason)
            proxy.metrics.requests.labels("metaserver", "unauthorized").inc()
            logger.warning("/v1/metaserver: refused a POST without the deployment's bearer "
                           "token (%s)", reason)
            resp = error_response(401, "the metaserver needs the deployment's bearer token "
                                  "(Authorization: Bearer ...)", "unauthorized")
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        try:
            params = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
            return error_response(400, "metaserver body is not valid JSON",
                                  "invalid_request_error")
        if not isinstance(params, dict):
            return error_response(400, "metaserver body must be a JSON object",
                                  "invalid_request_error")
        if cfg.mode != "layerwise":
            return error_response(404, "the metaserver is only served in layerwise mode",
                                  "unknown_request")
        return await proxy.metaserver_post(params)

    add_operator_routes(app, proxy)
    return app
