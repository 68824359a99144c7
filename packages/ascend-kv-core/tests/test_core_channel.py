# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import pytest
import zmq

from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient, RpcServer, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.errors import (
    EndpointInUseError,
    PeerTimeoutError,
    RemoteError,
)
from vllm_ascend.distributed.kv_transfer.core.wire import (
    Ack,
    Codec,
    ErrorReply,
    Message,
    Ping,
    Pong,
)


class Echo(Message):
    text: str


class Fail(Message):
    pass


class Slow(Message):
    seconds: float


CODEC: Codec[Message] = Codec([Echo, Fail, Slow], max_size=1 << 20)


def handler(msg: Message) -> Message:
    if isinstance(msg, Echo):
        return Echo(text=msg.text.upper())
    if isinstance(msg, Slow):
        time.sleep(msg.seconds)
        return Ack()
    raise RuntimeError("handler exploded")


@pytest.fixture
def server() -> RpcServer[Message]:
    srv = RpcServer(tcp_endpoint("127.0.0.1", 0), CODEC, handler, name="test-rpc").start()
    yield srv
    srv.stop()


def test_request_reply_and_ping(server: RpcServer[Message]) -> None:
    client = RpcClient(server.endpoint, CODEC, timeout_s=5)
    assert client.call(Echo(text="abc")) == Echo(text="ABC")
    assert isinstance(client.call(Ping()), Pong)
    client.close()


def test_handler_exception_is_an_error_reply_and_server_lives(server: RpcServer[Message]) -> None:
    client = RpcClient(server.endpoint, CODEC, timeout_s=5)
    with pytest.raises(RemoteError, match="handler exploded") as info:
        client.call(Fail())
    assert info.value.code == "internal"
    assert client.call(Echo(text="ok")) == Echo(text="OK")


def test_garbage_from_a_zmq_peer_gets_an_error_reply(server: RpcServer[Message]) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    for junk in (b"", b"\x00" * 10, b"VAKV\x01\xff\xff", b"GET / HTTP/1.1\r\n\r\n"):
        sock.send_multipart([b"", junk])
        assert sock.poll(5000)
        frames = sock.recv_multipart()
        reply = CODEC.decode(frames[-1])
        assert isinstance(reply, ErrorReply) and reply.code == "bad_message"
    sock.close()
    assert server.stats["bad_messages"] == 4
    assert RpcClient(server.endpoint, CODEC).call(Echo(text="still")) == Echo(text="STILL")


def test_raw_tcp_garbage_does_not_kill_the_server(server: RpcServer[Message]) -> None:
    for junk in (b"\xff" * 64, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", bytes(range(256)) * 40):
        with socket.create_connection(("127.0.0.1", server.port), timeout=2) as s:
            s.sendall(junk)
            time.sleep(0.05)
    assert RpcClient(server.endpoint, CODEC).call(Echo(text="alive")) == Echo(text="ALIVE")


def test_oversize_message_is_dropped_not_buffered(server: RpcServer[Message]) -> None:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.endpoint)
    sock.send_multipart([b"", b"VAKV\x01" + b"x" * (4 << 20)])
    assert not sock.poll(500)  # libzmq disconnects the peer; nothing reaches the handler
    sock.close()
    assert RpcClient(server.endpoint, CODEC).call(Echo(text="a")) == Echo(text="A")


def test_timeout_then_next_call_works(server: RpcServer[Message]) -> None:
    client = RpcClient(server.endpoint, CODEC, timeout_s=0.2)
    with pytest.raises(PeerTimeoutError, match="did not answer Slow"):
        client.call(Slow(seconds=0.6))
    time.sleep(0.6)
    assert client.call(Echo(text="b"), timeout_s=5) == Echo(text="B")


def test_dead_peer_times_out_fast() -> None:
    client = RpcClient(tcp_endpoint("127.0.0.1", 1), CODEC, timeout_s=0.3)
    start = time.monotonic()
    with pytest.raises(PeerTimeoutError):
        client.call(Echo(text="x"))
    assert time.monotonic() - start < 2


def test_binds_the_given_interface_only(server: RpcServer[Message]) -> None:
    assert server.endpoint.startswith("tcp://127.0.0.1:")
    # nothing listens on the wildcard address for that port from another interface's view
    host_ips = {ai[4][0] for ai in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    for ip in host_ips - {"127.0.0.1"}:
        with pytest.raises(OSError):
            socket.create_connection((ip, server.port), timeout=0.5).close()


def test_steady_for_tells_a_held_up_server(server: RpcServer[Message],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A server whose thread was held up (here a slow handler; in production its process
    starved of CPU) says so, and counts its steady time again from when it runs again."""
    from vllm_ascend.distributed.kv_transfer.core import channel

    monkeypatch.setattr(channel, "STALL_S", 0.3)
    time.sleep(0.6)
    assert server.steady_for() >= 0.5 and server.caught_up()
    client = RpcClient(server.endpoint, CODEC, timeout_s=5)
    t = threading.Thread(target=lambda: client.call(Slow(seconds=1.0)))
    t.start()
    time.sleep(0.6)
    assert server.steady_for() == 0.0 and not server.caught_up()  # held up now
    # leases heard through it lapse only once overdue by a whole grace time
    assert server.lapse_clock(30.0, now=100.0) == 70.0
    t.join(5)
    time.sleep(0.2)
    assert 0.0 < server.steady_for() < 0.5  # runs again, steady only since then
    assert not server.caught_up()
    time.sleep(0.5)
    assert server.caught_up()  # what waited during the stall was answered by now
    assert server.lapse_clock(30.0, now=100.0) == 100.0
    client.close()
    stopped = RpcServer(tcp_endpoint("127.0.0.1", 0), CODEC, handler)
    assert stopped.steady_for() == float("inf") and stopped.caught_up()  # nothing to wait for
    stopped.stop()


def _echo(endpoint: str) -> Message:
    client = RpcClient(endpoint, CODEC, timeout_s=5)
    try:
        return client.call(Echo(text="ipc"))
    finally:
        client.close()


def test_a_live_ipc_server_is_never_taken_over(tmp_path: Path) -> None:
    """A second server on the ipc path of a live one (two engines with one engine_id on a
    host) fails with a clear error; libzmq alone would take the first one's socket."""
    endpoint = f"ipc://{tmp_path / 'one.ipc'}"
    first = RpcServer(endpoint, CODEC, handler, name="first").start()
    try:
        with pytest.raises(EndpointInUseError, match="same engine_id"):
            RpcServer(endpoint, CODEC, handler, name="second")
        assert _echo(endpoint) == Echo(text="IPC")  # the first still has its socket
    finally:
        first.stop()
    assert not (tmp_path / "one.ipc").exists()  # removed on stop


def test_a_stale_ipc_file_of_a_dead_server_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "stale.ipc"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.listen()
    dead.close()  # the file stays, nobody listens: what a killed engine leaves
    assert path.exists()
    srv = RpcServer(f"ipc://{path}", CODEC, handler, name="new").start()
    try:
        assert _echo(f"ipc://{path}") == Echo(text="IPC")
    finally:
        srv.stop()
    assert not path.exists()


def test_stopping_removes_only_its_own_ipc_file(tmp_path: Path) -> None:
    """A server whose socket file was replaced by another server's leaves that one alone."""
    path = tmp_path / "shared.ipc"
    old = RpcServer(f"ipc://{path}", CODEC, handler, name="old").start()
    os.unlink(path)  # gone from under it (an operator, or a tmp cleaner)
    new = RpcServer(f"ipc://{path}", CODEC, handler, name="new").start()
    try:
        old.stop()
        assert path.exists()
        assert _echo(f"ipc://{path}") == Echo(text="IPC")
    finally:
        new.stop()
    assert not path.exists()
