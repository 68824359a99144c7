# SPDX-License-Identifier: Apache-2.0
"""``bench fleet``'s simulated instances and driver, small: the KV events decode with vLLM's
own classes (and replay), the prefix cache's hits and bounds, a short trace through the
client-side baseline, and churn behind our proxy (an instance added, one drained, one
killed: no request lost), and the rounds it writes into the ledger."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from vllm_ascend.distributed.kv_transfer.bench.fleet import costfit
from vllm_ascend.distributed.kv_transfer.bench.fleet.command import (
    ledger_series,
    trace_prompts,
    turns,
)
from vllm_ascend.distributed.kv_transfer.bench.fleet.events import Publisher
from vllm_ascend.distributed.kv_transfer.bench.fleet.fleet import Fleet
from vllm_ascend.distributed.kv_transfer.bench.fleet.http import Client
from vllm_ascend.distributed.kv_transfer.bench.fleet.instance import (
    BlockHashes,
    PrefixCache,
    SimInstance,
)
from vllm_ascend.distributed.kv_transfer.bench.fleet.load import (
    Churn,
    churn_figures,
    drive,
    summarize,
)
from vllm_ascend.distributed.kv_transfer.bench.fleet.model import CostModel
from vllm_ascend.distributed.kv_transfer.bench.fleet.routers import Router
from vllm_ascend.distributed.kv_transfer.bench.router import best_achievable

COST = CostModel.load(scale=0.002)


def _client(url: str) -> Client:
    host, port = url.split("//", 1)[1].split(":")
    return Client(host, int(port), size=4)


async def _complete(url: str, prompt: list[int], **extra: Any) -> dict[str, Any]:
    c = _client(url)
    try:
        status, body = await c.request("POST", "/v1/completions",
                                       {"model": "tiny", "prompt": prompt, "max_tokens": 4,
                                        **extra})
    finally:
        await c.close()
    assert status == 200, body
    return dict(json.loads(body))


def test_cost_model_fit_recovers_a_quadratic() -> None:
    xs = [16, 128, 512, 1024]
    samples = {"prefill_s": {str(x): [0.02 + 5e-4 * x + 4e-7 * x * x] * 3 for x in xs},
               "decode_s_per_token": [0.014, 0.015, 0.013]}
    fit = costfit.fit(samples)
    assert fit["prefill_base_s"] == pytest.approx(0.02, rel=1e-3)
    assert fit["prefill_s_per_token"] == pytest.approx(5e-4, rel=1e-3)
    assert fit["prefill_s_per_token2"] == pytest.approx(4e-7, rel=1e-3)
    assert fit["decode_s_per_token"] == 0.014
    committed = CostModel.load()
    assert 0 < committed.prefill_s(16) < committed.prefill_s(1024)


def test_prefix_cache_is_bounded_lru() -> None:
    cache = PrefixCache(3)
    assert cache.store([1, 2]) == ([1, 2], [])
    assert cache.match([1, 2, 9]) == 2
    new, evicted = cache.store([5, 6])
    assert (new, evicted) == ([5, 6], [1]) and len(cache) == 3
    assert cache.match([1, 2]) == 0  # a run leads from the prompt's first block
    assert cache.match([2, 5, 6, 7]) == 3


def test_events_decode_with_vllms_classes_and_replay() -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.prefix_index import PrefixCacheHasher

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        pub = Publisher(ctx)
        inst = await SimInstance("p0", COST, BlockHashes(), pub, capacity=4).start()
        sub = ctx.socket(zmq.SUB)
        sub.connect(pub.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        await asyncio.sleep(0.3)  # the subscription reaches the publisher
        prompt = list(range(100, 100 + 40))  # 2 full blocks and 8 tokens
        first = await _complete(inst.url, prompt, kv_transfer_params={"do_remote_decode": True})
        again = await _complete(inst.url, prompt)
        other = await _complete(inst.url, list(range(500, 500 + 48)))  # 3 more: 1 evicted
        inst.reset()
        dec = msgspec.msgpack.Decoder(KVEventBatch)
        frames = [await asyncio.wait_for(sub.recv_multipart(), 5) for _ in range(3)]
        batches = [dec.decode(f[2]) for f in frames]
        assert [int.from_bytes(f[1], "big") for f in frames] == [0, 1, 2]
        stored = batches[0].events[0]
        assert isinstance(stored, BlockStored) and stored.block_size == 16
        keys = PrefixCacheHasher("sha256").keys(prompt, 16)
        assert stored.block_hashes == keys and stored.parent_block_hash is None
        assert stored.token_ids == prompt[:32]
        removed, stored2 = batches[1].events
        assert isinstance(removed, BlockRemoved) and removed.block_hashes == keys[:1]
        assert isinstance(stored2, BlockStored) and len(stored2.block_hashes) == 3
        assert isinstance(batches[2].events[0], AllBlocksCleared)
        # P's answer names P for D; the same prompt again hits its full blocks (not the last
        # token's): vLLM's cached_tokens
        assert first["kv_transfer_params"]["remote_engine_id"] == "p0"
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # replay from seq 1: batches 1 and 2, then the end marker
        replay = ctx.socket(zmq.DEALER)
        replay.connect(pub.replay_endpoint)
        await replay.send_multipart([b"", (1).to_bytes(8, "big")])
        got = [await asyncio.wait_for(replay.recv_multipart(), 5) for _ in range(3)]
        assert [int.from_bytes(f[2], "big", signed=True) for f in got] == [1, 2, -1]
        assert dec.decode(got[0][3]) == batches[1]
        metrics = await _client(inst.url).request("GET", "/metrics")
        assert b"vllm:prefix_cache_hits_total" in metrics[1]
        for s in (sub, replay):
            s.close(linger=0)
        await inst.close()
        ctx.destroy(linger=0)

    asyncio.run(main())


async def _fleet(n_p: int, n_d: int) -> tuple[Fleet, list[dict[str, Any]], list[dict[str, Any]]]:
    fleet = await Fleet(COST, capacity=4096).start(n_p, n_d)
    info = [fleet.describe(n) for n in fleet.instances]
    return (fleet, [i for i in info if i["role"] == "prefill"],
            [i for i in info if i["role"] == "decode"])


def test_short_trace_through_the_client_side_baseline(tmp_path: Path) -> None:
    prompts, hashes, _ = trace_prompts("deep-prefix-tree", 40, 16, 0)

    async def main() -> dict[str, Any]:
        fleet, prefill, decode = await _fleet(2, 2)
        try:
            router = Router("none", "round_robin", prefill, decode, tmp_path, 0)
            samples, _, wall = await drive(router, prompts, 200.0,
                                           fleet_url=fleet.control.url, prefill=prefill,
                                           decode=decode, output_len=4)
            return summarize(samples, best_achievable(hashes, 16), wall)
        finally:
            await fleet.stop()

    row = asyncio.run(main())
    assert row["completed"] == 40 and row["failed"] == 0
    assert row["router_p50_ms"] is not None and row["router_p50_ms"] >= 0
    assert 0 < row["hit_rate"] <= row["best_hit_rate"] + 1e-9
    assert row["ttft_model_p99_ms"] > 0


def test_churn_behind_our_proxy_loses_nothing(tmp_path: Path) -> None:
    from vllm_ascend.distributed.kv_transfer.core.net import free_port

    prompts, _, _ = trace_prompts("zipf-scans", 90, 8, 0)

    async def main() -> tuple[dict[str, Any], dict[str, Any]]:
        fleet, prefill, decode = await _fleet(3, 2)
        loop = asyncio.get_running_loop()
        router = Router("ours", "round_robin", prefill, decode, tmp_path, free_port())
        try:
            await loop.run_in_executor(None, router.start, 60.0)
            churn = Churn(1, add_at=0.1, drain_at=0.3, kill_at=0.5)
            samples, _, wall = await drive(router, prompts, 30.0, fleet_url=fleet.control.url,
                                           prefill=prefill, decode=decode, output_len=4,
                                           churn=churn)
            return summarize(samples, {"rate": 1.0}, wall), churn_figures(churn,
                                                                          fleet.stats())
        finally:
            await loop.run_in_executor(None, router.stop)
            await fleet.stop()

    start = time.monotonic()
    row, figures = asyncio.run(main())
    assert row["failed"] == 0, row["errors"]
    assert [e["what"] for e in figures["events"]] == ["add", "drain", "kill"]
    take_in = figures["take_in_s"][0]
    assert take_in is not None and take_in < 2.0  # the added P served within 2 s of its add
    # a request routed to the killed P finds it down (the proxy then tries the next P and
    # marks it unhealthy; its health check, every second, too): none routed there after 2 s
    assert figures["stop_routing_s"][0] < 2.0
    kill = figures["events"][2]
    assert kill["probes_after_death"] >= 1  # health probes are told apart from requests
    assert time.monotonic() - start < 60


def test_replicas_of_our_proxy_share_only_the_instances_kv_events(tmp_path: Path) -> None:
    """Two replicas of our ``kv_aware`` proxy (``ours*2``), each subscribed to every P's KV
    events and sharing nothing else: a prompt sent through one replica and again through the
    other goes to the P that cached it, and hits."""
    from vllm_ascend.distributed.kv_transfer.bench.fleet.routers import parse_spec
    from vllm_ascend.distributed.kv_transfer.core.net import free_port

    assert parse_spec("ours*2:kv_aware") == ("ours", "kv_aware", 2)
    assert parse_spec("vllm-router:cache_aware") == ("vllm-router", "cache_aware", 1)
    for bad in ("vllm-router*2:kv_aware", "ours*0:kv_aware", "ours*x:kv_aware", "ours",
                "ours:cache_aware"):
        with pytest.raises(ValueError):
            parse_spec(bad)
    # six prompts of six blocks, no block shared between them
    prompts = [[100 * i + t for t in range(96)] for i in range(6)]
    # the second pass sends them in reverse order: each through the other replica than the
    # first pass did, and, with 3 P, not where a round robin would send it again
    swapped = prompts[::-1]

    async def main() -> tuple[list[Any], list[Any], list[int], float | None]:
        fleet, prefill, decode = await _fleet(3, 1)
        loop = asyncio.get_running_loop()
        router = Router("ours", "kv_aware", prefill, decode, tmp_path, free_port(), replicas=2)
        try:
            await loop.run_in_executor(None, router.start, 60.0)
            pids = [p.pid for p in router.procs]
            kw = {"fleet_url": fleet.control.url, "prefill": prefill, "decode": decode,
                  "output_len": 2}
            first, _, _ = await drive(router, prompts, 5.0, **kw)
            await asyncio.sleep(1.0)  # the P's events reach both replicas
            second, _, _ = await drive(router, swapped, 5.0, **kw)
            return first, second, pids, router.cpu_seconds()
        finally:
            await loop.run_in_executor(None, router.stop)
            await fleet.stop()

    first, second, pids, cpu = asyncio.run(main())
    assert len(set(pids)) == 2 and cpu is not None and cpu > 0
    rows1 = [s.row(0.0) for s in first]
    rows2 = {5 - i: s.row(0.0) for i, s in enumerate(second)}
    assert all(r["status"] == 200 for r in rows1 + list(rows2.values()))
    assert len({r["p"] for r in rows1}) >= 2  # the first pass spread over the P
    for i, r in enumerate(rows1):
        assert rows2[i]["p"] == r["p"], (i, r, rows2[i])
        assert (rows2[i]["cached_tokens"] or 0) >= 64  # its leading blocks, cached on that P
    assert (tmp_path / "router-oursx2-kv_aware-1.log").exists()


def test_rounds_take_turns_and_each_point_is_one_series_of_rounds() -> None:
    routers = [("ours", "kv_aware"), ("vllm-router", "cache_aware")]
    assert list(turns(routers, 3)) == [(0, routers[0]), (0, routers[1]), (1, routers[1]),
                                       (1, routers[0]), (2, routers[0]), (2, routers[1])]

    def run(rnd: int, router: str, router_s: float) -> dict[str, Any]:
        ok = {"status": 200, "router_s": router_s, "ttft_model_s": 0.01}
        return {"instances": 16, "trace": "conversation", "router": router,
                "policy": "kv_aware", "rate": 50.0, "churn": False, "round": rnd,
                "status": "ok", "samples": [ok, {**ok, "router_s": 2 * router_s},
                                            {"status": 500, "router_s": None}]}

    # written in the order they ran (round 1 reversed); a router that did not start has none
    runs = [run(0, "ours", 0.001), run(0, "vllm-router", 0.003), run(1, "vllm-router", 0.004),
            run(1, "ours", 0.002), {"instances": 16, "trace": "conversation",
                                    "router": "vllm-router", "policy": "round_robin",
                                    "rate": 50.0, "churn": False, "status": "failed"}]
    series = {(s["tags"]["router"], s["tags"]["what"]): s for s in ledger_series(runs)}
    assert set(series) == {(r, w) for r in ("ours", "vllm-router")
                           for w in ("router_s", "ttft_model_s")}
    assert series["ours", "router_s"]["rounds"] == [[0.001, 0.002], [0.002, 0.004]]
    assert series["vllm-router", "router_s"]["rounds"] == [[0.003, 0.006], [0.004, 0.008]]
    assert series["ours", "router_s"]["tags"]["rate"] == 50.0


def test_a_router_that_never_gets_ready_is_stopped(tmp_path: Path) -> None:
    """A router not ready in time is stopped before the error is raised: a 9-round run whose
    routers were left behind had them eat the cores of every later run."""
    import os
    import sys

    from vllm_ascend.distributed.kv_transfer.bench.fleet.routers import Router
    from vllm_ascend.distributed.kv_transfer.core.net import free_port

    pidfile = tmp_path / "pid"
    router = Router("ours", "round_robin", [], [], tmp_path, free_port())
    # a process that never answers /health
    router.cmd = [sys.executable, "-c", f"import os, time; open({str(pidfile)!r}, 'w')"
                  f".write(str(os.getpid())); time.sleep(120)"]
    with pytest.raises(RuntimeError, match="not ready after"):
        router.start(timeout=2.0)
    assert router.proc is None
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the router process {pid} is still running")
