# SPDX-License-Identifier: Apache-2.0
"""The proxy's FastAPI application: the OpenAI endpoints, the metaserver, the operator routes.

``/v1/completions`` and ``/v1/chat/completions`` go to the running :class:`~.service.Proxy`,
which sends each request through its mode's flow (:mod:`.pull_flow`, :mod:`.layerwise_flow`);
``/v1/metaserver`` takes D's block posts in layerwise mode (with the deployment's bearer
token when a key is set; without one from same-host clients only, ``core.protected``);
``/health``, ``/status``, ``/metrics``, ``/v1/models`` and
``/admin/instances`` are in :mod:`.routes`. An error the proxy answers itself (no instance
reachable, P failed, a bad body) is an OpenAI-style error object.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response

from vllm_ascend.distributed.kv_transfer.core import auth, protected

from .model import ProxyConfig, ProxyError, error_response
from .routes import add_operator_routes, refuse_bearer, refuse_remote
from .service import Proxy

__all__ = ["ProxyConfig", "build_app"]

logger = logging.getLogger(__name__)


def build_app(cfg: ProxyConfig) -> FastAPI:
    """The FastAPI application of a proxy over ``cfg``'s instances."""
    proxy = Proxy(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await proxy.start()
        try:
            yield
        finally:
            await proxy.stop()

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

    metaserver_gate = protected.PeerGate("proxy-metaserver", keyed=proxy.auth is not None)

    @app.post("/v1/metaserver")
    async def metaserver(request: Request) -> Response:
        refused = (refuse_bearer(proxy, request, "/v1/metaserver", auth.PURPOSE_METASERVER,
                                 "proxy-metaserver")
                   or refuse_remote(metaserver_gate, request))
        if refused is not None:
            outcome = "unauthorized" if refused.status_code == 401 else protected.REFUSAL
            proxy.metrics.requests.labels("metaserver", outcome).inc()
            return refused
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
        return await proxy.layerwise.metaserver_post(params)

    add_operator_routes(app, proxy)
    return app
