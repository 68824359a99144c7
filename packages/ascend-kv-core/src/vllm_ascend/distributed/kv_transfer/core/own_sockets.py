# SPDX-License-Identifier: Apache-2.0
"""This process's TCP sockets as the kernel lists them, and shutting one down.

The transfer engine's TCP transport is a library in this process: its listening and
accepted sockets are file descriptors of this process that Python never opened. This
module finds them through Linux's ``/proc`` (``/proc/net/tcp``, ``/proc/net/tcp6`` and
``/proc/self/fd``), which needs no privilege for a process's own sockets:

* :func:`listening_ports`: the TCP ports this process listens on (the transfer engine
  records those it opened, :attr:`~.transfer_engine.MooncakeTransferEngine.listen_ports`);
* :func:`connections`: the TCP connections on some local ports (this process's and those
  still waiting in its listening sockets' accept queues), with the bytes the application
  has not read yet;
* :func:`orphaned_unsent`: what the kernel still holds for some hosts on connections their
  process closed (a sender that closed a stalled connection has not withdrawn its bytes);
* :func:`shut_down`: ``shutdown(SHUT_RDWR)`` of one of this process's connections, found by
  its socket inode (checked on a duplicate of the descriptor, so a descriptor number reused
  meanwhile is never touched). From then on Linux resets the connection when data arrives
  for it (RFC 1122: a reset on data after the receive side was shut), so nothing sent on it
  later reaches the application; what was already queued can still be read.

Elsewhere than Linux (no ``/proc/net/tcp``), :func:`available` is False and the lists are
empty.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass

_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
#: ``st`` column of ``/proc/net/tcp``
ESTABLISHED, LISTEN = 0x01, 0x0A


@dataclass(frozen=True)
class TcpSocket:
    """One line of ``/proc/net/tcp{,6}``."""

    local_port: int
    #: the peer's address (an IPv4-mapped IPv6 address given as IPv4)
    remote_ip: str
    remote_port: int
    state: int
    #: bytes received and not read by the application yet
    rx_queue: int
    #: bytes sent and not acknowledged by the peer yet
    tx_queue: int
    #: 0: no process holds it (waiting in an accept queue, or closed by its process)
    inode: int

    @property
    def key(self) -> tuple[int, str, int]:
        """What names the connection among this host's sockets on ``local_port``."""
        return self.local_port, self.remote_ip, self.remote_port


def available() -> bool:
    """Whether this system lists its TCP sockets in ``/proc`` (Linux)."""
    return os.path.exists(_TABLES[0])


def _ip(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    # /proc writes an IPv6 address as four host-order 32-bit words
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    addr = ipaddress.IPv6Address(words)
    return str(addr.ipv4_mapped or addr)


def sockets() -> list[TcpSocket]:
    """Every TCP socket of this network namespace (empty where ``/proc`` has none)."""
    out: list[TcpSocket] = []
    for table in _TABLES:
        try:
            with open(table, encoding="ascii") as fh:
                lines = fh.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) < 10:
                continue
            local, remote = f[1].rsplit(":", 1), f[2].rsplit(":", 1)
            tx, rx = (int(q, 16) for q in f[4].split(":"))
            out.append(TcpSocket(int(local[1], 16), _ip(remote[0]), int(remote[1], 16),
                                 int(f[3], 16), rx, tx, int(f[9])))
    return out


def own_inodes() -> dict[int, int]:
    """Socket inode -> file descriptor, of this process's open sockets."""
    out: dict[int, int] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out[int(target[8:-1])] = int(fd)
    return out


def listening_ports() -> set[int]:
    """The TCP ports this process listens on."""
    mine = own_inodes()
    return {s.local_port for s in sockets() if s.state == LISTEN and s.inode in mine}


def connections(ports: set[int]) -> list[TcpSocket]:
    """The TCP connections on ``ports`` (not the listening sockets), whoever holds them."""
    return [s for s in sockets() if s.local_port in ports and s.state != LISTEN]


def orphaned_unsent(hosts: set[str]) -> int:
    """Bytes this network namespace's kernel still tries to deliver to ``hosts`` on
    connections no process holds any more (closed with data queued: the kernel sends it
    when the peer is reachable again, until its retries run out)."""
    return sum(s.tx_queue for s in sockets()
               if s.inode == 0 and s.state not in (ESTABLISHED, LISTEN)
               and s.remote_ip in hosts)


def shut_down(inode: int, fd: int) -> bool:
    """``shutdown(SHUT_RDWR)`` of this process's socket ``inode`` (open as ``fd``); False
    when ``fd`` is no longer that socket."""
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        if os.fstat(dup).st_ino != inode:
            return False  # closed meanwhile, and the number reused
        sock = socket.socket(fileno=dup)
        dup = -1  # the socket object owns the duplicate now
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # not connected any more: nothing can arrive on it either
        finally:
            sock.close()  # closes the duplicate only
        return True
    finally:
        if dup >= 0:
            os.close(dup)
