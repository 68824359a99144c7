# SPDX-License-Identifier: Apache-2.0
"""The proxy's routing policies through their one interface (``RoutingPolicy``), selected by
name: what each one picks, an unknown name, and a policy registered from outside."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from ascend_kv_testing.serving import AppThread
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy import policies
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.app import ProxyConfig, build_app
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.cli import build_parser
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.events import EventsEndpoint, EventStream
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.instances import Instance, InstanceSet
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.metrics import Metrics
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.policies import (
    KvAware,
    make_policy,
    policy_names,
    register_policy,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.prefix_index import (
    PrefixCacheHasher,
    PrefixIndex,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.router import KvAwareSettings, KvRouter
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.routing import (
    Route,
    RouteRequest,
    RoutingPolicy,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.service import Proxy

A, B, C = "http://a", "http://b", "http://c"
BS = 4
TOKENS = list(range(100, 117))  # 4 full blocks and one token


def policy(name: str) -> RoutingPolicy:
    return make_policy(ProxyConfig(prefill=[A], decode=[A], policy=name), Metrics())


def firsts(instances: InstanceSet, n: int) -> list[str]:
    return [instances.pick()[0].url for _ in range(n)]


def test_round_robin_takes_each_instance_in_turn() -> None:
    rr = InstanceSet("decode", [A, B, C], policy("round_robin"))
    assert firsts(rr, 4) == [A, B, C, A]
    rr.begin(rr.instances[1])  # load does not matter
    assert firsts(rr, 3) == [B, C, A]
    rr.mark(rr.instances[1], False)
    assert [i.url for i in rr.pick()] == [C, A, B]  # unhealthy last
    assert firsts(rr, 2) == [C, A]


def test_least_loaded_takes_the_fewest_in_flight_ties_in_turn() -> None:
    ll = InstanceSet("decode", [A, B, C], policy("least_loaded"))
    assert firsts(ll, 3) == [A, B, C]
    a, b, _ = ll.instances
    ll.begin(a)
    ll.begin(a)
    ll.begin(b)
    assert [i.url for i in ll.pick()] == [C, B, A]
    ll.end(a, ok=True)
    ll.end(a, ok=True)
    assert [i.url for i in ll.pick()] == [C, A, B]  # this turn starts at b; a and c tie


def kv_aware_holding(cached: dict[str, int]) -> KvAware:
    """kv_aware whose P instances hold the first ``cached[url]`` blocks of TOKENS."""
    router = KvRouter(KvAwareSettings())
    keys = PrefixCacheHasher().keys(TOKENS, BS)
    for url, n in cached.items():
        index = PrefixIndex(BS)
        index.store(keys[:n], "GPU", BS)
        stream = EventStream(url, EventsEndpoint("tcp://127.0.0.1:1"), index, None)
        stream.state = "live"
        router.streams[url], router.indexes[url] = stream, index
    return KvAware(router)


def test_kv_aware_routes_p_by_cached_prefix_and_d_by_load(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    kv = kv_aware_holding({A: 0, B: 3, C: 1})
    p = [Instance(u, "prefill") for u in (A, B, C)]

    async def route() -> Route:
        async with httpx.AsyncClient() as client:  # token ids: no /tokenize
            request = RouteRequest("/v1/completions", {"prompt": TOKENS}, client)
            return await kv.route(kv.order(p, 0), request)

    chosen = asyncio.run(route())
    assert [i.url for i in chosen.order] == [B, C, A] and chosen.reason == "prefix"
    p[1].in_flight = 3  # 12/17 - 0.75 < 4/17: load wins
    chosen = asyncio.run(route())
    assert chosen.order[0].url == C and chosen.reason == "load"
    assert kv.instance_status(B)["prefix_index"]["blocks"] == 3
    # D (and the order a request starts from): least loaded, ties in turn
    d = [Instance(u, "decode") for u in (A, B, C)]
    d[0].in_flight = 1
    assert [i.url for i in kv.order(d, 0)] == [B, C, A]
    assert [i.url for i in kv.order(d, 1)] == [B, C, A]
    assert [i.url for i in kv.order(d, 2)] == [C, B, A]


def test_an_unknown_policy_is_an_error_naming_the_known_ones(
        capsys: pytest.CaptureFixture[str]) -> None:
    known = "known policies: round_robin, least_loaded, kv_aware"
    with pytest.raises(ValueError, match=f"unknown routing policy 'random'; {known}"):
        policy("random")
    with pytest.raises(ValueError, match=known):
        Proxy(ProxyConfig(prefill=[A], decode=[B], policy="random"))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--prefill", A, "--decode", B, "--policy", "random"])
    assert "'round_robin', 'least_loaded', 'kv_aware'" in capsys.readouterr().err


class LastFirst(RoutingPolicy):
    """A policy from outside: the last instance first, P's routes with a reason of its own."""

    name = "last_first"

    def order(self, instances: list[Instance], turn: int) -> list[Instance]:
        return instances[::-1]

    async def route(self, order: list[Instance], request: RouteRequest) -> Route:
        return Route(order, "custom")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry restored after the test."""
    monkeypatch.setattr(policies, "POLICIES", dict(policies.POLICIES))


class StandIn:
    """A P or D that answers with its own name."""

    def __init__(self, name: str) -> None:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {}

        @app.post("/v1/completions")
        async def complete(request: Request) -> dict[str, Any]:
            await request.json()
            return {"choices": [{"text": name}],
                    "kv_transfer_params": {"remote_block_ids": [1]}}

        self.thread = AppThread(app)

    def __enter__(self) -> str:
        return self.thread.start().url

    def __exit__(self, *exc: object) -> None:
        self.thread.stop()


@pytest.fixture
def two_p_one_d() -> Iterator[tuple[list[str], str]]:
    with StandIn("p0") as p0, StandIn("p1") as p1, StandIn("d") as d:
        yield [p0, p1], d


def test_a_registered_policy_is_selectable_by_name(
        registry: None, two_p_one_d: tuple[list[str], str]) -> None:
    from ascend_kv_testing.serving import local_test_client

    assert "last_first" not in policy_names()
    register_policy(LastFirst)
    assert policy_names()[-1] == "last_first" and isinstance(policy("last_first"), LastFirst)
    with pytest.raises(ValueError, match="exists already"):
        register_policy(type("Other", (LastFirst,), {}))
    args = build_parser().parse_args(["--prefill", A, "--decode", B, "--policy", "last_first"])
    assert args.policy == "last_first"

    prefill, decode = two_p_one_d
    cfg = ProxyConfig(prefill=prefill, decode=[decode], policy="last_first",
                      health_interval_s=60, lease_renew_interval_s=0)
    with local_test_client(build_app(cfg)) as client:
        for _ in range(2):
            assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200
        served = {p["url"]: p["served"] for p in client.get("/status").json()["prefill"]}
        assert served == {prefill[0]: 0, prefill[1]: 2}  # the last P, every time
        assert client.get("/status").json()["policy"] == "last_first"
        metrics = client.get("/metrics").text
    assert ('vllm_ascend_pd_proxy_routing_decisions_total{policy="last_first",'
            'reason="custom",role="prefill"} 2.0') in metrics
