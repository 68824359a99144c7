# SPDX-License-Identifier: Apache-2.0
"""The deployment key: envelopes, rotation, stale and replayed frames, the channel with and
without a key, and the environment it is read from."""

from __future__ import annotations

import logging
import os
import pickle
import threading
from typing import Any

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.auth import (
    AUTH_MAGIC,
    HEADER_BYTES,
    Authenticator,
    AuthError,
    ReplayCache,
)
from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient, RpcServer, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError, RemoteError
from vllm_ascend.distributed.kv_transfer.core.wire import Codec, Message, Ping, Pong

OLD = b"old-deployment-key-0123456789"
NEW = b"new-deployment-key-9876543210"
OTHER = b"someone-elses-key-abcdefghijk"


class Echo(Message):
    text: str


CODEC: Codec[Message] = Codec([Echo], max_size=1 << 16)


class Clock:
    def __init__(self, t: float = 1_700_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def refused(socket: str, reason: str) -> float:
    return auth.RECORDER.total("auth_refused", socket=socket, reason=reason)


# ---------------------------------------------------------------- envelopes
def test_seal_then_open_gives_the_frame_back() -> None:
    a = Authenticator([NEW])
    frame = CODEC.encode(Echo(text="hi"))
    sealed, nonce = a.seal(frame)
    assert sealed.startswith(AUTH_MAGIC)
    assert len(sealed) == auth.OVERHEAD_BYTES + len(frame)
    payload, got_nonce = a.open(sealed)
    assert bytes(payload) == frame and got_nonce == nonce
    assert CODEC.decode(payload) == Echo(text="hi")


def test_the_frame_travels_encrypted() -> None:
    """Nothing of the wire frame shows in the envelope: a grant's addresses, a request id
    and a capability token are unreadable without the key; the same frame sealed twice
    gives two different ciphertexts (a fresh nonce each time)."""
    secret = b"req-7f3a|token=Zq81x|region 0x7f0000001000 stride 65536"
    frame = CODEC.encode(Echo(text=secret.decode()))
    a = Authenticator([NEW])
    one, _ = a.seal(frame, audience="port:17000")
    two, _ = a.seal(frame, audience="port:17000")
    for sealed in (one, two):
        body = sealed[HEADER_BYTES:]
        assert len(body) == len(frame) + auth.TAG_BYTES
        for piece in (b"req-7f3a", b"Zq81x", b"0x7f0000001000", b"stride", frame[:12]):
            assert piece not in sealed
    assert one[HEADER_BYTES:] != two[HEADER_BYTES:]
    assert bytes(Authenticator([NEW]).open(one, audience="port:17000")[0]) == frame


def test_an_envelope_of_version_2_is_refused() -> None:
    """The HMAC-only envelope of the last release (a frame in clear) is not accepted:
    a peer that did not upgrade is refused as malformed, naming the version."""
    sealed, _ = Authenticator([NEW]).seal(CODEC.encode(Echo(text="x")))
    old = bytearray(sealed)
    old[4] = 2
    with pytest.raises(AuthError) as err:
        Authenticator([NEW]).open(bytes(old))
    assert err.value.reason == "malformed" and "version 2" in str(err.value)


def test_wrong_key_and_tampering_are_bad_mac() -> None:
    sealed, _ = Authenticator([OTHER]).seal(CODEC.encode(Echo(text="x")))
    with pytest.raises(AuthError) as err:
        Authenticator([NEW]).open(sealed)
    assert err.value.reason == "bad_mac"
    good, _ = Authenticator([NEW]).seal(CODEC.encode(Echo(text="x")))
    # timestamp, nonce, the encrypted frame, the GCM tag (the receiver tag: misdirected)
    for i in (5, 20, HEADER_BYTES, len(good) - 1):
        bad = bytearray(good)
        bad[i] ^= 1
        with pytest.raises(AuthError) as err:
            Authenticator([NEW]).open(bytes(bad))
        assert err.value.reason == "bad_mac"


def test_rotation_first_key_signs_every_key_verifies() -> None:
    rotating = Authenticator([NEW, OLD])
    old_only, new_only = Authenticator([OLD]), Authenticator([NEW])
    frame = CODEC.encode(Echo(text="r"))
    rotating.open(old_only.seal(frame)[0])        # an instance not yet rotated
    rotating.open(new_only.seal(frame)[0])        # one already rotated
    new_only.open(rotating.seal(frame)[0])        # the new key signs
    with pytest.raises(AuthError):
        old_only.open(rotating.seal(frame)[0])
    assert rotating.check_bearer(Authenticator([OLD]).bearer_token("metaserver"), "metaserver")
    assert not rotating.check_bearer(Authenticator([OTHER]).bearer_token("metaserver"),
                                     "metaserver")


def test_stale_and_future_timestamps_are_refused() -> None:
    clock = Clock()
    sender, receiver = Authenticator([NEW], clock=clock), Authenticator([NEW], window_s=30,
                                                                         clock=Clock(clock.t))
    frame = CODEC.encode(Echo(text="t"))
    receiver.clock = Clock(clock.t + 29)
    receiver.open(sender.seal(frame)[0])
    for skew in (31, -31):
        receiver.clock = Clock(clock.t + skew)
        with pytest.raises(AuthError) as err:
            receiver.open(sender.seal(frame)[0])
        assert err.value.reason == "stale"


def test_replayed_request_is_refused_but_a_reply_is_bound_to_its_request() -> None:
    a = Authenticator([NEW])
    sealed, nonce = a.seal(CODEC.encode(Echo(text="once")))
    a.open(sealed)
    with pytest.raises(AuthError) as err:
        a.open(sealed)
    assert err.value.reason == "replay"
    reply, _ = a.seal(CODEC.encode(Echo(text="ok")), reply_to=nonce)
    a.open(reply, reply_to=nonce)
    with pytest.raises(AuthError, match="tag checks"):  # an old reply to another request
        a.open(reply, reply_to=os.urandom(16))
    with pytest.raises(AuthError, match="tag checks"):  # a request is not a reply, nor the reverse
        a.open(a.seal(b"x")[0], reply_to=nonce)
    with pytest.raises(AuthError, match="tag checks"):
        a.open(reply)


def test_replay_cache_is_bounded_and_refuses_what_it_forgot() -> None:
    cache = ReplayCache(window_s=30, max_entries=3)
    now = 1_000_000
    for i in range(3):
        assert cache.add(bytes([i]) * 16, now + i, now)
    assert cache.add(b"\x09" * 16, now + 3, now)  # overflows: forgets nonce 0 (ts now)
    assert len(cache) == 3
    assert not cache.add(b"\x00" * 16, now, now)  # can no longer tell: refused
    assert not cache.add(b"\x01" * 16, now + 1, now)  # still remembered
    assert cache.add(b"\x0a" * 16, now + 10, now)
    later = now + 61_000  # entries out of the (doubled) window are dropped
    assert cache.add(b"\x0b" * 16, later, later) and len(cache) == 1


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=600))
def test_garbage_envelopes_are_a_typed_error(data: bytes) -> None:
    a = Authenticator([NEW])
    for frame in (data, AUTH_MAGIC + data, AUTH_MAGIC + b"\x01" + data):
        with pytest.raises(AuthError) as err:
            a.open(frame)
        assert err.value.reason in auth.REASONS


def test_a_pickle_is_never_executed_even_when_signed(tmp_path: object) -> None:
    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("touch /tmp/vakv-auth-pwned",))

    a = Authenticator([NEW])
    payload, _ = a.open(a.seal(pickle.dumps(Boom()))[0])
    with pytest.raises(Exception, match="not a vllm-ascend-kv message"):
        CODEC.decode(payload)
    assert not os.path.exists("/tmp/vakv-auth-pwned")


# ---------------------------------------------------------------- environment
def test_keys_from_env_and_files(tmp_path: object, caplog: pytest.LogCaptureFixture) -> None:
    from pathlib import Path
    d = Path(str(tmp_path))
    assert auth.load_keys({}) == ()
    assert auth.load_keys({auth.ENV_KEY: f"{NEW.decode()}, {OLD.decode()}"}) == (NEW, OLD)
    f1, f2 = d / "new.key", d / "old.key"
    f1.write_text(f"# rotated 2026-12\n{NEW.decode()}\n")
    f2.write_text(OLD.decode() + "\n")
    f1.chmod(0o600)
    f2.chmod(0o644)
    with caplog.at_level(logging.WARNING):
        assert auth.load_keys({auth.ENV_KEY_FILE: f"{f1},{f2}"}) == (NEW, OLD)
    assert "chmod 600" in caplog.text and str(f2) in caplog.text
    with pytest.raises(ConfigError, match="not both"):
        auth.load_keys({auth.ENV_KEY: NEW.decode(), auth.ENV_KEY_FILE: str(f1)})
    with pytest.raises(ConfigError, match="at least 16") as err:
        auth.load_keys({auth.ENV_KEY: "short"})
    assert "short" not in str(err.value)  # a key never appears in a message
    with pytest.raises(ConfigError, match="cannot read"):
        auth.load_keys({auth.ENV_KEY_FILE: str(d / "missing")})
    (d / "empty").write_text("# nothing\n")
    with pytest.raises(ConfigError, match="holds no key"):
        auth.load_keys({auth.ENV_KEY_FILE: str(d / "empty")})
    assert auth.load_window({auth.ENV_WINDOW: "5"}) == 5.0
    with pytest.raises(ConfigError, match=auth.ENV_WINDOW):
        auth.load_window({auth.ENV_WINDOW: "-1"})


def test_no_key_says_protected_mode_once(monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(auth, "_cached", None)
    monkeypatch.setattr(auth, "_warned", False)
    with caplog.at_level(logging.INFO, logger=auth.__name__):
        assert auth.from_env({}) is None
        monkeypatch.setattr(auth, "_cached", None)
        assert auth.from_env({}) is None
    said = [r for r in caplog.records if "protected mode" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_the_opt_out_of_protected_mode_warns_once_loudly(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(auth, "_cached", None)
    monkeypatch.setattr(auth, "_warned", False)
    env = {auth.ENV_ALLOW_UNAUTHENTICATED: "1"}
    with caplog.at_level(logging.WARNING):
        assert auth.from_env(env) is None
        assert auth.from_env(env) is None
        monkeypatch.setattr(auth, "_cached", None)
        assert auth.from_env(env) is None
    warnings = [r for r in caplog.records if "UNAUTHENTICATED" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    assert auth.ENV_ALLOW_UNAUTHENTICATED in warnings[0].getMessage()


def test_mode_of_an_environment() -> None:
    assert auth.mode({}) == auth.MODE_PROTECTED
    assert auth.mode({auth.ENV_ALLOW_UNAUTHENTICATED: "0"}) == auth.MODE_PROTECTED
    assert auth.mode({auth.ENV_ALLOW_UNAUTHENTICATED: " 1 "}) == auth.MODE_OPEN
    assert auth.mode({auth.ENV_ALLOW_UNAUTHENTICATED: "true"}) == auth.MODE_OPEN
    # a key decides, whatever the opt-out says
    assert auth.mode({auth.ENV_KEY: NEW.decode(),
                      auth.ENV_ALLOW_UNAUTHENTICATED: "1"}) == auth.MODE_KEYED
    with pytest.raises(ConfigError, match=auth.ENV_ALLOW_UNAUTHENTICATED):
        auth.mode({auth.ENV_ALLOW_UNAUTHENTICATED: "maybe"})
    keyed = auth.from_env({auth.ENV_KEY: NEW.decode()})
    assert keyed is not None and keyed.keys == (NEW,)
    assert auth.from_env({auth.ENV_KEY: NEW.decode()}) is keyed  # one replay cache a process


# ---------------------------------------------------------------- the channel
def handler(msg: Message) -> Message:
    assert isinstance(msg, Echo)
    return Echo(text=msg.text.upper())


@pytest.fixture
def keyed_server() -> RpcServer[Message]:
    srv = RpcServer(tcp_endpoint("127.0.0.1", 0), CODEC, handler, name="auth-test",
                    auth=Authenticator([NEW, OLD])).start()
    yield srv
    srv.stop()


def test_keyed_client_is_served_others_are_refused_and_counted(
        keyed_server: RpcServer[Message]) -> None:
    # mid-rotation: the client still signs with the old key, the server with the new one
    ok = RpcClient(keyed_server.endpoint, CODEC, timeout_s=5, auth=Authenticator([OLD, NEW]))
    assert ok.call(Echo(text="abc")) == Echo(text="ABC")
    before = {r: refused("auth-test", r) for r in auth.REASONS}
    plain = RpcClient(keyed_server.endpoint, CODEC, timeout_s=5, auth=None)
    with pytest.raises(RemoteError) as err:
        plain.call(Echo(text="abc"))
    assert err.value.code == "auth_refused"
    wrong = RpcClient(keyed_server.endpoint, CODEC, timeout_s=5, auth=Authenticator([OTHER]))
    with pytest.raises(RemoteError) as err:
        wrong.call(Echo(text="abc"))
    assert err.value.code == "auth_refused"
    stale = RpcClient(keyed_server.endpoint, CODEC, timeout_s=5,
                      auth=Authenticator([NEW], clock=lambda: 1000.0))
    with pytest.raises(RemoteError):
        stale.call(Echo(text="abc"))
    assert refused("auth-test", "unauthenticated") == before["unauthenticated"] + 1
    assert refused("auth-test", "bad_mac") == before["bad_mac"] + 1
    assert refused("auth-test", "stale") == before["stale"] + 1
    assert keyed_server.stats["auth_refused"] == 3
    assert ok.call(Echo(text="still")) == Echo(text="STILL")
    for c in (ok, plain, wrong, stale):
        c.close()


def test_a_captured_frame_replayed_on_a_raw_socket_is_refused(
        keyed_server: RpcServer[Message]) -> None:
    sealed, _ = Authenticator([NEW]).seal(CODEC.encode(Echo(text="once")),
                                          audience=keyed_server.audience)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(keyed_server.endpoint)
    before = refused("auth-test", "replay")
    replies = []
    for _ in range(2):
        sock.send_multipart([b"", sealed])
        assert sock.poll(5000)
        replies.append(sock.recv_multipart()[-1])
    sock.close(0)
    assert replies[0].startswith(AUTH_MAGIC)  # served once, signed
    assert b"auth_refused" in replies[1] and not replies[1].startswith(AUTH_MAGIC)
    assert refused("auth-test", "replay") == before + 1


def test_a_frame_for_one_rank_is_refused_by_another_with_the_same_key() -> None:
    """The issue's case: a second authenticator (another process: its own replay cache)
    with the same key, for another rank, refuses a frame captured for the first."""
    rank0, rank1 = Authenticator([NEW]), Authenticator([NEW])
    assert auth.audience_of("tcp://10.0.0.5:17000") == "port:17000"
    sealed, _ = Authenticator([NEW]).seal(CODEC.encode(Echo(text="claim")),
                                          audience="port:17000")
    with pytest.raises(AuthError) as err:
        rank1.open(sealed, audience="port:17001")
    assert err.value.reason == "misdirected"
    rank0.open(sealed, audience="port:17000")  # its receiver takes it, once
    with pytest.raises(AuthError) as err:
        rank0.open(sealed, audience="port:17000")
    assert err.value.reason == "replay"
    # the tag in the header is only a hint: the MAC covers the receiver itself
    forged = bytearray(sealed)
    tag_at = HEADER_BYTES - auth.AUDIENCE_TAG_BYTES
    forged[tag_at:tag_at + auth.AUDIENCE_TAG_BYTES] = auth.audience_tag("port:17001")
    with pytest.raises(AuthError) as err:
        rank1.open(bytes(forged), audience="port:17001")
    assert err.value.reason == "bad_mac"


def test_a_frame_captured_for_one_server_is_refused_by_another() -> None:
    """Two keyed servers, each with its own authenticator (two processes, two replay
    caches): a client's frame to the first, captured and sent to the second within the
    window, is refused there as misdirected and counted; its handler never runs."""
    seen: list[str] = []

    def record(msg: Message) -> Message:
        assert isinstance(msg, Echo)
        seen.append(msg.text)
        return Echo(text=msg.text.upper())

    first = RpcServer(tcp_endpoint("127.0.0.1", 0), CODEC, record, name="rank-0",
                      auth=Authenticator([NEW])).start()
    second = RpcServer(tcp_endpoint("127.0.0.1", 0), CODEC, record, name="rank-1",
                       auth=Authenticator([NEW])).start()
    try:
        client = RpcClient(first.endpoint, CODEC, timeout_s=5, auth=Authenticator([NEW]))
        assert client.audience == first.audience != second.audience
        client.close()
        # what the client puts on the wire to the first server, as an eavesdropper has it
        captured, _ = Authenticator([NEW]).seal(CODEC.encode(Echo(text="done r1")),
                                                audience=first.audience)
        before = refused("rank-1", "misdirected")
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(second.endpoint)
        sock.send_multipart([b"", captured])
        assert sock.poll(5000)
        reply = sock.recv_multipart()[-1]
        sock.close(0)
        assert b"auth_refused" in reply and b"misdirected" in reply
        assert refused("rank-1", "misdirected") == before + 1 and seen == []
        # the frame still works where it was going (it was never accepted elsewhere)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(first.endpoint)
        sock.send_multipart([b"", captured])
        assert sock.poll(5000) and sock.recv_multipart()[-1].startswith(AUTH_MAGIC)
        sock.close(0)
        assert seen == ["done r1"]
    finally:
        first.stop()
        second.stop()


def test_a_frame_for_one_instance_is_refused_by_another_on_the_same_port() -> None:
    """Every instance of a fleet listens on the same ports, on its own host: a frame sealed
    for instance P-1's side channel (its engine id and port), captured and sent to P-2's
    server on the same port number (another host, its own replay cache), is refused there as
    misdirected and its handler never runs; the frame still works where it was going."""
    assert auth.audience_of("tcp://10.0.0.5:17000", "P-1") == "engine:P-1|port:17000"
    assert auth.audience_of("tcp://10.0.0.5:17000", "") == "port:17000"
    seen: list[str] = []

    def record(msg: Message) -> Message:
        assert isinstance(msg, Echo)
        seen.append(msg.text)
        return Echo(text=msg.text.upper())

    p1 = RpcServer(tcp_endpoint("127.0.0.1", 0), CODEC, record, name="p-1",
                   auth=Authenticator([NEW]), engine_id="P-1").start()
    port = p1.endpoint.rsplit(":", 1)[1]
    try:
        client = RpcClient(p1.endpoint, CODEC, timeout_s=5, auth=Authenticator([NEW]),
                           engine_id="P-1")
        assert client.audience == p1.audience == f"engine:P-1|port:{port}"
        assert client.call(Echo(text="claim")) == Echo(text="CLAIM")
        client.close()
        captured, _ = Authenticator([NEW]).seal(CODEC.encode(Echo(text="done r1")),
                                                audience=p1.audience)
        # P-2: same port number (this test's host cannot bind it twice: the audience P-2's
        # server checks is what differs), its own authenticator
        p2_auth = Authenticator([NEW])
        with pytest.raises(AuthError) as err:
            p2_auth.open(captured, audience=auth.audience_of(p1.endpoint, "P-2"))
        assert err.value.reason == "misdirected"
        # nor does a client that names no engine reach an engine-bound server, but for a
        # Ping (what `doctor --peer host:port` sends, not knowing the engine id)
        anonymous = RpcClient(p1.endpoint, CODEC, timeout_s=5, auth=Authenticator([NEW]))
        before = refused("p-1", "misdirected")
        with pytest.raises(RemoteError) as refused_err:
            anonymous.call(Echo(text="hello"))
        assert refused_err.value.code == "auth_refused"
        assert refused("p-1", "misdirected") == before + 1
        assert anonymous.call(Ping()) == Pong(name="p-1")
        anonymous.close()
        # and a Ping under another key is refused as any frame is
        guesser = RpcClient(p1.endpoint, CODEC, timeout_s=5, auth=Authenticator([OLD]))
        with pytest.raises(RemoteError):
            guesser.call(Ping())
        guesser.close()
        assert seen == ["claim"]
    finally:
        p1.stop()


def test_unsigned_success_reply_is_refused_by_a_keyed_client() -> None:
    srv = RpcServer(tcp_endpoint("127.0.0.1", 0), CODEC, handler, name="no-key",
                    auth=None).start()
    try:
        client = RpcClient(srv.endpoint, CODEC, timeout_s=5, auth=Authenticator([NEW]))
        with pytest.raises(RemoteError, match="no key configured"):
            client.call(Echo(text="abc"))  # the keyless server says why, unsigned
        client.close()
    finally:
        srv.stop()


def test_without_a_key_the_bytes_are_the_plain_wire_frames() -> None:
    seen: list[bytes] = []
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = RpcClient(f"tcp://127.0.0.1:{port}", CODEC, timeout_s=2, auth=None)
    import threading

    def answer() -> None:
        frames = router.recv_multipart()
        seen.append(frames[-1])
        router.send_multipart([*frames[:-1], CODEC.encode(Echo(text="A"))])

    t = threading.Thread(target=answer)
    t.start()
    assert client.call(Echo(text="a")) == Echo(text="A")
    t.join(5)
    assert seen == [CODEC.encode(Echo(text="a"))]
    client.close()
    router.close(0)


# ---------------------------------------------------------------- doctor
def test_doctor_says_the_mode_and_warns_on_an_unbound_mooncake(tmp_path: object) -> None:
    from vllm_ascend.distributed.kv_transfer.core.tooling import doctor_auth
    from vllm_ascend.distributed.kv_transfer.core.tooling.doctor import Doctor

    mode = doctor_auth.MODE

    def checks(env: dict[str, str]) -> dict[str, tuple[str, str]]:
        d = Doctor({})
        doctor_auth.check(d, env)
        return {c.what: (c.status, c.detail) for c in d.checks}

    def statuses(env: dict[str, str]) -> dict[str, str]:
        return {what: status for what, (status, _detail) in checks(env).items()}

    # no key, on loopback: protected, same-host only, nothing to warn about
    local = checks({"VLLM_ASCEND_KV_HOST": "127.0.0.1"})
    assert local[mode][0] == "ok" and local[mode][1].startswith("protected (same-host only)")
    assert local["Mooncake bind address"][0] == "warn"
    # no key, advertising a network address: peers elsewhere would be refused
    remote = checks({"VLLM_ASCEND_KV_HOST": "10.0.0.5", "MC_TCP_BIND_ADDRESS": "10.0.0.5"})
    assert remote[mode][0] == "warn" and "protected (same-host only)" in remote[mode][1]
    assert "10.0.0.5" in remote[mode][1]
    # the opt-out: open, warned
    opened = checks({auth.ENV_ALLOW_UNAUTHENTICATED: "1", "VLLM_ASCEND_KV_HOST": "127.0.0.1"})
    assert opened[mode][0] == "warn" and opened[mode][1].startswith("open by opt-out")
    keyed = checks({auth.ENV_KEY: NEW.decode(), "MC_TCP_BIND_ADDRESS": "10.0.0.5",
                    "VLLM_ASCEND_KV_HOST": "10.0.0.5"})
    assert keyed[mode][0] == "ok" and keyed[mode][1].startswith("keyed: 1 active key(s)")
    assert keyed["Mooncake bind address"][0] == "ok"
    assert statuses({auth.ENV_KEY: "short", "MC_TCP_BIND_ADDRESS": "0.0.0.0"}) == {
        mode: "fail", "Mooncake bind address": "warn"}
    assert statuses({auth.ENV_ALLOW_UNAUTHENTICATED: "perhaps"})[mode] == "fail"
    full = Doctor({"kv_connector": "X", "kv_role": "kv_both"})
    full.run()
    assert any(c.what == mode for c in full.checks)


class _Wiretap:
    """A TCP relay that forwards both directions and keeps every byte it saw (what an
    eavesdropper on the path has)."""

    def __init__(self, target_port: int) -> None:
        import socket

        self.seen = bytearray()
        self._target = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket

        try:
            conn, _addr = self._listener.accept()
        except OSError:
            return
        upstream = socket.create_connection(("127.0.0.1", self._target))
        for src, dst in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: Any, dst: Any) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            with self._lock:
                self.seen += data
            dst.sendall(data)

    def close(self) -> None:
        self._listener.close()


@pytest.mark.parametrize("keyed", [False, True], ids=["no-key", "keyed"])
def test_a_wiretap_reads_nothing_of_a_keyed_exchange(keyed: bool) -> None:
    """A request and its reply through a TCP relay that records every byte: without a key
    the secrets cross in clear (the control of the check); with a key neither the request's
    token nor the reply's addresses appear anywhere in what crossed."""
    secret_in, secret_out = "token=Zq81xK2v", "grant 0x7f3a00001000"
    key = Authenticator([NEW]) if keyed else None
    srv = RpcServer(tcp_endpoint("127.0.0.1", 0), CODEC,
                    lambda msg: Echo(text=secret_out), name="tapped", auth=key).start()
    tap = _Wiretap(int(srv.endpoint.rsplit(":", 1)[1]))
    try:
        client = RpcClient(tcp_endpoint("127.0.0.1", tap.port), CODEC, timeout_s=5,
                           auth=Authenticator([NEW]) if keyed else None,
                           audience=srv.audience)
        assert client.call(Echo(text=secret_in)) == Echo(text=secret_out)
        client.close()
        seen = bytes(tap.seen)
        assert len(seen) > 2 * len(secret_out)
        found = [s for s in (secret_in, secret_out) if s.encode() in seen]
        assert found == ([] if keyed else [secret_in, secret_out])
    finally:
        tap.close()
        srv.stop()
