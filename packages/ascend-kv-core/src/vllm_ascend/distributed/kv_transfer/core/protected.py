# SPDX-License-Identifier: Apache-2.0
"""Protected mode: without a deployment key, serve only peers on this host.

A process runs its control plane in one of three modes (:func:`.auth.mode`):

* ``keyed``: a deployment key is set (:mod:`.auth`); every frame is authenticated and
  any host that holds the key is served;
* ``protected`` (the default without a key): every server (the side channels, the pool's
  lookup socket, the offload metadata server, the proxy's metaserver and operator
  endpoints) serves only peers on this host. A peer is on this host when the address it
  connects from is a loopback address or an address of one of this host's interfaces (a
  peer connecting to this host's own address comes from that address). An ``ipc://`` or
  ``inproc://`` endpoint is local by definition. Anyone else is refused before any
  handler runs: a :class:`~.wire.ErrorReply` with code ``protected_mode`` (HTTP: 403)
  whose message names the two ways out, counted in ``auth_refused`` under reason
  ``protected_mode``;
* ``open``: no key and ``VLLM_ASCEND_KV_ALLOW_UNAUTHENTICATED=1``: any host is served,
  unauthenticated (the behaviour before protected mode), with a WARNING once per process.

Like Redis's protected mode: same-host tests and demos work without any setting, and a
deployment across hosts needs the key (or the opt-out, in so many words).

:class:`PeerGate` is the check one server makes; ZeroMQ tells a ROUTER socket the
address a TCP message came from (the frame property ``Peer-Address``), HTTP servers have
it from the connection (FastAPI's ``request.client.host``).
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Mapping

from . import auth

logger = logging.getLogger(__name__)

#: The code of the refusal (wire ``ErrorReply.code``, the proxy's error type) and its
#: ``reason`` label in ``auth_refused``.
REFUSAL = auth.REASON_PROTECTED_MODE
#: How often the interface addresses are read again when a peer is not among them (an
#: address added after start); more refusals meanwhile use what was read last.
REFRESH_S = 5.0
#: Peers whose first refusal was logged at WARNING (later ones at DEBUG), at most.
_MAX_LOGGED = 256
#: Peer addresses a gate remembers as local (at most), and for how long (seconds): the
#: check runs on every message, a remembered address skips it.
_MAX_REMEMBERED = 1024
REMEMBER_S = 60.0


class _SockAddr(ctypes.Structure):
    _fields_ = [("sa_family", ctypes.c_ushort), ("sa_data", ctypes.c_ubyte * 14)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [("ifa_next", ctypes.POINTER(_IfAddrs)), ("ifa_name", ctypes.c_char_p),
                     ("ifa_flags", ctypes.c_uint), ("ifa_addr", ctypes.POINTER(_SockAddr)),
                     ("ifa_netmask", ctypes.POINTER(_SockAddr)),
                     ("ifa_ifu", ctypes.POINTER(_SockAddr)), ("ifa_data", ctypes.c_void_p)]


def _interface_addresses() -> set[str]:
    """Every address of this host's interfaces (in this network namespace), IPv4 and IPv6,
    from libc's ``getifaddrs`` (secondary addresses included); empty where it fails."""
    libc = ctypes.CDLL(None, use_errno=True)
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        logger.warning("getifaddrs failed (errno %d): protected mode treats only loopback "
                       "peers as local", ctypes.get_errno())
        return set()
    out: set[str] = set()
    try:
        node = head
        while node:
            entry = node.contents
            if entry.ifa_addr:
                family = entry.ifa_addr.contents.sa_family
                if family == socket.AF_INET:  # sockaddr_in: family, port, address
                    raw = ctypes.string_at(entry.ifa_addr, 8)
                    out.add(socket.inet_ntop(socket.AF_INET, raw[4:8]))
                elif family == socket.AF_INET6:  # sockaddr_in6: family, port, flow, address
                    raw = ctypes.string_at(entry.ifa_addr, 24)
                    out.add(socket.inet_ntop(socket.AF_INET6, raw[8:24]))
            node = entry.ifa_next
    finally:
        libc.freeifaddrs(head)
    return out


class _LocalAddresses:
    """This host's interface addresses, read once and again (at most every
    :data:`REFRESH_S`) when a peer is not among them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._addrs: frozenset[str] | None = None
        self._read_at = 0.0

    def get(self, *, refresh: bool = False) -> frozenset[str]:
        with self._lock:
            now = time.monotonic()
            if self._addrs is None or (refresh and now - self._read_at >= REFRESH_S):
                self._addrs = frozenset(_interface_addresses())
                self._read_at = now
            return self._addrs


_LOCAL = _LocalAddresses()


def local_addresses(*, refresh: bool = False) -> frozenset[str]:
    """The addresses of this host's interfaces (loopback included), as read last;
    ``refresh``: read them again unless that was done within :data:`REFRESH_S`."""
    return _LOCAL.get(refresh=refresh)


def _parse(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = address.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    text = text.split("%", 1)[0]  # an IPv6 zone (fe80::1%eth0)
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped  # a dual-stack socket's view of an IPv4 peer
    return ip


def is_local(address: str | None) -> bool:
    """Whether a peer connecting from ``address`` is on this host: a loopback address or
    one of this host's interface addresses. Anything else, a name included, is not (the
    peer address of a connection is always numeric; an unknown one is refused)."""
    if not address:
        return False
    ip = _parse(address)
    if ip is None:
        return False
    if ip.is_loopback:
        return True
    text = str(ip)
    return text in local_addresses() or text in local_addresses(refresh=True)


def local_transport(endpoint: str) -> bool:
    """Whether every peer of a server bound to ``endpoint`` is on this host by the
    transport itself (``ipc://``: a socket file; ``inproc://``: this process)."""
    return endpoint.startswith(("ipc://", "inproc://"))


def refusal_message(peer: str | None, what: str = "this server") -> str:
    """The refusal a non-local peer gets: what happened and the two ways out."""
    return (f"refused {peer or 'a peer of unknown address'}: {what} runs in protected mode "
            f"(no deployment key configured) and serves only peers on its own host. Set "
            f"{auth.ENV_KEY_FILE} (or {auth.ENV_KEY}) to the same deployment key on every "
            f"instance and the proxy, or set {auth.ENV_ALLOW_UNAUTHENTICATED}=1 to serve "
            f"any host unauthenticated (see docs/security.md)")


class PeerGate:
    """The protected-mode check of one server.

    Args:
        socket: the server's name (the ``socket`` label of ``auth_refused``, and logs).
        keyed: whether the server authenticates its peers with a deployment key (then
            every host is served: the key decides).
        endpoint: the server's bound endpoint (``ipc://`` and ``inproc://`` are local by
            definition); ``""`` for an HTTP server.
        env: the environment to read the opt-out from (default ``os.environ``).
    """

    def __init__(self, socket: str, *, keyed: bool, endpoint: str = "",
                 env: Mapping[str, str] | None = None) -> None:
        self.socket = socket
        #: whether peers are checked at all (no key, no opt-out, a network transport)
        self.active = (not keyed and not local_transport(endpoint)
                       and not auth.allow_unauthenticated(env))
        self._logged: set[str] = set()
        #: peers found local lately (forgotten every REMEMBER_S: an address may leave)
        self._local: set[str] = set()
        self._local_since = time.monotonic()

    def _is_local(self, peer: str | None) -> bool:
        if peer in self._local:
            if time.monotonic() - self._local_since < REMEMBER_S:
                return True
            self._local, self._local_since = set(), time.monotonic()
        if not is_local(peer):
            return False
        if peer and len(self._local) < _MAX_REMEMBERED:
            self._local.add(peer)
        return True

    def refusal(self, peer: str | None) -> str | None:
        """None when a peer connecting from ``peer`` is served; else the refusal text (the
        refusal is counted and logged: the first of each peer at WARNING)."""
        if not self.active or self._is_local(peer):
            return None
        auth.count_refusal(self.socket, REFUSAL)
        key = peer or "?"
        if key not in self._logged and len(self._logged) < _MAX_LOGGED:
            self._logged.add(key)
            logger.warning("%s: refused %s (protected mode: no deployment key, this server "
                           "serves only peers on this host; set %s or %s=1)", self.socket,
                           key, auth.ENV_KEY_FILE, auth.ENV_ALLOW_UNAUTHENTICATED)
        else:
            logger.debug("%s: refused %s (protected mode)", self.socket, key)
        return refusal_message(peer)
