# SPDX-License-Identifier: Apache-2.0
"""The regions a D needs travel with a request's grant, not to whoever asks.

Real P and D pull workers (their side channels, the real transfer engine on loopback).
With a deployment key, P's ``GetMeta`` leaves out the region addresses and an accepted
``Claim`` is answered ``ClaimGrant`` carrying them; D reads with them, claims before its
first read of a P rank, and later overlaps its claims with the read under the regions of
the last grant (reading again when the new grant moved them). Without a key ``GetMeta`` and
``ClaimOK`` are those of before.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
from p2p_worker_harness import numbered_caches, pd_vllm_config

from ascend_kv_testing.keys import set_deployment_key
from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.errors import RemoteError
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.params import RemotePrefill
from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import (
    CODEC,
    AgentMeta,
    Claim,
    ClaimGrant,
    ClaimOK,
    GetMeta,
    worker_port,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import (
    MooncakeConnectorMetadata,
    RecvMeta,
    SendMeta,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.worker import PullWorker

KEY = "deployment-key-for-the-grant-tests-0123"
BS, NB, HEADS, HD, LAYERS = 16, 8, 2, 8, 2


def vllm_config(role: str, kv_port: int) -> Any:
    return pd_vllm_config(role, kv_port, block_size=BS, heads=HEADS)


def caches(fill: bool) -> dict[str, Any]:
    return numbered_caches(fill, layers=LAYERS, blocks=NB, heads=HEADS, block_size=BS,
                           head_size=HD)




@pytest.fixture
def pd(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A P and a D pull worker, keyed or not (``request.param``)."""
    set_deployment_key(monkeypatch, KEY if request.param == "keyed" else None)
    p_port, d_port = free_port(), free_port()
    p = PullWorker(vllm_config("kv_producer", p_port),
                   MooncakeP2PConfig.from_dict({"lease_ttl_s": 30.0}), "P",
                   MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    d = PullWorker(vllm_config("kv_consumer", d_port),
                   MooncakeP2PConfig.from_dict({"load_timeout_s": 10.0}), "D",
                   MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    cp, cd = caches(True), caches(False)
    p.register_kv_caches(cp)
    d.register_kv_caches(cd)
    endpoint = tcp_endpoint("127.0.0.1", worker_port(p_port, tp_rank=0, tp_size=1))
    try:
        yield SimpleNamespace(p=p, d=d, cp=cp, cd=cd, p_port=p_port, endpoint=endpoint)
    finally:
        p.shutdown()
        d.shutdown()
        monkeypatch.setattr(auth, "_cached", None)


def pull(pd: Any, rid: str, src: list[int], dst: list[int]) -> None:
    """P holds ``src`` for ``rid``; D pulls them into ``dst``; checks the bytes."""
    token = auth.capability_token()
    pd.p.start_load_kv(MooncakeConnectorMetadata(
        requests_to_send={rid: SendMeta(rid, src, token)}))
    remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=pd.p_port, request_id=rid,
                           block_ids=src, tp_size=1, pcp_size=1, dcp_size=1, token=token)
    pd.d.start_load_kv(MooncakeConnectorMetadata(requests={f"d-{rid}": RecvMeta(
        f"d-{rid}", dst, remote, remote_block_ids=src)}))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        _s, recving = pd.d.get_finished()
        if recving and f"d-{rid}" in recving:
            break
        time.sleep(0.01)
    else:
        pytest.fail(f"the load of {rid} did not finish")
    assert pd.d.get_block_ids_with_load_errors() == set()
    for name, value in pd.cd.items():
        torch.testing.assert_close(value[dst], pd.cp[name][src], rtol=0, atol=0)


@pytest.mark.parametrize("pd", ["keyed"], indirect=True)
def test_keyed_p_gives_its_regions_only_with_a_claims_grant(pd: Any) -> None:
    assert pd.p.meta is not None and pd.p.meta.region_addrs
    client = RpcClient(pd.endpoint, CODEC, timeout_s=5, engine_id="P")
    try:
        public = client.call(GetMeta(requester="insider"))
        assert isinstance(public, AgentMeta)
        assert public.region_addrs == []  # the handshake still has everything it checks
        assert public.layout == pd.p.meta.layout and public.session == pd.p.meta.session
        token = auth.capability_token()
        pd.p.start_load_kv(MooncakeConnectorMetadata(
            requests_to_send={"g": SendMeta("g", [2, 4], token)}))
        with pytest.raises(RemoteError) as err:  # no token, no regions
            client.call(Claim(request_id="g", block_ids=[2, 4], reader="x"))
        assert err.value.code == "bad_token"
        grant = client.call(Claim(request_id="g", block_ids=[2, 4], reader="x", token=token))
        assert isinstance(grant, ClaimGrant)
        assert grant.region_addrs == pd.p.meta.region_addrs
        assert grant.region_strides == pd.p.meta.region_strides
    finally:
        client.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["claim-first", "overlapped"])
@pytest.mark.parametrize("pd", ["keyed"], indirect=True)
def test_keyed_d_reads_with_the_grants_regions(pd: Any, overlap: bool) -> None:
    pd.d.overlap_claims = overlap
    reader = pd.d.reader
    reads: list[list[int]] = []
    original = reader._read

    def spy(meta: Any, remotes: Any, plan: Any) -> int:
        reads.append(list(remotes[0].region_addrs))
        return original(meta, remotes, plan)

    reader._read = spy
    pull(pd, "a", [3, 5], [1, 2])  # first request: claims, then reads with the grant
    assert reads == [pd.p.meta.region_addrs]
    (granted,) = reader.peers._granted.values()
    assert granted.region_addrs == pd.p.meta.region_addrs
    pull(pd, "b", [6], [4])  # later: the last grant's regions (overlapped: before the claim)
    assert reads[1:] == [pd.p.meta.region_addrs]
    if overlap:
        # a grant that moves the regions (say P restarted) makes D read again with the new
        reader.peers._granted = {k: _moved_meta(v) for k, v in reader.peers._granted.items()}
        pull(pd, "c", [7], [5])
        assert len(reads) == 4 and reads[3] == pd.p.meta.region_addrs
        assert reads[2] != pd.p.meta.region_addrs


def _moved_meta(meta: AgentMeta) -> AgentMeta:
    return msgspec.structs.replace(meta, region_addrs=[a + (1 << 40) for a in
                                                       meta.region_addrs])


@pytest.mark.parametrize("pd", ["unkeyed"], indirect=True)
def test_without_a_key_getmeta_and_the_claim_reply_are_as_before(pd: Any) -> None:
    client = RpcClient(pd.endpoint, CODEC, timeout_s=5, auth=None)
    try:
        assert client.call(GetMeta(requester="d")) == pd.p.meta  # regions and all
        pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"u": SendMeta("u", [1])}))
        reply = client.call(Claim(request_id="u", block_ids=[1], reader="d"))
        assert type(reply) is ClaimOK
        # the same bytes on the wire as before the grant existed
        assert CODEC.encode(reply) == b"VAKV\x01" + msgspec.msgpack.encode(
            {"type": "ClaimOK", "lease_s": reply.lease_s})
    finally:
        client.close()
    pull(pd, "v", [2, 3], [6, 7])
    assert pd.d.reader.peers._granted == {}
