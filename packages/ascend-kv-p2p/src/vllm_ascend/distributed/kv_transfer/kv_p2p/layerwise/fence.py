# SPDX-License-Identifier: Apache-2.0
"""D side of ``MooncakeLayerwiseConnector``: no late write of a failed push in reused blocks.

A push can fail with one of P's writes still on the way. Mooncake's TCP transport fails a
write that made no progress for ``MC_TCP_PROGRESS_TIMEOUT_SEC`` by closing P's
connection, but the kernel still holds what was queued on it and delivers it once the
network is back (P's socket waits in FIN-WAIT-1 with the bytes; ``tcp_retries2`` /
``tcp_orphan_retries`` bound that to minutes, on P's host, out of D's sight). D's end of
that connection is still open, so the bytes land in D's KV cache: in blocks that vLLM may
have handed to another request by then.

So D hands a failed push's blocks back (reports the request to vLLM) only when no write of
it can still land:

* **P acknowledged it**: P sends ``PushDone(success=False, settled=True)`` only from its
  sender thread, after the request's writes returned, and ``settled`` only when none of
  them failed in the transfer engine (each completed, or never started). A request none of
  whose P ranks got a write lease had no write at all.
* **Otherwise D fences** (a sender that failed a write, an older P that does not say, or a
  P that stopped renewing its lease: dead, or cut off): :class:`WriteFence` shuts down
  (``shutdown(SHUT_RDWR)``, :mod:`~vllm_ascend.distributed.kv_transfer.core.own_sockets`)
  every connection into this process's transfer engine ports from that P's host (every
  peer's when P did not name its host) that is open when the fence starts, and waits until
  their unread bytes were read. From then on the kernel answers data on them with a reset
  (RFC 1122), so the late write dies at D's socket; a connection still in an accept queue
  is shut once the engine took it. New connections are not touched: a write P starts later
  is not one of this push's (P starts none without a lease; D grants none to a failing
  request).

A fence costs the other pushes that were in flight on those connections (their writes fail
at P, P reports them, D recomputes them), so D fences only when P could not acknowledge.
It ends within ``limit_s`` whatever happens (it waits on this process's own reads only);
a fence that hit its limit is counted and logged, and the blocks go back then. Only the
TCP transport needs it: RDMA flushes a failed queue pair's writes instead of replaying them.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time

from vllm_ascend.distributed.kv_transfer.core import own_sockets

logger = logging.getLogger(__name__)

#: How often a fence looks at the kernel's socket table while it waits (seconds).
POLL_S = 0.02


def resolve_hosts(hosts: set[str]) -> set[str]:
    """The IP addresses of ``hosts`` (as the kernel writes a peer's address: IPv4-mapped
    IPv6 as IPv4); a name that does not resolve is left out."""
    out: set[str] = set()
    for host in hosts:
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            try:
                infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
            except OSError:
                logger.warning("cannot resolve P's transfer-engine host %r to fence it", host)
                continue
            out |= {str(info[4][0]) for info in infos}
            continue
        mapped = getattr(addr, "ipv4_mapped", None)
        out.add(str(mapped or addr))
    return out


class WriteFence:
    """Shut down the transfer-engine connections from some hosts and wait until drained.

    Args:
        ports: the local ports peers' transfers arrive on (the engine's ``listen_ports``).
        hosts: the peers' addresses (``None``: every peer).
        limit_s: the longest the fence waits for the connections to drain.

    Attributes:
        closed: connections this fence shut down.
        timed_out: the fence ended at ``limit_s`` with a connection not drained.
    """

    def __init__(self, ports: set[int], hosts: set[str] | None, *, limit_s: float) -> None:
        self.ports = set(ports)
        self.hosts = hosts
        self.until = time.monotonic() + limit_s
        self.closed = 0
        self.timed_out = False
        self._done = False
        self._next_poll = 0.0
        #: the connections open when the fence started, and whether this fence shut them
        self._tracked: dict[tuple[int, str, int], bool] = {}
        for s in own_sockets.connections(self.ports):
            if hosts is None or s.remote_ip in hosts:
                self._tracked[s.key] = False

    def poll(self, now: float | None = None) -> bool:
        """Shut down what can be shut; True once no tracked connection can pass a byte to
        the transfer engine any more (or the limit passed)."""
        if self._done:
            return True
        now = time.monotonic() if now is None else now
        if now < self._next_poll:
            return False
        self._next_poll = now + POLL_S
        current = {s.key: s for s in own_sockets.connections(self.ports)
                   if s.key in self._tracked}
        mine = own_sockets.own_inodes() if current else {}
        waiting = 0
        for key, sock in current.items():
            if sock.inode == 0:
                # in an accept queue (the engine will take it) or closed by the engine
                waiting += sock.state == own_sockets.ESTABLISHED
                continue
            fd = mine.get(sock.inode)
            if fd is None:
                continue  # another process's: not one of the engine's
            if not self._tracked[key]:
                if own_sockets.shut_down(sock.inode, fd):
                    self._tracked[key] = True
                    self.closed += 1
                waiting += 1  # look again: what was queued before the shutdown is read
                continue
            waiting += sock.rx_queue > 0
        if not waiting:
            self._done = True
        elif now >= self.until:
            self._done = self.timed_out = True
        return self._done
