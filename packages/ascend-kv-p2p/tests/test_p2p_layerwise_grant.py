# SPDX-License-Identifier: Apache-2.0
"""Layerwise capabilities: a keyed D's grant names where the push's blocks are (never its
region bases), and only a push that presents the request's token (``remote_push_token``)
may write into its blocks or fail it; P refuses a grant that does not name the push's
blocks.

Real P and D layerwise workers (their real side channels, the real transfer engine on
loopback); the keyed ones read the deployment key from the environment as in production.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec
import pytest
import torch
from test_p2p_layerwise_worker import (
    BS,
    LAYERS,
    d_expect,
    expected_block,
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
from vllm_ascend.distributed.kv_transfer.kv_p2p.grants import BlockAddresser, granted_table
from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise import receiver as receiver_module
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
    PushBlocksGrant,
    PushDone,
    PushGrant,
    worker_port,
)

KEY = "deployment-key-for-the-layerwise-grant-tests"
TOKEN = "the-requests-capability-0123456789abcdef"




@pytest.fixture(params=["keyed", "unkeyed"])
def pd(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    yield from _pd(monkeypatch, request.param == "keyed")


@pytest.fixture
def keyed_pd(monkeypatch: pytest.MonkeyPatch) -> Any:
    yield from _pd(monkeypatch, True)


def _pd(monkeypatch: pytest.MonkeyPatch, keyed: bool) -> Any:
    set_deployment_key(monkeypatch, KEY if keyed else None)
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
    yield keyed, p, d, cp, d_port, client
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


def test_a_keyed_ds_grant_names_only_the_pushs_blocks(pd: Any) -> None:
    keyed, _p, d, _cp, _port, client = pd
    d_expect(d, "r", [4, 5], push_token=TOKEN)
    grant = client.call(PushBegin(request_id="r", sender="x/tp0", p_rank=0, p_tp_size=1,
                                  block_ids=[4, 5], block_lens=[r.block_len
                                                                for r in d.layout.regions],
                                  token=TOKEN))
    assert isinstance(grant, PushGrant)
    regions = d.layout.regions
    assert grant.region_addrs == [] and grant.region_strides == []  # never a region base
    if keyed:
        assert isinstance(grant, PushBlocksGrant) and grant.num_regions == len(regions)
        table = granted_table(grant.block_addrs, grant.num_regions, regions=len(regions),
                              blocks=2, who="D").tolist()
        # what the unkeyed bases and strides give for exactly the push's blocks
        assert table == [[r.base_addr + b * r.block_stride for b in (4, 5)] for r in regions]
    else:  # the message and bytes of before
        assert type(grant) is PushGrant
        assert LAYERWISE_CODEC.encode(grant) == b"VAKV\x01" + msgspec.msgpack.encode({
            "type": "PushGrant", "lease_s": grant.lease_s, "num_senders": 1,
            "staging_addrs": grant.staging_addrs, "staging_strides": grant.staging_strides,
            "region_addrs": [], "region_strides": []})
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


@pytest.mark.parametrize(("layout", "p_tp", "d_tp"), [
    ("cpu", 1, 1), ("cpu", 2, 1), ("npu", 2, 1), ("npu", 1, 2), ("mla", 2, 1)])
def test_a_keyed_push_lands_at_the_grants_addresses(layout: str, p_tp: int, d_tp: int,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """P knows nothing of a keyed D's cache but its grants (staging buffers where D's heads
    are not contiguous): every push still lands in D's blocks, and only there."""
    set_deployment_key(monkeypatch, KEY)
    p_port, d_port = free_port(), free_port()
    p_workers = [new_worker("kv_producer", p_port, p_tp, r, "P") for r in range(p_tp)]
    d_workers = [new_worker("kv_consumer", d_port, d_tp, r, "D") for r in range(d_tp)]
    caches_p = [make_caches(layout, p_tp, r, fill=True) for r in range(p_tp)]
    caches_d = [make_caches(layout, d_tp, r, fill=False) for r in range(d_tp)]
    try:
        for w, c in zip(p_workers + d_workers, caches_p + caches_d, strict=True):
            w.register_kv_caches(c)
        p_blocks, d_blocks = [7, 2, 9, 4], [1, 5, 6, 3]
        for w in d_workers:
            d_expect(w, "req-d", d_blocks, push_token=TOKEN)
        tgt = dataclasses.replace(target(d_port, "req-d", d_blocks, d_tp=d_tp), token=TOKEN)
        p_step(p_workers, caches_p, {"req-p": PushReq("req-p", tgt, [0, 1, 2, 3], p_blocks,
                                                      last=True)})
        for w in d_workers:
            assert wait_recv(w, "req-d") == set()
        for d_rank, cache in enumerate(caches_d):
            for name, value in cache.items():
                for lb, pb in zip(d_blocks, p_blocks, strict=True):
                    want = expected_block(caches_p, layout, p_tp, d_tp, d_rank, name, pb)
                    got = value if layout == "cpu" else value[0]
                    torch.testing.assert_close(got[lb], want if layout == "cpu" else want[0],
                                               rtol=0, atol=0)
                untouched = value if layout == "cpu" else value[0]
                assert untouched[0].abs().sum() == 0
        assert sum(w.recorder.total("p2p_failures") for w in p_workers) == 0
    finally:
        for w in p_workers + d_workers:
            w.shutdown()
        monkeypatch.setattr(auth, "_cached", None)


class _Short(BlockAddresser):
    """D's addresses with the last one left out."""

    def of(self, block_ids: Any, *, skip: Any = None) -> bytes:
        return super().of(block_ids, skip=skip)[:-8]


def test_p_refuses_a_grant_that_does_not_name_the_pushs_blocks(
        keyed_pd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _keyed, p, d, cp, d_port, _client = keyed_pd
    monkeypatch.setattr(receiver_module, "BlockAddresser", _Short)
    d_expect(d, "r", [1, 2], push_token=TOKEN)
    tgt = dataclasses.replace(target(d_port, "r", [1, 2]), token=TOKEN)
    p_step([p], [cp], {"r": PushReq("r", tgt, [0, 1], [7, 3], last=True)})
    assert wait_recv(d, "r") == {1, 2}  # P gave up and told D: recompute, not a hang
    assert p.recorder.total("p2p_failures", cause="bad_grant") == 1
    for i in range(LAYERS):  # nothing was written
        assert d.layout.layers[i].regions[0].tensor[[1, 2]].abs().sum() == 0
    assert "r" not in d.receiver.incoming
