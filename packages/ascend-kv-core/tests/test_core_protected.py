# SPDX-License-Identifier: Apache-2.0
"""Protected mode (core.protected): without a deployment key a server serves only peers on
its own host. The locality check, ZeroMQ's ``Peer-Address`` on this pyzmq/libzmq, and an
:class:`RpcServer` refusing (counted, the handler never called) and serving. A peer on
another host for real (another network namespace) is in tests-faults/test_faults_protected.py.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from vllm_ascend.distributed.kv_transfer.core import auth, protected
from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient, RpcServer, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.errors import RemoteError
from vllm_ascend.distributed.kv_transfer.core.tooling.doctor_listeners import local_addresses
from vllm_ascend.distributed.kv_transfer.core.wire import Codec, Message

#: TEST-NET-2 (RFC 5737): never an address of this host
FOREIGN = "198.51.100.7"


class Echo(Message):
    text: str


CODEC: Codec[Message] = Codec([Echo])


def own_non_loopback() -> list[str]:
    """This host's non-loopback addresses, read independently of core.protected (doctor's
    ioctl and /proc/net/if_inet6 reading)."""
    return [a for a in local_addresses() if not ipaddress.ip_address(a).is_loopback]


@pytest.fixture(autouse=True)
def no_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.ENV_ALLOW_UNAUTHENTICATED, raising=False)


class Served:
    """A handler that records what reached it."""

    def __init__(self) -> None:
        self.seen: list[Message] = []

    def __call__(self, msg: Message) -> Message:
        self.seen.append(msg)
        assert isinstance(msg, Echo)
        return Echo(text=msg.text.upper())


def refused_total(socket_name: str) -> float:
    return auth.RECORDER.total("auth_refused", socket=socket_name, reason=protected.REFUSAL)


# ---------------------------------------------------------------- the locality check
@pytest.mark.parametrize("address", ["127.0.0.1", "127.45.6.7", "::1", "[::1]",
                                     "::ffff:127.0.0.1"])
def test_loopback_peers_are_local(address: str) -> None:
    assert protected.is_local(address)


@pytest.mark.parametrize("address", [FOREIGN, "2001:db8::7", "::ffff:198.51.100.7", "",
                                     None, "localhost", "not an address", "10.0.0.1:80"])
def test_foreign_unknown_and_non_numeric_peers_are_not(address: str | None) -> None:
    assert not protected.is_local(address)


def test_every_address_of_this_host_is_local() -> None:
    mine = own_non_loopback()
    if not mine:
        pytest.skip("this host has no network interface besides loopback")
    for address in mine:
        assert protected.is_local(address), (address, protected.local_addresses())
    assert {*mine} <= protected.local_addresses()


def test_an_address_added_after_start_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """The addresses are read again (at most every REFRESH_S) when a peer is not among
    them, so an address added while the process runs counts as local."""
    addrs = {"127.0.0.1"}
    monkeypatch.setattr(protected, "_interface_addresses", lambda: set(addrs))
    monkeypatch.setattr(protected, "_LOCAL", protected._LocalAddresses())
    monkeypatch.setattr(protected, "REFRESH_S", 0.0)
    assert not protected.is_local("10.77.0.5")
    addrs.add("10.77.0.5")
    assert protected.is_local("10.77.0.5")
    assert protected.is_local("fe80::1%eth0") is False  # not ours: a zone is stripped


def test_ipc_and_inproc_are_local_by_transport() -> None:
    assert protected.local_transport("ipc:///tmp/x.sock")
    assert protected.local_transport("inproc://x")
    assert not protected.local_transport("tcp://127.0.0.1:5555")
    assert not protected.PeerGate("g", keyed=False, endpoint="ipc:///tmp/x.sock").active
    assert protected.PeerGate("g", keyed=False, endpoint="tcp://10.0.0.1:1").active


def test_the_gate_refuses_counts_and_names_both_ways_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    gate = protected.PeerGate("gate-test", keyed=False, endpoint="tcp://10.0.0.1:1")
    before = refused_total("gate-test")
    assert gate.refusal("127.0.0.1") is None
    message = gate.refusal(FOREIGN)
    assert message is not None and FOREIGN in message
    assert auth.ENV_KEY_FILE in message and f"{auth.ENV_ALLOW_UNAUTHENTICATED}=1" in message
    assert refused_total("gate-test") == before + 1
    # a key decides instead; the opt-out serves every host
    assert not protected.PeerGate("g", keyed=True).active
    monkeypatch.setenv(auth.ENV_ALLOW_UNAUTHENTICATED, "1")
    assert protected.PeerGate("g", keyed=False).refusal(FOREIGN) is None


def test_the_gate_remembers_local_peers_for_a_while_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The check runs on every message: a peer found local is remembered (no lookup per
    message), and forgotten after REMEMBER_S (an address may leave this host)."""
    local = {"10.77.0.9"}
    calls: list[str | None] = []

    def lookup(address: str | None) -> bool:
        calls.append(address)
        return address in local

    monkeypatch.setattr(protected, "is_local", lookup)
    gate = protected.PeerGate("gate-memory", keyed=False, endpoint="tcp://10.77.0.1:1")
    assert gate.refusal("10.77.0.9") is None and gate.refusal("10.77.0.9") is None
    assert calls == ["10.77.0.9"]
    local.clear()  # the address left this host
    monkeypatch.setattr(protected, "REMEMBER_S", 0.0)
    assert gate.refusal("10.77.0.9") is not None
    assert calls == ["10.77.0.9", "10.77.0.9"]


# ---------------------------------------------------------------- ZeroMQ's peer address
def _peer_address(host: str) -> str:
    ctx = zmq.Context.instance()
    router, req = ctx.socket(zmq.ROUTER), ctx.socket(zmq.REQ)
    try:
        for s in (router, req):
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IPV6, int(":" in host))
        port = router.bind_to_random_port(tcp_endpoint(host, 0).rsplit(":", 1)[0])
        req.connect(tcp_endpoint(host, port))
        req.send(b"x")
        assert router.poll(5000)
        frames = router.recv_multipart(copy=False)
        return str(frames[-1].get("Peer-Address"))
    finally:
        router.close(0)
        req.close(0)


def test_zmq_reports_the_peer_address_of_tcp_messages() -> None:
    """This pyzmq/libzmq tells a ROUTER where each TCP message came from: the check rests
    on it. A same-host peer dialling this host's own address comes from that address."""
    assert _peer_address("127.0.0.1") == "127.0.0.1"
    assert _peer_address("::1") == "::1"
    for address in own_non_loopback():
        assert _peer_address(address) == address


def own_ipv4() -> list[str]:
    """This host's non-loopback IPv4 addresses (RpcServer binds IPv4)."""
    return [a for a in own_non_loopback() if ":" not in a]


# ---------------------------------------------------------------- a live RpcServer
@pytest.fixture
def served() -> Served:
    return Served()


@pytest.fixture
def loopback_server(served: Served) -> Iterator[RpcServer[Message]]:
    srv = RpcServer(tcp_endpoint("127.0.0.1", 0), CODEC, served, name="protected-test",
                    auth=None).start()
    yield srv
    srv.stop()


def call(endpoint: str, text: str = "hi") -> Message:
    client = RpcClient(endpoint, CODEC, timeout_s=5, auth=None)
    try:
        return client.call(Echo(text=text))
    finally:
        client.close()


def test_a_keyless_server_serves_same_host_peers(loopback_server: RpcServer[Message],
                                                 served: Served) -> None:
    assert loopback_server.gate.active
    assert call(loopback_server.endpoint) == Echo(text="HI")
    assert served.seen == [Echo(text="hi")]
    assert loopback_server.stats["auth_refused"] == 0


def test_a_keyless_server_on_this_hosts_address_serves_this_host(served: Served) -> None:
    if not own_ipv4():
        pytest.skip("this host has no IPv4 network interface besides loopback")
    for address in own_ipv4():
        srv = RpcServer(tcp_endpoint(address, 0), CODEC, served, name="protected-own",
                        auth=None).start()
        try:
            assert call(srv.endpoint, address) == Echo(text=address.upper())
        finally:
            srv.stop()
    assert len(served.seen) == len(own_ipv4())


def test_a_peer_on_another_host_is_refused_before_the_handler(
        loopback_server: RpcServer[Message], served: Served,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What a peer on another host gets (its address reported as not local here; the real
    one, from another network namespace, is the fault test)."""
    seen_peers: list[str | None] = []

    def foreign(address: str | None) -> bool:
        seen_peers.append(address)
        return False

    monkeypatch.setattr(protected, "is_local", foreign)
    before = refused_total("protected-test")
    with pytest.raises(RemoteError) as err:
        call(loopback_server.endpoint)
    assert err.value.code == protected.REFUSAL == "protected_mode"
    assert auth.ENV_ALLOW_UNAUTHENTICATED in str(err.value)
    assert served.seen == []
    assert seen_peers == ["127.0.0.1"]  # the frame's Peer-Address was checked
    assert refused_total("protected-test") == before + 1
    assert loopback_server.stats["auth_refused"] == 1


def test_the_opt_out_serves_every_host(served: Served, monkeypatch: pytest.MonkeyPatch
                                       ) -> None:
    monkeypatch.setattr(protected, "is_local", lambda address: False)
    monkeypatch.setenv(auth.ENV_ALLOW_UNAUTHENTICATED, "1")
    srv = RpcServer(tcp_endpoint("127.0.0.1", 0), CODEC, served, name="protected-open",
                    auth=None).start()
    try:
        assert not srv.gate.active
        assert call(srv.endpoint) == Echo(text="HI")
    finally:
        srv.stop()


def test_a_keyed_server_leaves_it_to_the_key(served: Served,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protected, "is_local", lambda address: False)
    key = auth.Authenticator([b"protected-mode-test-key-0123456789"])
    srv = RpcServer(tcp_endpoint("127.0.0.1", 0), CODEC, served, name="protected-keyed",
                    auth=key).start()
    client = RpcClient(srv.endpoint, CODEC, timeout_s=5, auth=key)
    try:
        assert not srv.gate.active
        assert client.call(Echo(text="k")) == Echo(text="K")
    finally:
        client.close()
        srv.stop()


def test_an_ipc_server_needs_no_peer_address(served: Served, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(protected, "is_local", lambda address: False)
    srv = RpcServer(f"ipc://{tmp_path / 'p.sock'}", CODEC, served, name="protected-ipc",
                    auth=None).start()
    try:
        assert not srv.gate.active
        assert call(srv.endpoint) == Echo(text="HI")
    finally:
        srv.stop()

