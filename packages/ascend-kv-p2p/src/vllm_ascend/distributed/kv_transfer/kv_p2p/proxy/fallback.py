# SPDX-License-Identifier: Apache-2.0
"""How the proxy tells that D failed a request's KV load, before the client saw a token.

Under vLLM's default ``kv_load_failure_policy: fail`` a D whose KV load failed finishes the
request with ``finish_reason`` ``error``, which vLLM's OpenAI server turns into a
``GenerationError``:

* a non-streamed request gets HTTP 500 with
  ``{"error": {"message": "Internal server error", "type": "InternalServerError",
  "param": null, "code": 500}}`` (HTTP 503 and ``ServiceUnavailableError`` for vLLM's
  ``RetryableRequestError``);
* a streamed request gets HTTP 200 and the same error object as an SSE event
  (``data: {"error": {...}}``), then ``data: [DONE]``; in pull mode it comes before any
  token (the KV is loaded before the first one), possibly after a chat completion's
  role-only first chunk.

The proxy (:mod:`.app`) re-sends such a request once as a plain request, which D
prefills itself. A stream is held back until its first token (or its error) so that
the client never sees the failed attempt.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

#: vLLM's error types of a failed generation (GenerationError, RetryableRequestError)
GENERATION_ERRORS = {500: "InternalServerError", 503: "ServiceUnavailableError"}
#: Bytes of a stream held back at most while waiting for its first token.
MAX_HELD_BYTES = 64 * 1024


def is_generation_error(error: Any) -> bool:
    """Whether an OpenAI error object is vLLM's failed-generation error."""
    if not isinstance(error, dict):
        return False
    code = error.get("code")
    return isinstance(code, int) and GENERATION_ERRORS.get(code) == error.get("type")


def is_kv_load_error(status: int, body: bytes) -> bool:
    """Whether D's non-streamed answer is what vLLM gives for a failed KV load."""
    if status not in GENERATION_ERRORS:
        return False
    try:
        payload = json.loads(body)
    except ValueError:
        return False
    return isinstance(payload, dict) and is_generation_error(payload.get("error")) and \
        payload["error"]["code"] == status


@dataclass
class StreamStart:
    """The beginning of D's stream, read up to its first token or its error."""

    #: the bytes read so far (forwarded as they are unless ``error``)
    head: bytes
    #: the rest of the stream (the same iterator, not restarted)
    rest: AsyncIterator[bytes]
    #: an error event came before any token
    error: bool


async def read_stream_start(chunks: AsyncIterator[bytes],
                            max_bytes: int = MAX_HELD_BYTES) -> StreamStart:
    """Read D's SSE stream until an event carries a token (or ends it), or a failed
    generation's error event comes first. Beyond ``max_bytes`` without either, or on
    anything that does not parse as vLLM's events, the stream is taken as started."""
    head = b""
    while True:
        try:
            chunk = await chunks.__anext__()
        except StopAsyncIteration:
            return StreamStart(head, _empty(), _verdict(head, final=True) == "error")
        head += chunk
        verdict = _verdict(head, final=False)
        if verdict is not None:
            return StreamStart(head, chunks, verdict == "error")
        if len(head) > max_bytes:
            return StreamStart(head, chunks, False)


async def _empty() -> AsyncIterator[bytes]:
    return
    yield b""  # pragma: no cover  (makes this an async generator)


def _verdict(head: bytes, *, final: bool) -> str | None:
    """``"error"``, ``"started"``, or ``None`` (only a prelude so far) for the complete
    events in ``head`` (the last one too when ``final``)."""
    events = head.replace(b"\r\n", b"\n").split(b"\n\n")
    if not final:
        events = events[:-1]  # the last one may be incomplete
    for event in events:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                return "started"
            try:
                payload = json.loads(data)
            except ValueError:
                return "started"
            if not isinstance(payload, dict):
                return "started"
            if "error" in payload:
                return "error" if is_generation_error(payload["error"]) else "started"
            if _has_token(payload):
                return "started"
    return None


def _has_token(chunk: dict[str, Any]) -> bool:
    """Whether a completion chunk carries output (text, content, tool calls, a finish, or
    usage): anything but a chat completion's role-only first chunk."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return True
    for choice in choices:
        if not isinstance(choice, dict):
            return True
        if choice.get("finish_reason") is not None or choice.get("text"):
            return True
        delta = choice.get("delta")
        if not isinstance(delta, dict):
            if delta is not None:
                return True
            continue
        if any(v for k, v in delta.items() if k != "role"):
            return True
    return False


def plain_headers(headers: dict[str, str]) -> dict[str, str]:
    """Headers of the plain re-send: its own request id on D (the failed one may still be
    known there); the client keeps the original."""
    out = dict(headers)
    out["X-Request-Id"] = f"{headers['X-Request-Id']}-plain"
    return out
