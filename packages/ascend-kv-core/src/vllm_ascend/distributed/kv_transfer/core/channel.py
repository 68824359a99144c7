# SPDX-License-Identifier: Apache-2.0
"""ZeroMQ request/reply endpoints that speak the :mod:`.wire` format.

:class:`RpcServer` serves a ROUTER socket on a daemon thread: each request is
decoded, handed to a handler, and answered. Garbage, oversize frames,
unknown message types and handler exceptions are answered with an
:class:`~.wire.ErrorReply` (or dropped by ZeroMQ when over the size limit);
the thread keeps serving. :class:`RpcClient` sends one request at a time
with a timeout and survives a peer that never answers.

With a deployment key configured (:mod:`.auth`), both ends seal every frame in
a signed envelope and open the peer's: a request that fails the check never
reaches the handler (it is answered ``ErrorReply(code="auth_refused")`` and
counted), a reply is accepted only if it is signed for the very request it answers, and a
request only by the server it was sealed for (its port: a frame captured on its way to one
rank is refused by another as ``misdirected``). Without a key the bytes on the wire are
exactly the plain :mod:`.wire` frames, and a TCP server runs in protected mode
(:mod:`.protected`): a request from a peer on another host (ZeroMQ's ``Peer-Address`` of
the frame) never reaches the handler; it is answered ``ErrorReply(code="protected_mode")``
and counted.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Generic

import zmq

from . import auth as _auth
from . import protected
from .errors import EndpointInUseError, PeerTimeoutError, RemoteError, WireFormatError
from .wire import Codec, ErrorReply, M, Message, Ping, Pong

logger = logging.getLogger(__name__)

Handler = Callable[[Any], Message]


class _FromEnv:
    """Marker: take the authenticator from the environment (:func:`.auth.from_env`)."""

    def __repr__(self) -> str:
        return "FROM_ENV"


#: Default of the ``auth`` argument: the process's deployment key, if any.
FROM_ENV: Any = _FromEnv()


def _resolve(auth: _auth.Authenticator | None) -> _auth.Authenticator | None:
    return _auth.from_env() if isinstance(auth, _FromEnv) else auth


def tcp_endpoint(host: str, port: int) -> str:
    """``tcp://host:port`` with IPv6 hosts bracketed."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


#: A gap this long between two turns of a server's loop (which turns at least every poll
#: interval) means its thread was held up: its process starved of CPU or another thread
#: holding the GIL. Messages sent meanwhile wait in the socket.
STALL_S = 1.0
#: How long a server must have run without a stall before the absence of a message means
#: it was not sent (those sent during a stall are answered by then): see
#: :meth:`RpcServer.caught_up`.
SETTLE_S = 0.5


def _ipc_path(endpoint: str) -> str | None:
    """The socket file of an ``ipc://`` endpoint (None: another transport, a wildcard or
    Linux's abstract namespace, which has no file)."""
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://"):]
    return None if not path or path == "*" or path.startswith("@") else path


def claim_ipc_path(path: str) -> None:
    """Make ``path`` free for a server's ``ipc://`` socket: a file no process listens on
    any more (left by a dead engine) is removed; libzmq would silently take over the socket
    of a live one, so that raises.

    Raises:
        EndpointInUseError: a live server listens on ``path``.
    """
    if not os.path.lexists(path):
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except OSError:  # refused (nobody listens) or not a socket: stale
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    finally:
        probe.close()
    raise EndpointInUseError(
        f"a live server already listens on ipc://{path}: another engine with the same "
        "engine_id (and DP rank) runs on this host; give each instance its own engine_id")


class RpcServer(Generic[M]):
    """A ROUTER socket answering requests on a daemon thread.

    Args:
        endpoint: ``tcp://host:port`` (port 0 picks a free port) or ``ipc://path``.
            Bind to a configured interface, never to ``*`` by default.
        codec: the protocol spoken on this socket.
        handler: called with each decoded request, returns the reply. Exceptions
            become an ``ErrorReply(code="internal")``.
        name: thread name, for logs and the ``socket`` label of ``auth_refused``.
        auth: the deployment key check (default: from the environment; ``None``: none).
            Without one, a ``tcp://`` server serves only peers on this host unless
            ``VLLM_ASCEND_KV_ALLOW_UNAUTHENTICATED=1`` (:mod:`.protected`, read here).
        audience: with a key, the receiver requests must be sealed for (default: this
            server's port and ``engine_id``, :func:`.auth.audience_of`); another one is
            refused as ``misdirected``.
        engine_id: this instance's engine id, bound into ``audience`` (clients name it).
    """

    def __init__(self, endpoint: str, codec: Codec[M], handler: Handler, *, name: str = "rpc",
                 context: zmq.Context[Any] | None = None, poll_interval_ms: int = 100,
                 auth: _auth.Authenticator | None = FROM_ENV,
                 audience: str | None = None, engine_id: str = "") -> None:
        self.auth = _resolve(auth)
        self.codec = codec
        self.handler = handler
        self.name = name
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Frames above the limit are dropped by libzmq before they reach Python.
        self._sock.setsockopt(zmq.MAXMSGSIZE, codec.max_size + 1024)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        #: the ``ipc://`` socket file this server bound (path, device, inode): removed on stop
        self._ipc_file: tuple[str, int, int] | None = None
        try:
            self.endpoint = self._bind(endpoint)
        except BaseException:
            self._sock.close(0)
            raise
        #: what requests must be sealed for (a frame captured for another rank is refused)
        self.audience = (_auth.audience_of(self.endpoint, engine_id) if audience is None
                         else audience)
        #: what a ``Ping`` may also be sealed for: this server's socket alone
        self.port_audience = _auth.audience_of(self.endpoint)
        #: protected mode: without a key, only peers on this host are served
        self.gate = protected.PeerGate(name, keyed=self.auth is not None,
                                       endpoint=self.endpoint)
        self._poll_ms = poll_interval_ms
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.stats = {"requests": 0, "bad_messages": 0, "handler_errors": 0, "auth_refused": 0}
        #: the last turn of the serving loop, and the start of its current run of turns
        #: without a stall (monotonic)
        self._beat = self._steady_since = time.monotonic()

    def _bind(self, endpoint: str) -> str:
        if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
            base = endpoint[: -len(":0")]
            port = self._sock.bind_to_random_port(base)
            return f"{base}:{port}"
        path = _ipc_path(endpoint)
        if path is not None:
            claim_ipc_path(path)
        self._sock.bind(endpoint)
        bound = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        path = _ipc_path(bound)
        if path is not None:
            st = os.stat(path)
            self._ipc_file = (path, st.st_dev, st.st_ino)
        return bound

    @property
    def port(self) -> int:
        """TCP port the socket is bound to."""
        return int(self.endpoint.rsplit(":", 1)[1])

    def start(self) -> RpcServer[M]:
        """Start serving on a daemon thread; returns ``self``."""
        self._thread = threading.Thread(target=self._serve, name=self.name, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread and close the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self._sock.close(0)
        if self._ipc_file is not None:
            path, dev, ino = self._ipc_file
            self._ipc_file = None
            # only our own file: another server may have bound the path since
            with contextlib.suppress(OSError):
                st = os.stat(path)
                if (st.st_dev, st.st_ino) == (dev, ino):
                    os.unlink(path)

    def steady_for(self, now: float | None = None) -> float:
        """Seconds this server has been turning its loop without a stall (0.0 while it is
        held up now); ``inf`` when its thread does not run (nothing to wait for).

        A caller that acts on the *absence* of messages (P expiring a lease nobody renewed)
        waits until this is long enough for messages sent during a stall to be answered.
        """
        if self._thread is None or not self._thread.is_alive():
            return math.inf
        now = time.monotonic() if now is None else now
        if now - self._beat > STALL_S:
            return 0.0
        return max(0.0, now - self._steady_since)

    def caught_up(self) -> bool:
        """Whether this server has run steadily for :data:`SETTLE_S`: what waited in its
        socket during a stall has been answered, so a lease nobody renewed may lapse."""
        return self.steady_for() >= SETTLE_S

    def lapse_clock(self, grace_s: float, now: float | None = None) -> float:
        """The ``time.monotonic()`` against which deadlines kept alive by messages to this
        server (leases) lapse: now, once it :meth:`caught_up`; while it is held up, ``now -
        grace_s``, so a deadline overdue by a whole ``grace_s`` lapses regardless (a server
        that never settles lets leases lapse late, never not at all)."""
        now = time.monotonic() if now is None else now
        return now if self.caught_up() else now - grace_s

    def _turn(self) -> None:
        now = time.monotonic()
        if now - self._beat > STALL_S:
            self._steady_since = now
        self._beat = now

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        self._beat = self._steady_since = time.monotonic()
        while not self._stop.is_set():
            self._turn()
            try:
                if not poller.poll(self._poll_ms):
                    continue
                frames = self._sock.recv_multipart(copy=False)
            except zmq.ZMQError as exc:
                if self._stop.is_set():
                    break
                logger.warning("%s: receive failed: %s", self.name, exc)
                continue
            if len(frames) < 2:
                continue
            envelope = [f.bytes for f in frames[:-1]]
            reply, reply_to = self._answer(frames[-1].buffer, self._peer(frames[-1]))
            try:
                data = self.codec.encode(reply)
                if self.auth is not None and reply_to is not None:
                    data, _nonce = self.auth.seal(data, reply_to=reply_to)
                self._sock.send_multipart([*envelope, data])
            except (zmq.ZMQError, WireFormatError) as exc:
                logger.warning("%s: reply failed: %s", self.name, exc)

    def _peer(self, frame: zmq.Frame) -> str | None:
        """The address ``frame`` came from (only read in protected mode; None: unknown)."""
        if not self.gate.active:
            return None
        try:
            return str(frame.get("Peer-Address")) or None
        except (zmq.ZMQError, UnicodeDecodeError):
            return None

    def _answer(self, payload: memoryview, peer: str | None = None
                ) -> tuple[Message, bytes | None]:
        """The reply to one frame from ``peer``, and the request nonce to sign it for
        (``None``: the request was refused by the key check or protected mode, the refusal
        goes out unsigned)."""
        self.stats["requests"] += 1
        refused = self.gate.refusal(peer)
        if refused is not None:
            self.stats["auth_refused"] += 1
            return ErrorReply(code=protected.REFUSAL, message=refused), None
        nonce: bytes | None = None
        if self.auth is not None:
            try:
                payload, nonce = self._open(payload)
            except _auth.AuthError as exc:
                self.stats["auth_refused"] += 1
                _auth.count_refusal(self.name, exc.reason)
                logger.warning("%s: refused a request (%s): %s", self.name, exc.reason, exc)
                return ErrorReply(code="auth_refused", message=f"refused ({exc.reason}): the "
                                  "deployment key check failed"), None
        return self._dispatch(payload), nonce

    def _open(self, payload: memoryview) -> tuple[memoryview, bytes]:
        """A keyed request's payload and nonce. A ``Ping`` may be sealed for this server's
        port alone where the server binds its engine id too: who checks that a server
        answers (``doctor --peer host:port``) does not know its engine id, and a ``Pong``
        tells nothing more than that it answers. Any other request sealed that way is
        refused as misdirected."""
        assert self.auth is not None
        try:
            return self.auth.open(payload, audience=self.audience)
        except _auth.AuthError as exc:
            if exc.reason != "misdirected" or self.audience == self.port_audience:
                raise
            opened, nonce = self.auth.open(payload, audience=self.port_audience)
            try:
                request = self.codec.decode(opened)
            except WireFormatError:
                raise exc from None
            if not isinstance(request, Ping):
                raise exc from None
            return opened, nonce

    def _dispatch(self, payload: memoryview) -> Message:
        try:
            request = self.codec.decode(payload)
        except WireFormatError as exc:
            self.stats["bad_messages"] += 1
            logger.warning("%s: rejected a malformed request: %s", self.name, exc)
            return ErrorReply(code="bad_message", message=str(exc))
        if isinstance(request, Ping):
            return Pong(name=self.name)
        try:
            return self.handler(request)
        except Exception as exc:  # the server outlives any one bad request
            self.stats["handler_errors"] += 1
            logger.exception("%s: handler failed on %s", self.name, type(request).__name__)
            return ErrorReply(code="internal", message=f"{type(exc).__name__}: {exc}")


class RpcClient(Generic[M]):
    """Send requests to one :class:`RpcServer` and wait for the replies.

    Thread-safe (one request at a time). A request that times out does not
    wedge the socket: it uses ``REQ_RELAXED`` and ``REQ_CORRELATE``, so the
    next request goes out and a late reply to the old one is discarded.

    With a key, each request is sealed for its receiver (``audience``, default the
    endpoint's port and the receiving instance's ``engine_id`` where given:
    :func:`.auth.audience_of`), so no other server accepts it.
    """

    def __init__(self, endpoint: str, codec: Codec[M], *, timeout_s: float = 10.0,
                 context: zmq.Context[Any] | None = None,
                 auth: _auth.Authenticator | None = FROM_ENV,
                 audience: str | None = None, engine_id: str = "") -> None:
        self.auth = _resolve(auth)
        self.audience = (_auth.audience_of(endpoint, engine_id) if audience is None
                         else audience)
        self.endpoint = endpoint
        self.codec = codec
        self.timeout_s = timeout_s
        self._ctx = context or zmq.Context.instance()
        self._lock = threading.Lock()
        self._sock = self._make_socket()

    def _make_socket(self) -> zmq.Socket[Any]:
        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.REQ_RELAXED, 1)
        sock.setsockopt(zmq.REQ_CORRELATE, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, self.codec.max_size + 1024)
        sock.connect(self.endpoint)
        return sock

    def call(self, request: Message, *, timeout_s: float | None = None) -> M:
        """Send ``request`` and return the decoded reply.

        Raises:
            PeerTimeoutError: no reply within the timeout.
            RemoteError: the peer answered with an :class:`ErrorReply`.
            WireFormatError: the reply was not a valid message.
            AuthError: with a key configured, the reply was not signed for this request.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        payload = self.codec.encode(request)
        nonce: bytes | None = None
        if self.auth is not None:
            payload, nonce = self.auth.seal(payload, audience=self.audience)
        with self._lock:
            try:
                self._sock.send(payload, copy=False)
                if not self._sock.poll(int(timeout * 1000), zmq.POLLIN):
                    raise PeerTimeoutError(
                        f"{self.endpoint} did not answer {type(request).__name__} "
                        f"within {timeout:.1f}s")
                data = self._sock.recv(copy=False)
            except zmq.ZMQError as exc:
                # A socket in a bad state is replaced rather than reused.
                self._sock.close(0)
                self._sock = self._make_socket()
                raise PeerTimeoutError(f"{self.endpoint}: {exc}") from exc
        reply: M = self._open(data.buffer, nonce)
        if isinstance(reply, ErrorReply):
            raise RemoteError(f"{self.endpoint} rejected {type(request).__name__}: "
                              f"{reply.message}", code=reply.code)
        return reply

    def _open(self, frame: memoryview, nonce: bytes | None) -> M:
        if self.auth is None or nonce is None:
            return self.codec.decode(frame)
        try:
            payload, _reply_nonce = self.auth.open(frame, reply_to=nonce)
        except _auth.AuthError as exc:
            _auth.count_refusal(f"client:{self.endpoint}", exc.reason)
            if exc.reason == "unauthenticated":
                # An unsigned refusal can only fail this call (as a dropped reply would):
                # pass on its code, so a peer without our key says why.
                try:
                    plain = self.codec.decode(frame)
                except WireFormatError:
                    plain = None
                if isinstance(plain, ErrorReply):
                    raise RemoteError(f"{self.endpoint} refused the request (unsigned reply): "
                                      f"{plain.message}", code=plain.code) from exc
            raise _auth.AuthError(f"{self.endpoint}: {exc}", reason=exc.reason) from exc
        return self.codec.decode(payload)

    def close(self) -> None:
        """Close the socket."""
        with self._lock:
            self._sock.close(0)
