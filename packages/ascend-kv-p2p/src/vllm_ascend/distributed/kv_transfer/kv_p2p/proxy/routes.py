# SPDX-License-Identifier: Apache-2.0
"""The proxy's operator surface: ``/health``, ``/status``, ``/metrics``, ``/v1/models`` and
``/admin/instances`` (add and remove P and D instances while it runs).

``/admin/instances`` is authenticated like ``/v1/metaserver``: with a deployment key set
(``VLLM_ASCEND_KV_AUTH_KEY`` / ``_FILE``) it wants ``Authorization: Bearer <token>``, the token
of purpose ``proxy-admin`` (``vllm-ascend-pd-proxy --print-admin-token`` prints it); without
a key it answers loopback clients only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vllm_ascend.distributed.kv_transfer.core import auth

from .events import EventsEndpoint
from .model import error_response

if TYPE_CHECKING:
    from .instances import Instance
    from .service import Proxy

logger = logging.getLogger(__name__)

#: The bearer-token purpose of ``/admin/instances``.
PURPOSE_ADMIN = "proxy-admin"
_LOOPBACK = ("127.0.0.1", "::1", "localhost", "testclient")


def _refuse_admin(proxy: Proxy, request: Request) -> Response | None:
    """None if the caller may change the instances, else the refusal."""
    if proxy.auth is None:
        host = request.client.host if request.client else ""
        if host in _LOOPBACK:
            return None
        return error_response(403, "without a deployment key /admin/instances answers "
                              "loopback clients only", "forbidden")
    if proxy.auth.check_header(request.headers.get("authorization"), PURPOSE_ADMIN):
        return None
    reason = "unauthenticated" if "authorization" not in request.headers else "bad_token"
    auth.count_refusal("proxy-admin", reason)
    logger.warning("/admin/instances: refused a request without the admin bearer token (%s)",
                   reason)
    resp = error_response(401, "/admin/instances needs the deployment's admin bearer token "
                          "(Authorization: Bearer ...)", "unauthorized")
    resp.headers["WWW-Authenticate"] = "Bearer"
    return resp


def instance_status(proxy: Proxy, role: str) -> list[dict[str, Any]]:
    """Each instance of ``role`` with, for P, what the policy knows of it (kv_aware: its
    index and event stream)."""
    out = []
    for inst in proxy.instances(role).instances:
        d = inst.as_dict()
        if role == "prefill":
            d.update(proxy.policy.instance_status(inst.url))
        out.append(d)
    return out


def events_endpoint(proxy: Proxy, spec: Any) -> EventsEndpoint | None:
    """The KV events endpoint given for a new P (None: none, or the policy follows none).

    Raises:
        ValueError: ``spec`` is not an endpoint.
    """
    if not spec or not proxy.policy.follows_kv_events:
        return None
    return EventsEndpoint.parse(str(spec), proxy.cfg.kv.topic if proxy.cfg.kv else "")


def add_instance(proxy: Proxy, role: str, url: str, events: EventsEndpoint | None
                 ) -> Instance:
    """Add a P or D instance while running (with ``events``: followed by kv_aware)."""
    inst = proxy.instances(role).add(url)
    if role == "prefill":
        proxy.policy.instance_added(inst.url, events)
    return inst


def remove_instance(proxy: Proxy, role: str, url: str) -> Instance:
    """Remove one; its requests in flight finish on it."""
    inst = proxy.instances(role).remove(url)
    if role == "prefill":
        proxy.policy.instance_removed(inst.url)
    return inst


def add_operator_routes(app: FastAPI, proxy: Proxy) -> None:
    """Register the operator endpoints of ``proxy`` on ``app``."""
    cfg = proxy.cfg

    @app.get("/v1/models")
    async def models() -> Response:
        for inst in proxy.decode.pick():
            try:
                r = await proxy.upstream.client.get(inst.url + "/v1/models", timeout=10.0)
            except httpx.HTTPError:
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type", "application/json"))
        return error_response(503, "no decode instance reachable", "service_unavailable")

    @app.get("/health")
    async def health() -> Response:
        ok = proxy.prefill.any_healthy() and proxy.decode.any_healthy()
        return JSONResponse(status_code=200 if ok else 503, content={
            "status": "ok" if ok else "unavailable",
            "prefill": [i.as_dict() for i in proxy.prefill.instances],
            "decode": [i.as_dict() for i in proxy.decode.instances]})

    @app.get("/status")
    async def status() -> Response:
        return JSONResponse({"mode": cfg.mode, "policy": cfg.policy, **proxy.records,
                             "pending": len(proxy.layerwise.pending),
                             "recent": list(proxy.layerwise.history),
                             "prefill": instance_status(proxy, "prefill"),
                             "decode": instance_status(proxy, "decode")})

    @app.get("/metrics")
    async def metrics() -> Response:
        proxy.policy.update_gauges(proxy.metrics, proxy.prefill.instances)
        return Response(generate_latest(proxy.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/admin/instances")
    async def list_instances(request: Request) -> Response:
        if (refused := _refuse_admin(proxy, request)) is not None:
            return refused
        return JSONResponse({"prefill": instance_status(proxy, "prefill"),
                             "decode": instance_status(proxy, "decode")})

    @app.post("/admin/instances")
    async def post_instance(request: Request) -> Response:
        """Body: ``{"role": "prefill"|"decode", "url": ..., "events": "tcp://h:p[,replay]"}``."""
        if (refused := _refuse_admin(proxy, request)) is not None:
            return refused
        try:
            body = await request.json()
            role, url = str(body["role"]), str(body["url"])
            where = events_endpoint(proxy, body.get("events"))
            if role not in ("prefill", "decode"):
                raise ValueError(f"role must be prefill or decode, not {role!r}")
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"url must be http(s)://HOST:PORT, not {url!r}")
        except (ValueError, KeyError, TypeError) as exc:
            return error_response(400, f"bad instance: {exc}", "invalid_request_error")
        try:
            inst = add_instance(proxy, role, url, where)
        except ValueError as exc:
            return error_response(409, str(exc), "conflict")
        proxy.metrics.admin.labels(role, "add").inc()
        logger.info("admin: added %s instance %s", role, inst.url)
        return JSONResponse(status_code=201, content=inst.as_dict())

    @app.delete("/admin/instances")
    async def delete_instance(request: Request, role: str, url: str) -> Response:
        if (refused := _refuse_admin(proxy, request)) is not None:
            return refused
        if role not in ("prefill", "decode"):
            return error_response(400, f"role must be prefill or decode, not {role!r}",
                                  "invalid_request_error")
        try:
            inst = remove_instance(proxy, role, url)
        except KeyError as exc:
            return error_response(404, str(exc.args[0]), "not_found")
        except ValueError as exc:
            return error_response(409, str(exc), "conflict")
        proxy.metrics.admin.labels(role, "remove").inc()
        logger.info("admin: removed %s instance %s (%d in flight finish on it)", role,
                    inst.url, inst.in_flight)
        return JSONResponse(inst.as_dict())
