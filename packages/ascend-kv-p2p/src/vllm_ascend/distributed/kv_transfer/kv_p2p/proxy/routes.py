# SPDX-License-Identifier: Apache-2.0
"""The proxy's operator surface: health, status, metrics, models, instances.

``/health``, ``/status``, ``/metrics``, ``/v1/models`` and ``/admin/instances`` (add and
remove P and D instances while it runs).

``/status`` (instance URLs, recent request ids, P's errors), ``/metrics`` and
``/admin/instances`` are the operator's: with a deployment key set
(``VLLM_ASCEND_KV_AUTH_KEY`` / ``_FILE``) they want ``Authorization: Bearer <token>``, the
token of purpose ``proxy-admin`` (``vllm-ascend-pd-proxy --print-admin-token`` prints it).
Without a key ``/status`` and ``/metrics`` run in protected mode (``core.protected``: same-host
clients only, unless ``VLLM_ASCEND_KV_ALLOW_UNAUTHENTICATED=1``) and ``/admin/instances``
answers same-host clients only, opt-out or not. ``/health`` answers anyone, and says only
whether the proxy can serve (at least one P and one D healthy).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from vllm_ascend.distributed.kv_transfer.core import auth, protected

from .events import EventsEndpoint
from .model import error_response

if TYPE_CHECKING:
    from .instances import Instance
    from .service import Proxy

logger = logging.getLogger(__name__)

#: The bearer-token purpose of ``/status``, ``/metrics`` and ``/admin/instances``.
PURPOSE_ADMIN = "proxy-admin"


def client_host(request: Request) -> str | None:
    """The address the HTTP client connects from (None: unknown). Nothing but an address is
    taken for a local one (a name that uvicorn could take from ``X-Forwarded-For``, where
    ``FORWARDED_ALLOW_IPS`` trusts the sender, is refused by protected mode as unknown)."""
    return request.client.host if request.client else None


def refuse_remote(gate: protected.PeerGate, request: Request) -> Response | None:
    """Protected mode for one endpoint (no key): None if the client is served, else a 403
    naming the two ways out (counted by ``gate``)."""
    refused = gate.refusal(client_host(request))
    return None if refused is None else error_response(403, refused, protected.REFUSAL)


def refuse_bearer(proxy: Proxy, request: Request, what: str, purpose: str, socket: str
                  ) -> Response | None:
    """With a key: None if the request carries the bearer token of ``purpose``, else a 401
    (counted under ``socket``). Without a key: None."""
    if proxy.auth is None or proxy.auth.check_header(request.headers.get("authorization"),
                                                     purpose):
        return None
    reason = "unauthenticated" if "authorization" not in request.headers else "bad_token"
    auth.count_refusal(socket, reason)
    logger.warning("%s: refused a request without the bearer token (%s)", what, reason)
    resp = error_response(401, f"{what} needs the deployment's bearer token "
                          "(Authorization: Bearer ...)", "unauthorized")
    resp.headers["WWW-Authenticate"] = "Bearer"
    return resp


def _refuse_admin(proxy: Proxy, request: Request) -> Response | None:
    """None if the caller may change the instances, else the refusal."""
    if proxy.auth is None:
        if protected.is_local(client_host(request)):
            return None
        return error_response(403, "without a deployment key /admin/instances answers "
                              "clients on the proxy's host only", "forbidden")
    return refuse_bearer(proxy, request, "/admin/instances", PURPOSE_ADMIN, "proxy-admin")


class OperatorAccess:
    """Who may read ``/status`` and ``/metrics``: with a key the admin bearer token, without
    one same-host clients (protected mode)."""

    def __init__(self, proxy: Proxy, path: str) -> None:
        self.proxy = proxy
        self.path = path
        self.socket = "proxy" + path.replace("/", "-")
        self.gate = protected.PeerGate(self.socket, keyed=proxy.auth is not None)

    def refuse(self, request: Request) -> Response | None:
        """None if ``request`` may read the endpoint, else the refusal."""
        if self.proxy.auth is not None:
            return refuse_bearer(self.proxy, request, self.path, PURPOSE_ADMIN, self.socket)
        return refuse_remote(self.gate, request)


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
    status_access = OperatorAccess(proxy, "/status")
    metrics_access = OperatorAccess(proxy, "/metrics")

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
        # anyone may ask: only whether it can serve (instances and errors are in /status)
        ok = proxy.prefill.any_healthy() and proxy.decode.any_healthy()
        return JSONResponse(status_code=200 if ok else 503,
                            content={"status": "ok" if ok else "unavailable"})

    @app.get("/status")
    async def status(request: Request) -> Response:
        if (refused := status_access.refuse(request)) is not None:
            return refused
        return JSONResponse({"mode": cfg.mode, "policy": cfg.policy, **proxy.records,
                             "pending": len(proxy.layerwise.pending),
                             "recent": list(proxy.layerwise.history),
                             "prefill": instance_status(proxy, "prefill"),
                             "decode": instance_status(proxy, "decode")})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if (refused := metrics_access.refuse(request)) is not None:
            return refused
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
