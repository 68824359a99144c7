# SPDX-License-Identifier: Apache-2.0
"""The proxy keeps P's lease alive while D has the request.

D's scheduler renews only the requests it has looked at; vLLM stops looking at its
waiting queue once the batch is full, so a request queued on a busy D would lose its KV
when P's lease lapsed. The proxy, which waits on D for that request anyway, renews it
until D answers; afterwards the lease lapses as before (a dead D still costs P its
blocks for one lease only)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.app import ProxyConfig
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.service import Proxy
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import (
    MooncakeConnectorMetadata,
    SendMeta,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.worker import PullWorker

LEASE_S = 1.0


@pytest.fixture
def p_worker() -> Iterator[tuple[PullWorker, int]]:
    port = free_port()
    kvc = SimpleNamespace(kv_port=port, is_kv_producer=True, is_kv_consumer=False,
                          kv_connector_extra_config={})
    vcfg = SimpleNamespace(
        kv_transfer_config=kvc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0,
                                        pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=4),
        model_config=SimpleNamespace(model="/models/tiny", get_total_num_kv_heads=lambda: 2))
    worker = PullWorker(vcfg, MooncakeP2PConfig.from_dict({"lease_ttl_s": LEASE_S}), "P",
                        MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    worker.register_kv_caches({f"model.layers.{i}.self_attn.attn":
                               torch.zeros(8, 2, 4, 16) for i in range(2)})
    yield worker, port
    worker.shutdown()


def _freed(worker: PullWorker) -> list[str]:
    sending, _recving = worker.get_finished()
    return sorted(sending or ())


def _params(port: int, rid: str) -> dict[str, Any]:
    return {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": port,
            "remote_request_id": rid, "remote_engine_id": "P", "remote_block_ids": [1],
            "remote_tp_size": 1}


def test_the_proxy_renews_while_d_has_the_request(p_worker: tuple[PullWorker, int]) -> None:
    worker, port = p_worker
    proxy = Proxy(ProxyConfig(prefill=["http://p"], decode=["http://d"],
                              lease_renew_interval_s=0.25))
    assert proxy.leases.renewer is not None
    try:
        worker.start_load_kv(MooncakeConnectorMetadata(
            requests_to_send={"r": SendMeta("r", [1]), "unrenewed": SendMeta("unrenewed", [2])}))
        proxy.leases.renew_while_decoding("pd-1", _params(port, "r"))
        freed: list[str] = []
        end = time.monotonic() + 3 * LEASE_S
        while time.monotonic() < end:
            freed += _freed(worker)
            time.sleep(0.05)
        # the request nobody renews lapses on time; the one D still has is held
        assert freed == ["unrenewed"]
        proxy.leases.stop_renewing("pd-1")  # D answered
        end = time.monotonic() + 3 * LEASE_S
        while "r" not in freed and time.monotonic() < end:
            freed += _freed(worker)
            time.sleep(0.05)
        assert freed == ["unrenewed", "r"]
        assert worker.recorder.total("p2p_expired_leases") == 2
    finally:
        proxy.leases.renewer.stop()


@pytest.mark.parametrize("params", [
    {}, {"remote_host": "127.0.0.1"}, {"remote_host": "h", "remote_port": "x",
                                       "remote_request_id": "r"},
    {"remote_host": "h", "remote_port": 70000, "remote_request_id": "r"},
    {"remote_host": "h", "remote_port": 1, "remote_request_id": "r", "remote_tp_size": -1},
])
def test_params_that_name_no_side_channel_are_left_to_d(params: dict[str, Any]) -> None:
    proxy = Proxy(ProxyConfig(prefill=["http://p"], decode=["http://d"]))
    proxy.leases.renew_while_decoding("pd-x", params)
    assert proxy.leases.renewing == []
    proxy.leases.stop_renewing("pd-x")  # idempotent, unknown ids ignored


def test_renewals_end_with_the_proxy_timeout_and_can_be_turned_off() -> None:
    proxy = Proxy(ProxyConfig(prefill=["http://p"], decode=["http://d"], timeout_s=0.01))
    assert proxy.leases.renewer is not None
    try:
        proxy.leases.renew_while_decoding("pd-y", _params(free_port(), "r"))
        assert proxy.leases.renewing == ["pd-y"]
        time.sleep(0.05)
        proxy.leases.expire()
        assert proxy.leases.renewing == []
    finally:
        proxy.leases.renewer.stop()
    off = Proxy(ProxyConfig(prefill=["http://p"], decode=["http://d"],
                            lease_renew_interval_s=0))
    assert off.leases.renewer is None
    off.leases.renew_while_decoding("pd-z", _params(1234, "r"))
    assert off.leases.renewing == []


def test_a_slow_p_delays_no_other_p_renewal() -> None:
    """The fleet under load: renewing one P after the other, each P slow to answer (starved,
    or its side channel waiting on a claim) held back the next P's renewal by up to the
    call's timeout, and a 3 s lease lapsed. The Ps of a round are renewed side by side: a
    round takes the slowest P's time, not the sum."""
    import threading

    from vllm_ascend.distributed.kv_transfer.core.channel import RpcServer, tcp_endpoint
    from vllm_ascend.distributed.kv_transfer.kv_p2p.params import RemotePrefill
    from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import (
        CODEC,
        Renew,
        RenewReply,
        worker_port,
    )
    from vllm_ascend.distributed.kv_transfer.kv_p2p.renewer import LeaseRenewer

    names = ("slow-a", "slow-b", "fast")
    arrivals: dict[str, list[float]] = {name: [] for name in names}
    release = threading.Event()

    def side_channel(name: str) -> tuple[RpcServer[Any], int]:
        def handle(msg: Any) -> Any:
            assert isinstance(msg, Renew)
            arrivals[name].append(time.monotonic())
            if name.startswith("slow"):
                release.wait(3.0)
            return RenewReply(held=list(msg.request_ids))
        port = free_port()
        endpoint = tcp_endpoint("127.0.0.1", worker_port(port, tp_rank=0, tp_size=1))
        return RpcServer(endpoint, CODEC, handle, name=name).start(), port

    servers = {name: side_channel(name) for name in names}
    renewer = LeaseRenewer(interval_s=3600, timeout_s=1.0)  # rounds by hand
    try:
        for name, (_srv, port) in servers.items():  # the slow Ps first
            renewer.track(name, RemotePrefill(engine_id="P", host="127.0.0.1", port=port,
                                              request_id=name, block_ids=[1], tp_size=1,
                                              pcp_size=1, dcp_size=1))
        start = time.monotonic()
        renewer.renew_once()
        took = time.monotonic() - start
        assert all(arrivals[name] for name in names)
        assert arrivals["fast"][0] - start < 0.5  # not after the slow ones' timeouts
        assert 0.9 < took < 1.8  # the slowest P's timeout (1 s), not the sum (2 s)
    finally:
        release.set()
        renewer.stop()
        for srv, _port in servers.values():
            srv.stop()


def test_a_p_that_does_not_answer_delays_no_other_p_renewals() -> None:
    """The renewing thread keeps its interval for every P while another P does not answer:
    waiting for the slowest P before the next round put the call's timeout (D's scheduler:
    ``handshake_timeout_s``, 10 s by default) between the other Ps' renewals, longer than a
    short lease. The silent P gets one call at a time, never a pile."""
    import threading

    from vllm_ascend.distributed.kv_transfer.core.channel import RpcServer, tcp_endpoint
    from vllm_ascend.distributed.kv_transfer.kv_p2p.params import RemotePrefill
    from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import (
        CODEC,
        Renew,
        RenewReply,
        worker_port,
    )
    from vllm_ascend.distributed.kv_transfer.kv_p2p.renewer import LeaseRenewer

    arrivals: dict[str, list[float]] = {"silent": [], "fast": []}
    release = threading.Event()

    def side_channel(name: str) -> tuple[RpcServer[Any], int]:
        def handle(msg: Any) -> Any:
            assert isinstance(msg, Renew)
            arrivals[name].append(time.monotonic())
            if name == "silent":
                release.wait(5.0)  # answers long after the caller's timeout
            return RenewReply(held=list(msg.request_ids))
        port = free_port()
        endpoint = tcp_endpoint("127.0.0.1", worker_port(port, tp_rank=0, tp_size=1))
        return RpcServer(endpoint, CODEC, handle, name=name).start(), port

    servers = {name: side_channel(name) for name in arrivals}
    renewer = LeaseRenewer(interval_s=0.2, timeout_s=2.0)
    try:
        start = time.monotonic()
        for name, (_srv, port) in servers.items():  # the silent P first
            renewer.track(name, RemotePrefill(engine_id="P", host="127.0.0.1", port=port,
                                              request_id=name, block_ids=[1], tp_size=1,
                                              pcp_size=1, dcp_size=1))
        time.sleep(1.9)  # within the silent P's first call (2 s timeout)
        fast = [t - start for t in arrivals["fast"]]
        # a round every 0.2 s: about 9 by now; waiting for the silent P: 1 (at 0.2 s)
        assert len(fast) >= 5, fast
        assert len(arrivals["silent"]) == 1  # its call is still in flight: not doubled
    finally:
        release.set()
        renewer.stop()
        for srv, _port in servers.values():
            srv.stop()


def test_a_layerwise_d_rank_that_does_not_answer_delays_no_other_d_renewals() -> None:
    """The layerwise P renews its write leases on D's ranks side by side: one after the
    other, a D rank that did not answer put its call's timeout between the other D ranks'
    renewals, past a short lease, and their writes stopped. The silent D rank gets one call
    at a time, never a pile."""
    import threading

    from vllm_ascend.distributed.kv_transfer.core.channel import (
        RpcClient,
        RpcServer,
        tcp_endpoint,
    )
    from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
    from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeLayerwiseConfig
    from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.links import (
        PushLink,
        PushLinks,
        PushSession,
    )
    from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
    from vllm_ascend.distributed.kv_transfer.kv_p2p.params import PushTarget
    from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import (
        LAYERWISE_CODEC,
        PushRenew,
        PushRenewReply,
    )

    arrivals: dict[str, list[float]] = {"silent": [], "fast": []}
    release = threading.Event()

    def side_channel(name: str) -> tuple[RpcServer[Any], int]:
        def handle(msg: Any) -> Any:
            assert isinstance(msg, PushRenew) and msg.sender == "p/tp0"
            arrivals[name].append(time.monotonic())
            if name == "silent":
                release.wait(5.0)  # answers long after the caller's timeout
            return PushRenewReply(granted=list(msg.request_ids))
        port = free_port()
        return RpcServer(tcp_endpoint("127.0.0.1", port), LAYERWISE_CODEC, handle,
                         name=name).start(), port

    servers = {name: side_channel(name) for name in arrivals}
    clients: dict[int, RpcClient[Any]] = {}

    def client(host: str, port: int, engine_id: str = "") -> RpcClient[Any]:
        return clients.setdefault(port, RpcClient(tcp_endpoint(host, port), LAYERWISE_CODEC,
                                                  timeout_s=2.0))

    cfg = MooncakeLayerwiseConfig(lease_ttl_s=0.6)
    shared = SimpleNamespace(cfg=cfg, recorder=MetricsRecorder(P2P_METRICS), client=client,
                             agent_id="p/tp0", te=None)
    revoked: list[str] = []
    links = PushLinks(shared, lambda s, link: revoked.append(s.request_id))  # type: ignore[arg-type]
    for name, (_srv, port) in servers.items():  # the silent D first
        target = PushTarget(engine_id="D", host="127.0.0.1", port=port, request_id=name,
                            block_ids=[1], cached_tokens=0, tp_size=1)
        link = PushLink(0, port, [], state="granted", lease_s=0.6)
        links.sessions[name] = PushSession(name, target, [link], 0)
    links.start()  # a round every 0.2 s
    try:
        start = time.monotonic()
        time.sleep(1.9)  # within the silent D's first call (2 s timeout)
        fast = [t - start for t in arrivals["fast"]]
        # a round every 0.2 s: about 9 by now; one after the other: 1 (at 0.2 s)
        assert len(fast) >= 5, fast
        assert len(arrivals["silent"]) == 1  # its call is still in flight: not doubled
        assert links.sessions["fast"].links[0].valid_until > 0
        assert revoked == []
    finally:
        release.set()
        links.stop()
        for c in clients.values():
            c.close()
        for srv, _port in servers.values():
            srv.stop()
