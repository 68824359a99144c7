# SPDX-License-Identifier: Apache-2.0
"""The proxy with ``--policy kv_aware`` against stand-in P instances that publish real vLLM
KV events (``ZmqEventPublisher``) for what they cache, in pull and layerwise mode; its
``/status``, ``/metrics``, ``/admin/instances`` and command line."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from ascend_kv_testing.requires import require
from ascend_kv_testing.serving import AppThread
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.app import ProxyConfig, build_app
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.cli import build_parser, kv_settings, main
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.events import EventsEndpoint
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.prefix_index import PrefixCacheHasher
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.router import KvAwareSettings

kv_events = require("vllm.distributed.kv_events")
BS = 4


@pytest.fixture(autouse=True)
def _no_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of sample ``name`` with ``labels`` in a /metrics page."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                return float(sample.value)
    return None


class StubP:
    """A stand-in prefill ``vllm serve``: tokenizes "1 2 3" as [1, 2, 3], caches each
    prompt's full blocks, publishes them as vLLM does and reports its cache hit."""

    def __init__(self, pushed: dict[str, threading.Event] | None = None) -> None:
        self.hasher = PrefixCacheHasher()
        self.cache: set[bytes] = set()
        self.served: list[list[int]] = []
        self.pushed = pushed
        self.events_port, self.replay_port = free_port(), free_port()
        self.pub = kv_events.ZmqEventPublisher(
            0, endpoint=f"tcp://*:{self.events_port}",
            replay_endpoint=f"tcp://*:{self.replay_port}")
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"ok": "yes"}

        @app.post("/tokenize")
        async def tokenize(request: Request) -> dict[str, Any]:
            body = await request.json()
            text = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
            return {"tokens": [int(t) for t in text.split()]}

        async def complete(request: Request) -> dict[str, Any]:
            body = await request.json()
            prompt = body.get("prompt") or " ".join(m["content"] for m in body["messages"])
            tokens = [int(t) for t in prompt.split()]
            self.served.append(tokens)
            hit = self.prefill(tokens)
            kv = body.get("kv_transfer_params") or {}
            if self.pushed is not None and "request_id" in kv:
                self.pushed.setdefault(kv["request_id"], threading.Event()).set()
            return {"choices": [{"text": "p"}],
                    "usage": {"prompt_tokens": len(tokens),
                              "prompt_tokens_details": {"cached_tokens": hit}},
                    "kv_transfer_params": {"do_remote_prefill": True}}

        app.post("/v1/completions")(complete)
        app.post("/v1/chat/completions")(complete)
        self.app = AppThread(app).start()
        self.port = self.app.port

    def prefill(self, tokens: list[int]) -> int:
        """Cache ``tokens``' full blocks; the hit vLLM would report."""
        hashes: list[bytes] = []
        parent: bytes | None = None
        for i in range(len(tokens) // BS):
            parent = self.hasher.hash_block(parent, tokens[i * BS:(i + 1) * BS])
            hashes.append(parent)
        hit = 0
        for h in hashes[:(len(tokens) - 1) // BS]:
            if h not in self.cache:
                break
            hit += BS
        new = [i for i, h in enumerate(hashes) if h not in self.cache]
        if new:
            first = new[0]
            self.pub.publish(kv_events.KVEventBatch(ts=time.time(), events=[
                kv_events.BlockStored(block_hashes=hashes[first:],
                                      parent_block_hash=hashes[first - 1] if first else None,
                                      token_ids=tokens[first * BS:len(hashes) * BS],
                                      block_size=BS, lora_id=None, medium="GPU",
                                      lora_name=None)]))
            self.cache.update(hashes)
        return hit

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> EventsEndpoint:
        return EventsEndpoint(f"tcp://127.0.0.1:{self.events_port}",
                              f"tcp://127.0.0.1:{self.replay_port}")

    def close(self) -> None:
        self.app.stop()
        self.pub.shutdown()


class StubD:
    """A stand-in decode instance (pull: answers; layerwise: posts to the metaserver and
    answers once a P served the request)."""

    def __init__(self, pushed: dict[str, threading.Event]) -> None:
        app = FastAPI()

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"ok": "yes"}

        async def complete(request: Request) -> dict[str, Any]:
            body = await request.json()
            kv = body.get("kv_transfer_params") or {}
            if "metaserver" in kv:
                rid = kv["request_id"]
                async with httpx.AsyncClient() as client:
                    r = await client.post(kv["metaserver"], json={"request_id": rid})
                    assert r.status_code == 200, r.text
                event = pushed.setdefault(rid, threading.Event())
                while not event.is_set():
                    await asyncio.sleep(0.01)
            return {"choices": [{"text": "decoded"}]}

        app.post("/v1/completions")(complete)
        app.post("/v1/chat/completions")(complete)
        self.app = AppThread(app).start()
        self.port = self.app.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self.app.stop()


@pytest.fixture
def cluster() -> Iterator[tuple[list[StubP], StubD]]:
    pushed: dict[str, threading.Event] = {}
    ps = [StubP(pushed), StubP(pushed)]
    d = StubD(pushed)
    yield ps, d
    for p in ps:
        p.close()
    d.close()


def start_proxy(ps: list[StubP], d: StubD, mode: str, **kw: Any) -> tuple[Any, Any]:
    """A real proxy server (layerwise D must reach its metaserver over HTTP)."""
    port = free_port()
    cfg = ProxyConfig(prefill=[p.url for p in ps], decode=[d.url], policy="kv_aware",
                      health_interval_s=60, mode=mode, timeout_s=30,
                      metaserver_url=(f"http://127.0.0.1:{port}/v1/metaserver"
                                      if mode == "layerwise" else None),
                      kv=KvAwareSettings(events={p.url: p.events for p in ps}), **kw)
    app = AppThread(build_app(cfg), port=port).start()
    return app.server, httpx.Client(base_url=app.url, timeout=30)


def prompt(*tokens: int) -> str:
    return " ".join(str(t) for t in tokens)


SHARED = list(range(1000, 1032))  # 8 blocks


@pytest.mark.parametrize("mode", ["pull", "layerwise"])
def test_shared_prefix_lands_on_the_instance_that_cached_it(
        cluster: tuple[list[StubP], StubD], mode: str) -> None:
    ps, d = cluster
    server, client = start_proxy(ps, d, mode)
    try:
        def prefill_states() -> list[str]:
            return [p["events"]["state"] for p in client.get("/status").json()["prefill"]]

        assert wait_for(lambda: prefill_states() == ["live", "live"], 30)
        r = client.post("/v1/completions", json={"prompt": prompt(*SHARED, 1), "max_tokens": 3})
        assert r.status_code == 200, r.text
        owner = 0 if ps[0].served else 1
        status = client.get("/status").json()["prefill"]
        assert wait_for(lambda: client.get("/status").json()["prefill"][owner]
                        ["prefix_index"]["blocks"] == 8, 30)
        # requests sharing the prefix go to its owner, though the other P is idle
        for i in range(4):
            r = client.post("/v1/completions", json={"prompt": prompt(*SHARED, 2 + i, 7, 7, 7)})
            assert r.status_code == 200
        assert len(ps[owner].served) == 5 and not ps[1 - owner].served
        r = client.post("/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": prompt(*SHARED[:12])}]})
        assert r.status_code == 200 and len(ps[owner].served) == 6
        for tokens in ([5, 6, 7, 8, 9], [9, 8, 7, 6, 5]):  # no hit: the rotation decides
            assert client.post("/v1/completions", json={"prompt": prompt(*tokens)}
                               ).status_code == 200
        assert len(ps[1 - owner].served) == 1
        status = client.get("/status").json()
        assert status["policy"] == "kv_aware"
        p_owner = status["prefill"][owner]
        assert p_owner["healthy"] and p_owner["in_flight"] == 0
        assert p_owner["events"]["usable"] and p_owner["prefix_index"]["aligned"]
        assert p_owner["prefix_index"]["hash_verified"] >= 1
        metrics = client.get("/metrics").text
        decisions = "vllm_ascend_pd_proxy_routing_decisions_total"
        assert metric(metrics, decisions, policy="kv_aware", reason="prefix") == 5
        # the first: no instance had published a block yet (its block size is unknown)
        assert metric(metrics, decisions, policy="kv_aware", reason="no_index") == 1
        assert metric(metrics, decisions, policy="kv_aware", reason="no_hit") == 2
        assert metric(metrics, "vllm_ascend_pd_proxy_hit_predictions_total",
                      outcome="exact") == 8
        assert metric(metrics, "vllm_ascend_pd_proxy_predicted_hit_tokens_total",
                      instance=ps[owner].url) == 4 * 32 + 8
        assert metric(metrics, "vllm_ascend_pd_proxy_prefix_index_blocks",
                      instance=ps[owner].url) == 8 + 4 + 1  # one no-hit prompt came too
        assert metric(metrics, "vllm_ascend_pd_proxy_kv_events_live",
                      instance=ps[owner].url) == 1
    finally:
        client.close()
        server.should_exit = True


def test_instances_added_and_removed_under_load(cluster: tuple[list[StubP], StubD]) -> None:
    from ascend_kv_testing.serving import local_test_client

    ps, d = cluster
    cfg = ProxyConfig(prefill=[ps[0].url], decode=[d.url], policy="kv_aware",
                      health_interval_s=60, kv=KvAwareSettings(events={ps[0].url: ps[0].events}))
    with local_test_client(build_app(cfg)) as client:
        stop = threading.Event()
        codes: list[int] = []

        def load() -> None:
            while not stop.is_set():
                codes.append(client.post("/v1/completions",
                                         json={"prompt": prompt(*SHARED)}).status_code)

        with ThreadPoolExecutor(4) as pool:
            for _ in range(4):
                pool.submit(load)
            try:
                change_instances_while_loaded(client, ps, d)
            finally:
                stop.set()
        assert codes and set(codes) == {200}
        assert client.delete("/admin/instances", params={
            "role": "prefill", "url": ps[0].url}).status_code == 409  # the last one
        assert client.delete("/admin/instances", params={
            "role": "prefill", "url": "http://nowhere:1"}).status_code == 404
        assert client.post("/admin/instances", json={"role": "x", "url": "http://a:1"}
                           ).status_code == 400
        listed = client.get("/admin/instances").json()
        assert [p["url"] for p in listed["prefill"]] == [ps[0].url]
        metrics = client.get("/metrics").text
        assert metric(metrics, "vllm_ascend_pd_proxy_admin_changes_total", role="prefill",
                      action="add") == 3


def change_instances_while_loaded(client: Any, ps: list[StubP], d: StubD) -> None:
    for _ in range(3):
        r = client.post("/admin/instances", json={
            "role": "prefill", "url": ps[1].url,
            "events": f"{ps[1].events.endpoint},{ps[1].events.replay}"})
        assert r.status_code == 201, r.text
        assert client.post("/admin/instances", json={
            "role": "prefill", "url": ps[1].url}).status_code == 409
        time.sleep(0.2)
        r = client.delete("/admin/instances", params={"role": "prefill", "url": ps[1].url})
        assert r.status_code == 200, r.text
        time.sleep(0.1)
    r = client.post("/admin/instances", json={"role": "decode", "url": d.url + "/"})
    assert r.status_code == 409  # the same instance


def test_admin_wants_the_bearer_token_with_a_key(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    from ascend_kv_testing.serving import local_test_client
    from vllm_ascend.distributed.kv_transfer.core import auth

    monkeypatch.setenv(auth.ENV_KEY, "k" * 64)
    assert main(["--print-admin-token"]) == 0
    token = capsys.readouterr().out.strip()
    cfg = ProxyConfig(prefill=["http://127.0.0.1:1"], decode=["http://127.0.0.1:2"],
                      health_interval_s=60)
    with local_test_client(build_app(cfg)) as client:
        body = {"role": "decode", "url": "http://127.0.0.1:3"}
        assert client.post("/admin/instances", json=body).status_code == 401
        assert client.post("/admin/instances", json=body,
                           headers={"Authorization": "Bearer nope"}).status_code == 401
        metaserver = auth.from_env().bearer_token(auth.PURPOSE_METASERVER)  # type: ignore
        assert client.post("/admin/instances", json=body,
                           headers={"Authorization": f"Bearer {metaserver}"}).status_code == 401
        r = client.post("/admin/instances", json=body,
                        headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 201 and r.json()["url"] == "http://127.0.0.1:3"


def test_admin_without_a_key_answers_loopback_only() -> None:
    from ascend_kv_testing.serving import local_test_client

    cfg = ProxyConfig(prefill=["http://127.0.0.1:1"], decode=["http://127.0.0.1:2"],
                      health_interval_s=60)
    with local_test_client(build_app(cfg), client=("10.1.2.3", 5000)) as client:
        assert client.get("/admin/instances").status_code == 403


def test_command_line_of_kv_aware() -> None:
    parser = build_parser()
    args = parser.parse_args(["--prefill", "h1:8100", "--prefill", "h2:8100", "--decode",
                              "h3:8200", "--policy", "kv_aware", "--prefill-events",
                              "tcp://h1:5557,tcp://h1:5558", "--prefill-events", "-",
                              "--kv-block-size", "128", "--kv-load-weight", "0.5"])
    kv = kv_settings(parser, args)
    assert kv.events == {"http://h1:8100": EventsEndpoint("tcp://h1:5557", "tcp://h1:5558")}
    assert kv.block_size == 128 and kv.load_weight == 0.5 and kv.hash_algo == "sha256"
    for bad in (["--prefill-events", "h1:5557"], ["--prefill-events", "tcp://a:1",
                                                  "--prefill-events", "tcp://b:1"]):
        with pytest.raises(SystemExit):
            kv_settings(parser, parser.parse_args(["--prefill", "a", "--decode", "b", *bad]))
    with pytest.raises(SystemExit):
        main(["--decode", "b"])  # --prefill is still required
    with pytest.raises(SystemExit):
        main(["--prefill", "a", "--decode", "b", "--prefill-events", "tcp://a:1"])
