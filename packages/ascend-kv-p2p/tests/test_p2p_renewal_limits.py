# SPDX-License-Identifier: Apache-2.0
"""Renewals carry the request's capability and stop at its deadline (issue 51).

Pull: P's ``Renew`` must present each request's ``remote_claim_token`` (required with a
deployment key, a wrong one refused and counted without one), and no renewal or claim
extends a request's lease past ``max_hold_s`` from when P began holding it. Layerwise: D's
``PushRenew`` must present ``remote_push_token`` the same way, and D renews no write lease
at or past the request's load deadline. So no peer, with the key or not, keeps another
request's blocks held indefinitely.
"""

from __future__ import annotations

import time
import types
from collections.abc import Iterator
from typing import Any

import pytest
from p2p_worker_harness import layout_caches, pd_vllm_config

from ascend_kv_testing.keys import set_deployment_key
from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.errors import RemoteError
from vllm_ascend.distributed.kv_transfer.core.leases import LeaseTable
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
    Claim,
    ClaimOK,
    PushBegin,
    PushGrant,
    PushRenew,
    PushRenewReply,
    Renew,
    RenewReply,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull import holder as pull_holder
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import SendMeta
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.holder import LeaseHolder
from vllm_ascend.distributed.kv_transfer.kv_p2p.renewer import LeaseRenewer

KEY = "renewal-limits-test-deployment-key-0123456789"
TOKEN, OTHER = "the-requests-own-capability-token", "another-requests-capability-token"


def refused(socket: str) -> float:
    return auth.RECORDER.total("auth_refused", socket=socket, reason="bad_token")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# ---------------------------------------------------------------- pull: P's holder
def make_holder(*, lease_ttl_s: float = 30.0, max_hold_s: float = 600.0,
                clock: Clock | None = None, engine_id: str = "") -> LeaseHolder:
    cfg = MooncakeP2PConfig.from_dict({"lease_ttl_s": lease_ttl_s, "max_hold_s": max_hold_s})
    shared: Any = types.SimpleNamespace(cfg=cfg, meta=None, host="127.0.0.1", port=0,
                                        recorder=MetricsRecorder(P2P_METRICS),
                                        engine_id=engine_id)
    holder = LeaseHolder(shared)
    if clock is not None:
        holder.held = LeaseTable(lease_ttl_s, clock=clock, name="p2p-held")
    return holder


@pytest.fixture
def no_key(monkeypatch: pytest.MonkeyPatch) -> None:
    set_deployment_key(monkeypatch, None)


@pytest.fixture
def keyed(monkeypatch: pytest.MonkeyPatch) -> None:
    set_deployment_key(monkeypatch, KEY)


@pytest.fixture
def serving(request: pytest.FixtureRequest) -> Iterator[tuple[LeaseHolder, RpcClient[Any]]]:
    """A holder serving its side channel on loopback, holding ``r`` under ``TOKEN``, and a
    client (both with the environment's key, if any)."""
    holder = make_holder(lease_ttl_s=30.0)
    holder.hold([SendMeta(request_id="r", block_ids=[1, 2], token=TOKEN)])
    holder.serve()
    assert holder.server is not None
    client = RpcClient(holder.server.endpoint, CODEC, timeout_s=5)
    yield holder, client
    client.close()
    holder.stop()


def test_keyed_renew_needs_the_requests_token(keyed: None, serving: Any) -> None:
    holder, client = serving
    name = holder.server.name
    before = refused(name)
    assert client.call(Renew(request_ids=["r"])) == RenewReply(held=[])
    assert client.call(Renew(request_ids=["r"], tokens=[OTHER])) == RenewReply(held=[])
    assert refused(name) == before + 2
    assert client.call(Renew(request_ids=["x", "r"], tokens=["", TOKEN])) == RenewReply(
        held=["r"])


def test_a_refused_renewal_does_not_extend_the_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(pull_holder.time, "monotonic", clock)
    holder = make_holder(lease_ttl_s=10.0, clock=clock)
    holder.server = types.SimpleNamespace(auth=object(), name="keyed-holder",
                                          lapse_clock=lambda grace, now: now)
    holder.hold([SendMeta(request_id="r", block_ids=[1], token=TOKEN)])
    for _ in range(3):  # an outsider renewing without the token every 5 s
        clock.now += 5.0
        assert holder.handle(Renew(request_ids=["r"], tokens=[OTHER])) == RenewReply(held=[])
    assert holder.collect_finished() == {"r"}  # lapsed 10 s after the hold


def test_unkeyed_renew_without_a_token_still_renews_a_wrong_one_not(
        no_key: None, serving: Any) -> None:
    holder, client = serving
    assert holder.server.auth is None
    assert client.call(Renew(request_ids=["r"])) == RenewReply(held=["r"])  # older peers
    before = refused(holder.server.name)
    assert client.call(Renew(request_ids=["r"], tokens=[OTHER])) == RenewReply(held=[])
    assert refused(holder.server.name) == before + 1


def test_renewals_and_claims_stop_at_max_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(pull_holder.time, "monotonic", clock)
    holder = make_holder(lease_ttl_s=10.0, max_hold_s=25.0, clock=clock)
    holder.hold([SendMeta(request_id="r", block_ids=[1, 2], token=TOKEN)])
    renew = Renew(request_ids=["r"], tokens=[TOKEN])
    for _ in range(2):
        clock.now += 8.0
        assert holder.handle(renew) == RenewReply(held=["r"])
    clock.now += 8.0  # 24 s held: the lease runs 1 s more, not 10
    assert holder.handle(renew) == RenewReply(held=["r"])
    claim = holder.handle(Claim(request_id="r", block_ids=[2], reader="d", token=TOKEN))
    assert isinstance(claim, ClaimOK) and claim.lease_s == pytest.approx(1.0)
    clock.now += 1.5  # past max_hold_s: renewed no more, a claim refused
    assert holder.handle(renew) == RenewReply(held=[])
    refusal = holder.handle(Claim(request_id="r", block_ids=[2], reader="d", token=TOKEN))
    assert refusal.code == "expired" and "max_hold_s" in refusal.message
    assert holder.collect_finished() == {"r"}
    assert holder.shared.recorder.total("p2p_expired_leases") == 1


def test_a_short_max_hold_caps_the_first_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr(pull_holder.time, "monotonic", clock)
    holder = make_holder(lease_ttl_s=30.0, max_hold_s=5.0, clock=clock)
    holder.hold([SendMeta(request_id="r", block_ids=[1], token=TOKEN)])
    clock.now += 5.0
    assert holder.collect_finished() == {"r"}


def test_the_renewer_presents_each_requests_token(keyed: None) -> None:
    """What D's scheduler and the proxy send: every tracked request with its own token, to
    the P instance the params name (its engine id: the frames are bound to it)."""
    holder = make_holder(engine_id="P")
    holder.hold([SendMeta(request_id="a", block_ids=[1], token=TOKEN),
                 SendMeta(request_id="b", block_ids=[2], token=OTHER)])
    holder.serve()
    seen: list[Renew] = []
    handle = holder.server.handler
    holder.server.handler = lambda msg: (seen.append(msg), handle(msg))[1]
    renewer = LeaseRenewer(interval_s=60.0, timeout_s=5.0)
    renewed, refusals = holder.held.stats.renewed, refused(holder.server.name)
    try:
        port = holder.server.port
        for rid, token in (("a", TOKEN), ("b", OTHER)):
            renewer.track(rid, RemotePrefill(engine_id="P", host="127.0.0.1", port=port,
                                             request_id=rid, block_ids=[1], tp_size=1,
                                             pcp_size=1, dcp_size=1, token=token))
        renewer.renew_once()
        (msg,) = [m for m in seen if isinstance(m, Renew)]
        assert dict(zip(msg.request_ids, msg.tokens, strict=True)) == {"a": TOKEN, "b": OTHER}
        assert holder.held.stats.renewed == renewed + 2  # both renewed, each by its token
        assert refused(holder.server.name) == refusals
    finally:
        renewer.stop()
        holder.stop()


# ---------------------------------------------------------------- layerwise: D's receiver
def new_d(cfg: dict[str, Any]) -> LayerwiseWorker:
    d = LayerwiseWorker(pd_vllm_config("kv_consumer", free_port(), block_size=16, heads=4,
                                       model="/models/tiny", tp_size=1),
                        MooncakeLayerwiseConfig.from_dict(cfg), "D", MetricsRecorder(P2P_METRICS),
                        tp_rank=0, pp_rank=0)
    d.register_kv_caches(layout_caches("cpu", 1, 0, fill=False, layers=2, blocks=8, heads=4,
                                       block_size=16, head_size=8))
    return d


def begin(d: LayerwiseWorker, client: RpcClient[Any], rid: str) -> None:
    d.start_load_kv(MooncakeLayerwiseConnectorMetadata(
        requests={rid: RecvReq(rid, [1, 2], 0, push_token=TOKEN)}))
    grant = client.call(PushBegin(request_id=rid, sender="p/tp0", p_rank=0, p_tp_size=1,
                                  block_ids=[1, 2],
                                  block_lens=[r.block_len for r in d.layout.regions],
                                  token=TOKEN))
    assert isinstance(grant, PushGrant)


@pytest.mark.parametrize("key", [None, KEY])
def test_push_renew_needs_the_requests_token(key: str | None,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    set_deployment_key(monkeypatch, key)
    d = new_d({"load_timeout_s": 60.0})
    client = RpcClient(tcp_endpoint("127.0.0.1", d.port), LAYERWISE_CODEC, timeout_s=5,
                       engine_id=d.engine_id)
    try:
        begin(d, client, "r")
        name = d.receiver.server.name
        before = refused(name)
        assert client.call(PushRenew(request_ids=["r"], sender="p/tp0", tokens=[OTHER])
                           ) == PushRenewReply(granted=[])
        no_token = client.call(PushRenew(request_ids=["r"], sender="p/tp0"))
        # with a key the token is required; without one an older P's renewal still counts
        assert no_token == PushRenewReply(granted=[] if key else ["r"])
        assert refused(name) == before + (2 if key else 1)
        assert client.call(PushRenew(request_ids=["r"], sender="p/tp0", tokens=[TOKEN])
                           ) == PushRenewReply(granted=["r"])
    finally:
        client.close()
        d.shutdown()


def test_push_renew_stops_at_the_load_deadline(no_key: None) -> None:
    d = new_d({"load_timeout_s": 0.6, "lease_ttl_s": 30.0})
    client = RpcClient(tcp_endpoint("127.0.0.1", d.port), LAYERWISE_CODEC, timeout_s=5,
                       engine_id=d.engine_id)
    try:
        begin(d, client, "r")
        renew = PushRenew(request_ids=["r"], sender="p/tp0", tokens=[TOKEN])
        assert client.call(renew) == PushRenewReply(granted=["r"])
        time.sleep(0.8)  # past the deadline; D's step has not run since (nothing failed yet)
        assert client.call(renew) == PushRenewReply(granted=[])
    finally:
        client.close()
        d.shutdown()


def test_claim_refusal_is_a_remote_error_for_d(monkeypatch: pytest.MonkeyPatch,
                                               no_key: None) -> None:
    """D sees a claim past max_hold_s as a refusal with its own code (its load then fails
    or is recomputed per kv_load_failure_policy)."""
    holder = make_holder(lease_ttl_s=0.2, max_hold_s=0.2)
    holder.hold([SendMeta(request_id="r", block_ids=[1], token=TOKEN)])
    holder.serve()
    client = RpcClient(holder.server.endpoint, CODEC, timeout_s=5)
    try:
        time.sleep(0.3)
        with pytest.raises(RemoteError) as err:
            client.call(Claim(request_id="r", block_ids=[1], reader="d", token=TOKEN))
        assert err.value.code == "expired"
    finally:
        client.close()
        holder.stop()


def test_the_read_window_stays_inside_the_hold_limit() -> None:
    """A lease that lapses frees the blocks at once: the read window P promises D (which D
    reads in without a claim) must end before the hold limit can end the lease."""
    cfg = MooncakeP2PConfig.from_dict({"read_window_s": 1.0, "lease_ttl_s": 30.0,
                                       "max_hold_s": 0.5})
    assert cfg.hold_window_s == 0.25
    assert MooncakeP2PConfig.from_dict({}).hold_window_s == 1.0  # the defaults: unchanged
