# SPDX-License-Identifier: Apache-2.0
"""This process's TCP sockets from /proc, and shutting one down (core.own_sockets)."""

from __future__ import annotations

import socket
import time

import pytest

from vllm_ascend.distributed.kv_transfer.core import own_sockets

pytestmark = pytest.mark.skipif(not own_sockets.available(),
                                reason="no /proc/net/tcp: Linux lists TCP sockets there")


def dual_stack_listener() -> socket.socket:
    """A listener on every interface, IPv4 and IPv6 (as Mooncake's TCP transport binds)."""
    srv = socket.socket(socket.AF_INET6)
    srv.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    srv.bind(("::", 0))
    srv.listen()
    return srv


def test_a_listener_and_its_connections_are_found_with_their_unread_bytes() -> None:
    srv = dual_stack_listener()
    port = srv.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port))
    try:
        assert port in own_sockets.listening_ports()
        # accepted by the kernel, not by the application yet: no process holds it
        waiting = own_sockets.connections({port})
        assert [(s.remote_ip, s.remote_port, s.inode) for s in waiting] == [
            ("127.0.0.1", cli.getsockname()[1], 0)]
        conn, _ = srv.accept()
        cli.sendall(b"x" * 10)
        time.sleep(0.1)
        (mine,) = own_sockets.connections({port})
        assert mine.state == own_sockets.ESTABLISHED and mine.rx_queue == 10
        assert mine.inode in own_sockets.own_inodes()
        conn.close()
    finally:
        cli.close()
        srv.close()


def test_a_shut_down_connection_delivers_what_was_queued_and_resets_what_comes_later() -> None:
    srv = dual_stack_listener()
    port = srv.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    try:
        cli.sendall(b"early")
        time.sleep(0.1)
        (sock,) = own_sockets.connections({port})
        assert own_sockets.shut_down(sock.inode, own_sockets.own_inodes()[sock.inode])
        assert conn.fileno() >= 0  # only the duplicate was closed
        assert conn.recv(100) == b"early"
        cli.sendall(b"late")  # the kernel answers it with a reset: it never reaches conn
        time.sleep(0.2)
        try:
            data = conn.recv(100)
        except ConnectionResetError:
            data = b""
        assert data == b""
        assert own_sockets.connections({port}) == []
    finally:
        conn.close()
        cli.close()
        srv.close()


def test_a_reused_descriptor_number_is_not_touched() -> None:
    a, b = socket.socketpair()
    try:
        assert not own_sockets.shut_down(inode=1, fd=a.fileno())  # not that socket
        a.sendall(b"ok")
        assert b.recv(2) == b"ok"
        assert not own_sockets.shut_down(inode=1, fd=-1)  # closed
    finally:
        a.close()
        b.close()
