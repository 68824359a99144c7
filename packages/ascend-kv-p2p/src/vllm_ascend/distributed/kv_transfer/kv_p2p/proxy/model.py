# SPDX-License-Identifier: Apache-2.0
"""The proxy's settings, the errors it answers itself, and the request body P gets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi.responses import JSONResponse

if TYPE_CHECKING:
    from .router import KvAwareSettings

MODES = ("pull", "layerwise")


@dataclass
class ProxyConfig:
    """Settings of one proxy."""

    prefill: list[str]
    decode: list[str]
    #: the routing policy's name (:mod:`.policies`)
    policy: str = "round_robin"
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


def prefill_body(body: dict[str, Any], kv_transfer_params: dict[str, Any]) -> dict[str, Any]:
    """The client's request as P gets it: one token, not streamed, with
    ``kv_transfer_params``."""
    p_body = dict(body)
    p_body["max_tokens"] = 1
    if "max_completion_tokens" in p_body:
        p_body["max_completion_tokens"] = 1
    p_body["stream"] = False
    p_body.pop("stream_options", None)
    p_body["kv_transfer_params"] = kv_transfer_params
    return p_body


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
