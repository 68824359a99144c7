# SPDX-License-Identifier: Apache-2.0
"""With a deployment key configured, an outsider gets nothing from the side channels.

Real P and D workers of both connectors (their real side channels, the real transfer
engine on loopback). The keyed instances read the key from the environment as in
production; the outsider is a process-side client without the key, with another key, with
a stale clock, or replaying a captured frame. Each of its messages is refused and counted,
nothing is held or freed because of it, and the keyed peers then work as usual.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import zmq
from p2p_worker_harness import numbered_caches, pd_vllm_config

from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.auth import AUTH_MAGIC, Authenticator
from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.errors import RemoteError
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import (
    MooncakeLayerwiseConfig,
    MooncakeP2PConfig,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.contract import (
    MooncakeLayerwiseConnectorMetadata,
    RecvReq,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.worker import LayerwiseWorker
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.params import RemotePrefill
from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import (
    CODEC,
    LAYERWISE_CODEC,
    AgentMeta,
    Claim,
    Done,
    GetMeta,
    PushBegin,
    Renew,
    worker_port,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import (
    MooncakeConnectorMetadata,
    RecvMeta,
    SendMeta,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.worker import PullWorker

KEY = "deployment-key-for-the-auth-tests-0123"
BS, NB, HEADS, HD, LAYERS = 16, 8, 2, 8, 2


def vllm_config(role: str, kv_port: int) -> Any:
    return pd_vllm_config(role, kv_port, block_size=BS, heads=HEADS)


def caches(fill: bool) -> dict[str, Any]:
    return numbered_caches(fill, layers=LAYERS, blocks=NB, heads=HEADS, block_size=BS,
                           head_size=HD)


@pytest.fixture
def keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The deployment key in the environment, read afresh by this test's sockets."""
    monkeypatch.setenv(auth.ENV_KEY, KEY)
    monkeypatch.delenv(auth.ENV_KEY_FILE, raising=False)
    monkeypatch.setattr(auth, "_cached", None)
    yield
    monkeypatch.setattr(auth, "_cached", None)


def outsiders(endpoint: str, codec: Any, engine_id: str = "") -> dict[str, RpcClient[Any]]:
    """Clients that each fail the key check in one way (the frames name the right receiver,
    ``engine_id`` an engine-bound server's)."""
    return {
        "unauthenticated": RpcClient(endpoint, codec, timeout_s=5, auth=None),
        "bad_mac": RpcClient(endpoint, codec, timeout_s=5, engine_id=engine_id,
                             auth=Authenticator([b"an-outsiders-guess-at-the-key"])),
        "stale": RpcClient(endpoint, codec, timeout_s=5, engine_id=engine_id,
                           auth=Authenticator([KEY.encode()], clock=lambda: time.time() - 120)),
        # the right key, the frame sealed for another instance at the same port (a frame
        # captured on its way to another host of the fleet)
        "misdirected": RpcClient(endpoint, codec, timeout_s=5,
                                 engine_id=f"not-{engine_id}" if engine_id else "x",
                                 auth=Authenticator([KEY.encode()])),
    }


def replay(endpoint: str, frame: bytes) -> bytes:
    """Send a captured, validly signed frame again on a raw socket; returns the answer."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", frame])
        assert sock.poll(5000), "no answer to the replayed frame"
        return bytes(sock.recv_multipart()[-1])
    finally:
        sock.close(0)


def refused(socket: str, reason: str) -> float:
    return auth.RECORDER.total("auth_refused", socket=socket, reason=reason)


def test_pull_side_channel_refuses_outsiders_and_serves_the_keyed_d(keyed: None) -> None:
    p_port, d_port = free_port(), free_port()
    cfg = MooncakeP2PConfig.from_dict({"lease_ttl_s": 30.0})
    p = PullWorker(vllm_config("kv_producer", p_port), cfg, "P", MetricsRecorder(P2P_METRICS),
                   tp_rank=0, pp_rank=0)
    d = PullWorker(vllm_config("kv_consumer", d_port),
                   MooncakeP2PConfig.from_dict({"load_timeout_s": 10.0}), "D",
                   MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    cp, cd = caches(True), caches(False)
    try:
        p.register_kv_caches(cp)
        d.register_kv_caches(cd)
        assert p.holder is not None and p.holder.server is not None
        assert p.holder.server.auth is not None  # the key came from the environment
        server = p.holder.server.name
        token = auth.capability_token()
        p.start_load_kv(MooncakeConnectorMetadata(
            requests_to_send={"r": SendMeta("r", [3, 5], token)}))
        endpoint = tcp_endpoint("127.0.0.1", worker_port(p_port, tp_rank=0, tp_size=1))
        before = {r: refused(server, r) for r in auth.REASONS}
        msgs = [GetMeta(requester="x"), Claim(request_id="r", block_ids=[3, 5], reader="x",
                                              token=token),
                Renew(request_ids=["r"]), Done(request_id="r", reader="x", token=token)]
        for reason, client in outsiders(endpoint, CODEC, engine_id="P").items():
            for msg in msgs:
                with pytest.raises(RemoteError) as err:
                    client.call(msg)
                assert err.value.code == "auth_refused", (reason, msg)
            assert refused(server, reason) == before[reason] + len(msgs)
            client.close()
        # a captured frame of a keyed peer, replayed: refused, and it renews nothing
        frame, _ = Authenticator([KEY.encode()]).seal(CODEC.encode(
            Renew(request_ids=["r"])), audience=auth.audience_of(endpoint, "P"))
        assert replay(endpoint, frame).startswith(AUTH_MAGIC)
        assert b"auth_refused" in replay(endpoint, frame)
        assert refused(server, "replay") == before["replay"] + 1
        held = p.holder.held.get("r")
        assert held is not None and held.readers_done == set()
        assert p.get_finished() == (None, None)  # nothing was freed

        # a keyed peer without the request's token cannot claim or free it either
        insider = RpcClient(endpoint, CODEC, timeout_s=5, engine_id="P")
        for msg in (Claim(request_id="r", block_ids=[3, 5], reader="x"),
                    Claim(request_id="r", block_ids=[3, 5], reader="x", token="guess"),
                    Done(request_id="r", reader="x", token="guess")):
            with pytest.raises(RemoteError) as err:
                insider.call(msg)
            assert err.value.code == "bad_token"
        assert isinstance(insider.call(GetMeta(requester="insider")), AgentMeta)
        insider.close()
        assert refused(server, "bad_token") >= 3
        assert p.holder.held.get("r") is not None and held.readers_done == set()

        # the keyed D with the token from kv_transfer_params pulls the right bytes
        remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=p_port, request_id="r",
                               block_ids=[3, 5], tp_size=1, pcp_size=1, dcp_size=1, token=token)
        d.start_load_kv(MooncakeConnectorMetadata(requests={"dr": RecvMeta(
            "dr", [1, 2], remote, remote_block_ids=[3, 5])}))
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            _s, recving = d.get_finished()
            if recving and "dr" in recving:
                break
            time.sleep(0.01)
        assert d.get_block_ids_with_load_errors() == set()
        for name, value in cd.items():
            torch.testing.assert_close(value[[1, 2]], cp[name][[3, 5]], rtol=0, atol=0)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and p.holder.held.get("r") is not None:
            p.get_finished()
            time.sleep(0.01)
        assert p.holder.held.get("r") is None  # freed by the keyed D's Done
    finally:
        p.shutdown()
        d.shutdown()


def test_layerwise_side_channel_refuses_outsiders(keyed: None) -> None:
    d_port = free_port()
    d = LayerwiseWorker(vllm_config("kv_consumer", d_port),
                        MooncakeLayerwiseConfig.from_dict({"load_timeout_s": 10.0}), "D",
                        MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    try:
        d.register_kv_caches(caches(False))
        assert d.receiver is not None and d.receiver.server is not None
        server = d.receiver.server.name
        d.start_load_kv(MooncakeLayerwiseConnectorMetadata(requests={"r": RecvReq("r", [1, 2],
                                                                                  0)}))
        assert d.layout is not None
        begin = PushBegin(request_id="r", sender="x/tp0", p_rank=0, p_tp_size=1,
                          block_ids=[1, 2], block_lens=[r.block_len for r in d.layout.regions])
        endpoint = tcp_endpoint("127.0.0.1", worker_port(d_port, tp_rank=0, tp_size=1))
        before = {r: refused(server, r) for r in auth.REASONS}
        for reason, client in outsiders(endpoint, LAYERWISE_CODEC, engine_id="D").items():
            for msg in (GetMeta(requester="x"), begin):
                with pytest.raises(RemoteError) as err:
                    client.call(msg)
                assert err.value.code == "auth_refused"
            assert refused(server, reason) == before[reason] + 2
            client.close()
        assert d.receiver.incoming["r"].senders == {}  # no write lease was granted
        insider = RpcClient(endpoint, LAYERWISE_CODEC, timeout_s=5, engine_id="D")
        assert isinstance(insider.call(GetMeta(requester="p")), AgentMeta)
        insider.close()
    finally:
        d.shutdown()


def test_the_claim_token_travels_in_kv_transfer_params() -> None:
    from vllm_ascend.distributed.kv_transfer.kv_p2p.errors import KVParamsError
    from vllm_ascend.distributed.kv_transfer.kv_p2p.params import (
        params_for_decode,
        parse_remote_prefill,
    )

    kw: dict[str, Any] = {"block_ids": [4, 9], "engine_id": "p0", "host": "127.0.0.1",
                          "port": 20000, "request_id": "q", "tp_size": 1, "last_token_id": 1,
                          "num_prompt_blocks": 2}
    token = auth.capability_token()
    assert len(token) >= 32 and token != auth.capability_token()
    params = params_for_decode(**kw, claim_token=token)
    assert parse_remote_prefill(params, prompt_len=20, block_size=16).token == token
    old = params_for_decode(**kw)  # a P that issues no token: the params of before
    assert "remote_claim_token" not in old
    assert parse_remote_prefill(old, prompt_len=20, block_size=16).token == ""
    with pytest.raises(KVParamsError, match="remote_claim_token"):
        parse_remote_prefill({**params, "remote_claim_token": 5}, prompt_len=20, block_size=16)


def test_without_a_key_a_token_is_optional_but_a_wrong_one_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.ENV_KEY, raising=False)
    monkeypatch.delenv(auth.ENV_KEY_FILE, raising=False)
    monkeypatch.setattr(auth, "_cached", None)
    p_port = free_port()
    p = PullWorker(vllm_config("kv_producer", p_port), MooncakeP2PConfig.from_dict({}), "P",
                   MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    try:
        p.register_kv_caches(caches(True))
        assert p.holder is not None and p.holder.server is not None
        assert p.holder.server.auth is None
        p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={
            "a": SendMeta("a", [1], "tok-a"), "b": SendMeta("b", [2], "tok-b")}))
        client = RpcClient(tcp_endpoint("127.0.0.1", worker_port(p_port, tp_rank=0, tp_size=1)),
                           CODEC, timeout_s=5)
        with pytest.raises(RemoteError) as err:
            client.call(Claim(request_id="a", block_ids=[1], reader="d", token="tok-b"))
        assert err.value.code == "bad_token"
        client.call(Claim(request_id="a", block_ids=[1], reader="d", token="tok-a"))
        client.call(Claim(request_id="b", block_ids=[2], reader="d"))  # an old D: no token
        client.close()
    finally:
        p.shutdown()


def test_metaserver_wants_the_bearer_token_and_d_sends_it(keyed: None) -> None:
    from ascend_kv_testing.serving import local_test_client
    from vllm_ascend.distributed.kv_transfer.core.retry import RetryPolicy
    from vllm_ascend.distributed.kv_transfer.kv_p2p.config import TLSConfig
    from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.metaserver import MetaserverClient
    from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.app import ProxyConfig, build_app

    app = build_app(ProxyConfig(prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"],
                                health_interval_s=60, mode="layerwise",
                                metaserver_url="http://127.0.0.1:1/v1/metaserver"))
    d_client = MetaserverClient(TLSConfig(), timeout_s=1, retry=RetryPolicy(attempts=1))
    headers = d_client._headers()
    d_client.close()
    assert headers["Authorization"] == "Bearer " + Authenticator(
        [KEY.encode()]).bearer_token(auth.PURPOSE_METASERVER)
    before = {r: refused("proxy-metaserver", r) for r in ("unauthenticated", "bad_token")}
    with local_test_client(app) as client:
        r = client.post("/v1/metaserver", json={"request_id": "x"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        wrong = Authenticator([b"an-outsiders-guess-at-the-key"]).bearer_token("metaserver")
        for bad in (f"Bearer {wrong}", "Basic abc", "Bearer "):
            r = client.post("/v1/metaserver", json={"request_id": "x"},
                            headers={"Authorization": bad})
            assert r.status_code == 401
        r = client.post("/v1/metaserver", json={"request_id": "x"}, headers=headers)
        assert r.status_code == 404  # through the check: no such pending request
    assert refused("proxy-metaserver", "unauthenticated") == before["unauthenticated"] + 1
    assert refused("proxy-metaserver", "bad_token") == before["bad_token"] + 3


def test_without_a_key_the_metaserver_and_its_client_are_as_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from ascend_kv_testing.serving import local_test_client
    from vllm_ascend.distributed.kv_transfer.core.retry import RetryPolicy
    from vllm_ascend.distributed.kv_transfer.kv_p2p.config import TLSConfig
    from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.metaserver import MetaserverClient
    from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.app import ProxyConfig, build_app

    monkeypatch.delenv(auth.ENV_KEY, raising=False)
    monkeypatch.delenv(auth.ENV_KEY_FILE, raising=False)
    monkeypatch.setattr(auth, "_cached", None)
    d_client = MetaserverClient(TLSConfig(), timeout_s=1, retry=RetryPolicy(attempts=1))
    assert d_client._headers() == {}
    d_client.close()
    app = build_app(ProxyConfig(prefill=["http://127.0.0.1:9"], decode=["http://127.0.0.1:9"],
                                health_interval_s=60, mode="layerwise",
                                metaserver_url="http://127.0.0.1:1/v1/metaserver"))
    with local_test_client(app) as client:
        assert client.post("/v1/metaserver", json={"request_id": "x"}).status_code == 404
