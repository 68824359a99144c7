# SPDX-License-Identifier: Apache-2.0
"""The proxy's settings, request records, errors and Prometheus metrics.

Kept apart from :mod:`.app` (the FastAPI application and the request flows) so that
each stays small; :mod:`.app` re-exports every name.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .balancer import Policy

if TYPE_CHECKING:
    from .router import KvAwareSettings

MODES = ("pull", "layerwise")


@dataclass
class ProxyConfig:
    """Settings of one proxy."""

    prefill: list[str]
    decode: list[str]
    policy: Policy = "round_robin"
    timeout_s: float = 600.0
    health_interval_s: float = 5.0
    mode: str = "pull"
    #: where D instances reach this proxy's metaserver (layerwise mode)
    metaserver_url: str | None = None
    #: pull mode: renew P's lease on a request's blocks this often while D has the request
    #: (covers a request queued on D before D's scheduler sees it); 0 turns it off
    lease_renew_interval_s: float = 5.0
    #: pull mode: re-send a request once as a plain request (D prefills it itself) when D
    #: answers a KV-load error before the client saw a token (:mod:`.fallback`)
    kv_error_fallback: bool = True
    #: the ``kv_aware`` policy's settings (hash algo, seed, block size, events endpoints)
    kv: KvAwareSettings | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"unknown proxy mode {self.mode!r}; expected one of {MODES}")
        if self.mode == "layerwise" and not self.metaserver_url:
            raise ValueError("layerwise mode needs metaserver_url: the URL of this proxy's "
                             "/v1/metaserver as the decode instances reach it")


def truthy(value: Any) -> bool:
    """``true``/``1``/``yes`` (any case) or a JSON true."""
    if isinstance(value, bool):
        return value
    return isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on")


@dataclass
class LayerwiseRequest:
    """A layerwise request between the client, D and (once D posted) P."""

    request_id: str
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    virtual: bool
    #: set with the reason when the prefill step failed
    failed: asyncio.Future[str]
    prefill: asyncio.Task[None] | None = None
    #: kv_aware: the prompt's token ids, fetched while D allocates
    tokens: asyncio.Task[Any] | None = None
    record: dict[str, Any] = field(default_factory=dict)


class ProxyError(Exception):
    """An answer the proxy gives the client itself (status, message)."""

    def __init__(self, status: int, message: str, kind: str = "proxy_error") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    """An OpenAI-style error body."""
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "code": status}})


class Metrics:
    """The proxy's own Prometheus metrics (``vllm_ascend_pd_proxy_*``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("vllm_ascend_pd_proxy_requests", "Client requests by outcome.",
                                ["endpoint", "outcome"], registry=self.registry)
        self.upstream = Counter("vllm_ascend_pd_proxy_upstream_requests",
                                "Requests sent to P and D instances by outcome.",
                                ["role", "instance", "outcome"], registry=self.registry)
        self.stage = Histogram("vllm_ascend_pd_proxy_stage_seconds",
                               "Time of each stage (prefill, decode).", ["stage"],
                               registry=self.registry)
        self.in_flight = Gauge("vllm_ascend_pd_proxy_in_flight", "Requests in flight per "
                               "instance.", ["role", "instance"], registry=self.registry)
        self.fallbacks = Counter("vllm_ascend_pd_proxy_fallbacks",
                                 "Requests re-sent once as plain requests (D prefills them) "
                                 "after D answered a KV-load error, by reason (http_error: "
                                 "an HTTP 500/503 answer; stream_error: an error event "
                                 "before the first token).", ["reason"],
                                 registry=self.registry)
        self.decisions = Counter("vllm_ascend_pd_proxy_routing_decisions",
                                 "Instance choices by role, policy and reason (kv_aware: "
                                 "prefix, load, no_hit, no_index, no_tokens; the others: "
                                 "their policy's name).", ["role", "policy", "reason"],
                                 registry=self.registry)
        self.kv_events = Counter("vllm_ascend_pd_proxy_kv_events",
                                 "KV event stream happenings per P instance (batches, "
                                 "bad_frames, unknown_events, gaps_replayed, gaps_rebuilt, "
                                 "restarts, cleared, drops).", ["instance", "event"],
                                 registry=self.registry)
        self.prompt_tokens = Counter("vllm_ascend_pd_proxy_routed_prompt_tokens",
                                     "Prompt tokens routed by kv_aware, per P instance.",
                                     ["instance"], registry=self.registry)
        self.predicted_hit = Counter("vllm_ascend_pd_proxy_predicted_hit_tokens",
                                     "Prompt tokens kv_aware predicted cached on the "
                                     "instance it chose.", ["instance"], registry=self.registry)
        self.reported_hit = Counter("vllm_ascend_pd_proxy_reported_hit_tokens",
                                    "Cached prompt tokens the instance reported "
                                    "(usage.prompt_tokens_details.cached_tokens).",
                                    ["instance"], registry=self.registry)
        self.hit_predictions = Counter("vllm_ascend_pd_proxy_hit_predictions",
                                       "kv_aware predictions against the instance's report: "
                                       "exact, over, under, unreported.", ["outcome"],
                                       registry=self.registry)
        self.index_blocks = Gauge("vllm_ascend_pd_proxy_prefix_index_blocks",
                                  "Blocks in each P instance's prefix index.", ["instance"],
                                  registry=self.registry)
        self.events_live = Gauge("vllm_ascend_pd_proxy_kv_events_live",
                                 "1 if the instance's KV event stream is live and its index "
                                 "used.", ["instance"], registry=self.registry)
        self.admin = Counter("vllm_ascend_pd_proxy_admin_changes",
                             "Instances added or removed through /admin/instances.",
                             ["role", "action"], registry=self.registry)
        self.healthy = Gauge("vllm_ascend_pd_proxy_instance_healthy", "1 if the instance "
                             "answered its last health check.", ["role", "instance"],
                             registry=self.registry)
