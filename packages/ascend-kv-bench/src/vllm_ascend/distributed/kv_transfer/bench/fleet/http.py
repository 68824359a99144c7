# SPDX-License-Identifier: Apache-2.0
"""A minimal HTTP/1.1 server and client on asyncio streams, for the simulated fleet.

Hundreds of stand-in instances share one process and one event loop, so each costs a
listening socket and a coroutine a connection, not a web framework: requests with a
``Content-Length`` body (what the routers send: httpx and reqwest both set it; a chunked
request body is read too), answers with a ``Content-Length`` body, keep-alive. The client is
the driver's: one connection pool, JSON in and out, nothing streamed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

#: The most a request's head or body may hold (the routers' prompts are far smaller).
MAX_BODY = 64 << 20
REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 500: "Internal Server Error",
           503: "Service Unavailable"}


@dataclass
class Request:
    """One request: method, path (query apart), query string, headers (lower-case), body."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        """The body decoded as JSON."""
        return json.loads(self.body or b"null")


@dataclass
class Response:
    """An answer: status, body, content type, extra headers."""

    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of_json(cls, doc: Any, status: int = 200) -> Response:
        return cls(status, json.dumps(doc, separators=(",", ":")).encode())


Handler = Callable[[Request], Awaitable[Response]]


async def _read_request(reader: asyncio.StreamReader) -> Request | None:
    """The next request of a connection; None when the peer closed it."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    except asyncio.LimitOverrunError as exc:
        raise ValueError("request head too long") from exc
    lines = head.decode("latin-1").split("\r\n")
    method, target, _ = lines[0].split(" ", 2)
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            body += await reader.readexactly(size + 2)
            del body[-2:]
            if len(body) > MAX_BODY:
                raise ValueError("request body too long")
    else:
        n = int(headers.get("content-length", "0"))
        if n > MAX_BODY:
            raise ValueError("request body too long")
        body = bytearray(await reader.readexactly(n)) if n else bytearray()
    path, _, query = target.partition("?")
    return Request(method.upper(), path, query, headers, bytes(body))


def _encode(resp: Response, keep_alive: bool) -> bytes:
    head = [f"HTTP/1.1 {resp.status} {REASONS.get(resp.status, 'OK')}",
            f"content-type: {resp.content_type}", f"content-length: {len(resp.body)}",
            "connection: " + ("keep-alive" if keep_alive else "close")]
    head += [f"{k}: {v}" for k, v in resp.headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + resp.body


class Server:
    """One listening socket on ``host:port`` (0: a free one) answering with ``handler``.

    :meth:`close` stops listening and drops every open connection (a killed instance);
    the routers then see refused connections and resets, as from a dead process.
    """

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0) -> None:
        self.handler = handler
        self.host = host
        self.port = port
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.StreamWriter] = set()

    async def start(self) -> Server:
        self._server = await asyncio.start_server(self._serve, self.host, self.port,
                                                  backlog=1024, limit=MAX_BODY)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._conns.add(writer)
        try:
            while True:
                try:
                    req = await _read_request(reader)
                except (ValueError, asyncio.IncompleteReadError):
                    writer.write(_encode(Response(400, b"bad request", "text/plain"), False))
                    break
                if req is None:
                    break
                try:
                    resp = await self.handler(req)
                except Exception as exc:  # an answer, never a dropped connection
                    resp = Response.of_json({"error": {"message": repr(exc)[:500]}}, 500)
                keep = req.headers.get("connection", "").lower() != "close"
                writer.write(_encode(resp, keep))
                await writer.drain()
                if not keep:
                    break
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._conns.discard(writer)
            writer.close()

    async def close(self, on_attempt: Callable[[str], None] | None = None) -> None:
        """Stop serving and reset every connection. With ``on_attempt``, the port keeps a
        listener that reads each new connection's request line, resets the connection and
        calls ``on_attempt`` with the request's path (a health probe is told from a request
        routed here): a dead instance's attempts are counted (a dead process's port refuses
        the connection; a router sees a reset instead, an error of the same kind)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for w in list(self._conns):
            w.transport.abort()
        self._conns.clear()
        if on_attempt is not None:
            async def reset(reader: asyncio.StreamReader,
                            writer: asyncio.StreamWriter) -> None:
                try:
                    line = await asyncio.wait_for(reader.readline(), 1.0)
                except (TimeoutError, ConnectionError, ValueError):
                    line = b""
                parts = line.decode("latin-1").split(" ")
                on_attempt(parts[1].split("?", 1)[0] if len(parts) > 1 else "")
                writer.transport.abort()

            self._server = await asyncio.start_server(reset, self.host, self.port)


class Client:
    """A keep-alive HTTP/1.1 client to one ``host:port``: up to ``size`` connections.

    A pooled connection the server closed meanwhile (an idle keep-alive timing out just as a
    request goes out: the server answers nothing) is retried once on a new connection, as
    httpx does; a new connection that fails is an error."""

    def __init__(self, host: str, port: int, size: int = 256) -> None:
        self.host, self.port = host, port
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._sem = asyncio.Semaphore(size)

    async def request(self, method: str, path: str, doc: Any = None,
                      timeout: float = 120.0) -> tuple[int, bytes]:
        """One request (``doc`` as the JSON body); its status and body."""
        async with self._sem:
            body = b"" if doc is None else json.dumps(doc, separators=(",", ":")).encode()
            for attempt in (0, 1):  # a pooled connection the server closed: once more, fresh
                fresh = attempt == 1 or not self._idle
                reader, writer = (await asyncio.open_connection(self.host, self.port,
                                                                limit=MAX_BODY)
                                  if fresh else self._idle.pop())
                try:
                    writer.write((f"{method} {path} HTTP/1.1\r\nhost: {self.host}\r\n"
                                  f"content-type: application/json\r\n"
                                  f"content-length: {len(body)}\r\n\r\n").encode() + body)
                    status, data, keep = await asyncio.wait_for(_read_response(reader),
                                                                timeout)
                except (ConnectionError, asyncio.IncompleteReadError):
                    writer.close()
                    if fresh or attempt:
                        raise
                    continue
                except BaseException:
                    writer.close()
                    raise
                if keep:
                    self._idle.append((reader, writer))
                else:
                    writer.close()
                return status, data
        raise ConnectionError("unreachable")  # pragma: no cover - the loop returns or raises

    async def close(self) -> None:
        for _, w in self._idle:
            w.close()
        self._idle.clear()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    status = int(head[0].split(" ", 2)[1])
    headers = {}
    for line in head[1:]:
        if ":" in line:
            k, v = line.split(":", 1)
            headers[k.strip().lower()] = v.strip()
    if headers.get("transfer-encoding", "").lower() == "chunked":
        body = bytearray()
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            body += await reader.readexactly(size + 2)
            del body[-2:]
        data = bytes(body)
    elif "content-length" in headers:
        data = await reader.readexactly(int(headers["content-length"]))
    else:
        data = await reader.read()
        return status, data, False
    return status, data, headers.get("connection", "").lower() != "close"
