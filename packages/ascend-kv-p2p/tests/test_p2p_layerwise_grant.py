# SPDX-License-Identifier: Apache-2.0
"""Layerwise capabilities: D's regions travel with a request's grant, and only a push that
presents the request's token (``remote_push_token``) may write into its blocks or fail it.

Real P and D layerwise workers (their real side channels, the real transfer engine on
loopback); the keyed ones read the deployment key from the environment as in production.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from test_p2p_layerwise_worker import (
    BS,
    LAYERS,
    d_expect,
    layer_name,
    make_caches,
    new_worker,
    p_step,
    target,
    wait_recv,
)

from ascend_kv_testing.keys import set_deployment_key
from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.errors import RemoteError
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.errors import KVParamsError
from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.contract import PushReq
from vllm_ascend.distributed.kv_transfer.kv_p2p.params import (
    params_for_prefill,
    parse_push_target,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import (
    LAYERWISE_CODEC,
    AgentMeta,
    GetMeta,
    PushBegin,
    PushDone,
    PushGrant,
    worker_port,
)

KEY = "deployment-key-for-the-layerwise-grant-tests"
TOKEN = "the-requests-capability-0123456789abcdef"




@pytest.fixture(params=["keyed", "unkeyed"])
def pd(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    set_deployment_key(monkeypatch, KEY if request.param == "keyed" else None)
    p_port, d_port = free_port(), free_port()
    p = new_worker("kv_producer", p_port, 1, 0, "P", {"lease_ttl_s": 2.5,
                                                       "handshake_timeout_s": 2.0,
                                                       "push_retry": {"deadline_s": 0.5}})
    d = new_worker("kv_consumer", d_port, 1, 0, "D", {"load_timeout_s": 5.0,
                                                       "lease_ttl_s": 2.5})
    cp = make_caches("cpu", 1, 0, fill=True)
    p.register_kv_caches(cp)
    d.register_kv_caches(make_caches("cpu", 1, 0, fill=False))
    client = RpcClient(tcp_endpoint("127.0.0.1", worker_port(d_port, tp_rank=0, tp_size=1)),
                       LAYERWISE_CODEC, timeout_s=5, engine_id="D")  # D's engine, as P seals
    yield request.param == "keyed", p, d, cp, d_port, client
    client.close()
    p.shutdown()
    d.shutdown()
    monkeypatch.setattr(auth, "_cached", None)


def bad_tokens(d: Any) -> float:
    assert d.receiver is not None and d.receiver.server is not None
    return auth.RECORDER.total("auth_refused", socket=d.receiver.server.name, reason="bad_token")


def test_only_the_requests_token_opens_a_push(pd: Any) -> None:
    keyed, p, d, cp, d_port, client = pd
    d_expect(d, "r", [1, 2], push_token=TOKEN)
    meta = client.call(GetMeta(requester="p"))
    assert isinstance(meta, AgentMeta)
    # a keyed D tells no one where its cache lives; the grant does
    assert (meta.region_addrs == []) is keyed
    lens = [r.block_len for r in d.layout.regions]
    before = bad_tokens(d)
    for wrong in ("", "not-the-token") if keyed else ("not-the-token",):
        with pytest.raises(RemoteError) as err:
            client.call(PushBegin(request_id="r", sender="x/tp0", p_rank=0, p_tp_size=1,
                                  block_ids=[1, 2], block_lens=lens, token=wrong))
        assert err.value.code == "bad_token"
        with pytest.raises(RemoteError) as err:  # nor may it fail the request
            client.call(PushDone(request_id="r", sender="x/tp0", success=False,
                                 reason="outsider", token=wrong))
        assert err.value.code == "bad_token"
    assert bad_tokens(d) == before + (4 if keyed else 2)
    inc = d.receiver.incoming["r"]
    assert inc.senders == {} and inc.failure is None  # nothing granted, nothing failed
    # P with the token pushes, and the bytes land where D's grant said
    tgt = dataclasses.replace(target(d_port, "r", [1, 2]), token=TOKEN)
    p_step([p], [cp], {"r": PushReq("r", tgt, [0, 1], [7, 3], last=True)})
    assert wait_recv(d, "r") == set()
    for i in range(LAYERS):
        cache = d.layout.layers[i].regions[0].tensor
        torch.testing.assert_close(cache[1], cp[layer_name(i)][7], rtol=0, atol=0)
        torch.testing.assert_close(cache[2], cp[layer_name(i)][3], rtol=0, atol=0)


def test_the_grant_carries_the_regions_only_from_a_keyed_d(pd: Any) -> None:
    keyed, _p, d, _cp, _port, client = pd
    d_expect(d, "r", [4, 5], push_token=TOKEN)
    grant = client.call(PushBegin(request_id="r", sender="x/tp0", p_rank=0, p_tp_size=1,
                                  block_ids=[4, 5], block_lens=[r.block_len
                                                                for r in d.layout.regions],
                                  token=TOKEN))
    assert isinstance(grant, PushGrant)
    regions = d.layout.regions
    if keyed:
        assert grant.region_addrs == [r.base_addr for r in regions]
        assert grant.region_strides == [r.block_stride for r in regions]
    else:
        assert grant.region_addrs == [] and grant.region_strides == []
    client.call(PushDone(request_id="r", sender="x/tp0", success=False, reason="test",
                         token=TOKEN, settled=True))  # (no write: nothing for D to fence)
    assert wait_recv(d, "r") == {4, 5}


def test_a_keyed_d_refuses_a_tokenless_p_but_an_unkeyed_one_serves_it(pd: Any) -> None:
    """An older P (no token) still pushes to an unkeyed D; with a key it is refused."""
    keyed, p, d, cp, d_port, _client = pd
    d_expect(d, "r", [1, 2], push_token=TOKEN)
    p_step([p], [cp], {"r": PushReq("r", target(d_port, "r", [1, 2]), [0, 1], [7, 3],
                                    last=True)})
    failed = wait_recv(d, "r")
    if keyed:
        assert failed == {1, 2}  # P was refused, told D it gave up: recompute, not a hang
    else:
        assert failed == set()
        torch.testing.assert_close(d.layout.layers[0].regions[0].tensor[1],
                                   cp[layer_name(0)][7], rtol=0, atol=0)


def test_the_push_token_travels_in_the_posted_params() -> None:
    kw: dict[str, Any] = {"proxy_request_id": "x", "block_ids": [4, 9], "block_size": BS,
                          "engine_id": "d0", "host": "127.0.0.1", "port": 20000,
                          "request_id": "q", "tp_size": 1, "cached_tokens": 0}
    token = auth.capability_token()
    params = params_for_prefill(**kw, push_token=token)
    assert parse_push_target(params, prompt_len=20, block_size=BS).token == token
    old = params_for_prefill(**kw)  # an older D: the params of before
    assert "remote_push_token" not in old
    assert parse_push_target(old, prompt_len=20, block_size=BS).token == ""
    with pytest.raises(KVParamsError, match="remote_push_token"):
        parse_push_target({**params, "remote_push_token": ["x"]}, prompt_len=20, block_size=BS)
