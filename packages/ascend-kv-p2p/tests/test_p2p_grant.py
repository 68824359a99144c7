# SPDX-License-Identifier: Apache-2.0
"""A keyed grant names the request's blocks, not where P's KV cache lives.

Real P and D pull workers (their side channels, the real transfer engine on loopback).
With a deployment key, P's ``GetMeta`` leaves out the region addresses and an accepted
``Claim`` is answered ``ClaimGrant``, which names the address of each claimed block in each
region (the addresses an unkeyed P's bases and strides give for those blocks), and nothing
else; D reads exactly there, claims before every read (it keeps no grant past its request),
and refuses a grant that does not match its claim: the load fails (recompute), counted, and
P's blocks are released. Without a key ``GetMeta`` and ``ClaimOK`` are those of before.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
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
from vllm_ascend.distributed.kv_transfer.kv_p2p.grants import BlockAddresser, granted_table
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
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull import holder as holder_module
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


def expected_addresses(meta: AgentMeta, block_ids: list[int]) -> list[list[int]]:
    """The addresses of ``block_ids`` in each region, from an unkeyed P's bases and strides."""
    return [[base + b * stride for b in block_ids]
            for base, stride in zip(meta.region_addrs, meta.region_strides, strict=True)]


def grant_addresses(grant: ClaimGrant, blocks: int) -> list[list[int]]:
    return granted_table(grant.block_addrs, grant.num_regions, regions=grant.num_regions,
                         blocks=blocks, who="P").tolist()


@pytest.mark.parametrize("pd", ["keyed"], indirect=True)
def test_keyed_p_grants_only_the_claimed_blocks_addresses(pd: Any) -> None:
    assert pd.p.meta is not None and pd.p.meta.region_addrs
    assert {f.name for f in msgspec.structs.fields(ClaimGrant)} == {
        "lease_s", "block_addrs", "num_regions"}  # no base, no stride on the wire
    client = RpcClient(pd.endpoint, CODEC, timeout_s=5, engine_id="P")
    try:
        public = client.call(GetMeta(requester="insider"))
        assert isinstance(public, AgentMeta)
        assert public.region_addrs == []  # the handshake still has everything it checks
        assert public.layout == pd.p.meta.layout and public.session == pd.p.meta.session
        token = auth.capability_token()
        pd.p.start_load_kv(MooncakeConnectorMetadata(
            requests_to_send={"g": SendMeta("g", [2, 4, 6], token)}))
        with pytest.raises(RemoteError) as err:  # no token, no addresses
            client.call(Claim(request_id="g", block_ids=[4, 6], reader="x"))
        assert err.value.code == "bad_token"
        grant = client.call(Claim(request_id="g", block_ids=[4, 6], reader="x", token=token))
        assert isinstance(grant, ClaimGrant)
        regions = len(pd.p.meta.region_addrs)
        assert grant.num_regions == regions and len(grant.block_addrs) == 8 * regions * 2
        assert grant_addresses(grant, 2) == expected_addresses(pd.p.meta, [4, 6])
        named = set(np.frombuffer(grant.block_addrs, dtype="<u8").tolist())
        assert not named & set(pd.p.meta.region_addrs)  # no region base (block 0) given away
        whole = client.call(Claim(request_id="g", block_ids=[2, 4, 6], reader="x",
                                  token=token))
        assert isinstance(whole, ClaimGrant)
        assert grant_addresses(whole, 3) == expected_addresses(pd.p.meta, [2, 4, 6])
    finally:
        client.close()


@pytest.mark.parametrize("overlap", [False, True], ids=["claim-first", "overlapped"])
@pytest.mark.parametrize("pd", ["keyed"], indirect=True)
def test_keyed_d_claims_then_reads_at_the_grants_addresses(pd: Any, overlap: bool) -> None:
    pd.d.overlap_claims = overlap
    reader = pd.d.reader
    events: list[Any] = []
    read, claim = reader._read, reader.peers.claim

    def read_spy(meta: Any, remotes: Any, plan: Any, grants: Any = None) -> int:
        events.append(("read", remotes[0].region_addrs, {r: g.tolist() for r, g in
                                                         (grants or {}).items()}))
        return read(meta, remotes, plan, grants)

    def claim_spy(*args: Any) -> Any:
        events.append(("claim",))
        return claim(*args)

    reader._read = read_spy
    reader.peers.claim = claim_spy
    for rid, src, dst in (("a", [3, 5], [1, 2]), ("b", [6], [4]), ("c", [7, 1], [5, 0])):
        events.clear()
        pull(pd, rid, src, dst)  # checks the bytes landed
        # every keyed load: its claim, then one read at its grant's addresses only
        assert events == [("claim",), ("read", [], {0: expected_addresses(pd.p.meta, src)})]
    # D kept nothing that says where P's cache is
    cached = pd.d.cached_peer_meta("127.0.0.1", worker_port(pd.p_port, tp_rank=0, tp_size=1))
    assert cached is not None and cached.region_addrs == []
    assert reader.peers.known_regions({0: cached}) is None


class _Short(BlockAddresser):
    """P's addresses with the last one left out."""

    def of(self, block_ids: Any, *, skip: Any = None) -> bytes:
        return super().of(block_ids, skip=skip)[:-8]


class _MoreRegions(BlockAddresser):
    """A grant that claims one region more than P has (same addresses)."""

    @property
    def num_regions(self) -> int:
        return super().num_regions + 1


@pytest.mark.parametrize("tamper", [_Short, _MoreRegions], ids=["short", "regions"])
@pytest.mark.parametrize("pd", ["keyed"], indirect=True)
def test_d_refuses_a_grant_that_does_not_match_its_claim(pd: Any, tamper: type,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr(holder_module, "BlockAddresser", tamper)
    reads: list[Any] = []
    original = pd.d.reader._read
    pd.d.reader._read = lambda *a: reads.append(a) or original(*a)
    before = pd.d.recorder.total("p2p_failures", cause="bad_grant")
    token = auth.capability_token()
    pd.p.start_load_kv(MooncakeConnectorMetadata(
        requests_to_send={"m": SendMeta("m", [3, 5], token)}))
    remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=pd.p_port, request_id="m",
                           block_ids=[3, 5], tp_size=1, pcp_size=1, dcp_size=1, token=token)
    pd.d.start_load_kv(MooncakeConnectorMetadata(requests={"d-m": RecvMeta(
        "d-m", [1, 2], remote, remote_block_ids=[3, 5])}))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        _s, recving = pd.d.get_finished()
        if recving and "d-m" in recving:
            break
        time.sleep(0.01)
    else:
        pytest.fail("the load did not end")
    assert pd.d.get_block_ids_with_load_errors() == {1, 2}  # recomputed
    assert pd.d.recorder.total("p2p_failures", cause="bad_grant") == before + 1
    assert reads == []  # nothing was read
    for value in pd.cd.values():
        assert value[[1, 2]].abs().sum() == 0
    # D released the claim: P holds nothing for the request any more
    deadline = time.monotonic() + 10
    while pd.p.holder.held.get("m") is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pd.p.holder.held.get("m") is None
    assert len(pd.d.loads) == 0


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
