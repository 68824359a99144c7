# SPDX-License-Identifier: Apache-2.0
"""MooncakeLayerwiseConnector end to end: real vLLM CPU engines for P and D, real Mooncake.

D gets each request first and posts its blocks to a metaserver (an HTTP server in this
test, standing in for the proxy's); P then prefills with what D posted and pushes every
layer into D's blocks while it computes (P runs chunked prefill: 64 tokens a step). D
must produce exactly the tokens a single instance produces (float32, greedy).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.engines import EngineProcess, GenResult
from ascend_kv_testing.faults import start_in_parallel
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.pd import LAYERWISE, PROBES, Metaserver, baseline, kv_config, prompts_of

BS = 32
STATS = "vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_layerwise_connector:push_stats"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("lw-model"))


@pytest.fixture(scope="module")
def lw(model: Path) -> Iterator[Any]:
    """P (chunked prefill, 64 tokens a step) and D (recompute on a failed load), started
    side by side."""
    # D's 3 s write lease: the transfer engine's stall bound must stay well below it
    # (P starts no write later than that bound before the lease ends).
    env = {"MC_TCP_PROGRESS_TIMEOUT_SEC": "1"}
    engines = start_in_parallel({
        "p": lambda: EngineProcess(model, kv_config("kv_producer", "lw-prefill",
                                                    connector=LAYERWISE),
                                   max_num_batched_tokens=64, env=env),
        "d": lambda: EngineProcess(model, kv_config(
            "kv_consumer", "lw-decode", policy="recompute", connector=LAYERWISE,
            load_timeout_s=8.0, lease_ttl_s=3.0), env=env),
    })
    server = Metaserver()
    try:
        yield type("LW", (), {"p": engines["p"], "d": engines["d"], "meta": server})
    finally:
        server.close()
        for e in engines.values():
            e.close()


_seq = iter(range(10**6))


def run_pd(lw: Any, prompts: list[list[int]], *, virtual: set[int] = frozenset(),
           skip_p: set[int] = frozenset(), max_tokens: int = 8) -> list[GenResult]:
    """Send the batch to D, wait for D's posts, prefill the posted ones on P."""
    ids = [f"lw-{next(_seq)}" for _ in prompts]
    kv = [{"do_remote_prefill": True, "metaserver": lw.meta.url, "request_id": rid,
           **({"do_virtual": True} if i in virtual else {})} for i, rid in enumerate(ids)]
    out: dict[str, Any] = {}

    def decode() -> None:
        try:
            out["d"] = lw.d.generate(prompts, max_tokens=max_tokens, kv_params=kv)
        except BaseException as exc:
            out["error"] = exc

    t = threading.Thread(target=decode)
    t.start()
    to_p = [i for i in range(len(prompts)) if i not in virtual and i not in skip_p]
    if to_p:
        posted = lw.meta.wait([ids[i] for i in to_p])
        lw.p.generate([prompts[i] for i in to_p], max_tokens=1, kv_params=posted)
    t.join(300)
    if "error" in out:
        raise out["error"]
    return out["d"]


def totals(engine: EngineProcess) -> dict[str, float]:
    return engine.call(f"{PROBES}:connector_totals")


def test_layerwise_equals_single_instance_for_every_length(lw: Any) -> None:
    # < 1 block, k blocks, k blocks + 1, several chunks of P's 64-token steps
    lengths = [5, BS - 1, BS, BS + 1, 2 * BS, 2 * BS + 1, 70, 150, 200]
    prompts = prompts_of(lengths, seed=21)
    want = baseline(lw.d, prompts)
    d0, p0 = totals(lw.d), totals(lw.p)
    got = run_pd(lw, prompts)
    assert [g.token_ids for g in got] == want
    d1, p1 = totals(lw.d), totals(lw.p)
    assert d1.get("p2p_requests_loaded", 0) - d0.get("p2p_requests_loaded", 0) == len(prompts)
    assert not any(k.startswith("p2p_failures") and d1[k] != d0.get(k, 0) for k in d1)
    assert p1["p2p_transfer_bytes"] > p0.get("p2p_transfer_bytes", 0)
    assert p1["p2p_requests_served"] - p0.get("p2p_requests_served", 0) == len(prompts)
    # vLLM's CPU attention calls save_kv_layer: every layer went out layer by layer
    stats = lw.p.call(STATS)
    assert stats["hooked"] > 0 and stats["fallback"] == 0
    # P freed every block once its pushes were over; D holds nothing for P
    for engine in (lw.p, lw.d):
        assert engine.wait_idle(20)
        state = engine.call(f"{PROBES}:scheduler_state")
        assert state["requests"] == 0 and state["free_blocks"] == state["total_blocks"] - 1


def test_prefix_hits_on_both_sides_push_only_the_rest(lw: Any) -> None:
    prompts = prompts_of([100, 161], seed=22)
    want = baseline(lw.d, prompts)
    assert [g.token_ids for g in run_pd(lw, prompts)] == want
    bytes_first = totals(lw.p)["p2p_transfer_bytes"]
    # D and P both hold these prompts' full blocks now: D posts them as cached
    assert [g.token_ids for g in run_pd(lw, prompts)] == want
    posts = list(lw.meta.posts.values())[-2:]
    # the two requests run in one batch: D may post them in either order
    assert sorted(p["remote_cached_tokens"] for p in posts) == [96, 160]
    second = totals(lw.p)["p2p_transfer_bytes"] - bytes_first
    assert 0 < second < bytes_first / 3
    lw.d.reset_prefix_cache()


def test_virtual_request_completes_with_no_transfer_beside_ordinary_ones(lw: Any) -> None:
    prompts = prompts_of([90, 75], seed=23)
    want = baseline(lw.d, prompts)
    d0, p0 = totals(lw.d), totals(lw.p)
    posts0 = set(lw.meta.posts)
    alone = run_pd(lw, prompts[:1], virtual={0})[0]
    assert alone.finish_reason == "length" and len(alone.token_ids) == 8
    d1, p1 = totals(lw.d), totals(lw.p)
    assert d1["p2p_virtual_requests"] - d0.get("p2p_virtual_requests", 0) == 1
    assert p1.get("p2p_transfer_bytes", 0) == p0.get("p2p_transfer_bytes", 0)  # no bytes
    assert d1.get("p2p_requests_loaded", 0) == d0.get("p2p_requests_loaded", 0)
    assert set(lw.meta.posts) == posts0  # no metaserver post
    lw.d.reset_prefix_cache()  # the virtual request's blocks hold no real KV
    mixed = run_pd(lw, prompts, virtual={0})
    assert mixed[1].token_ids == want[1] and len(mixed[0].token_ids) == 8
    assert len(set(lw.meta.posts) - posts0) == 1
    lw.d.reset_prefix_cache()


def test_p_that_never_comes_is_recomputed_at_the_deadline(lw: Any) -> None:
    """D posted, but no P ever pushes (P died): D recomputes at its 8 s deadline."""
    prompts = prompts_of([70], seed=24)
    want = baseline(lw.d, prompts)
    d0 = totals(lw.d)
    start = time.monotonic()
    got = run_pd(lw, prompts, skip_p={0})
    assert 7.5 < time.monotonic() - start < 20
    assert got[0].token_ids == want[0] and got[0].finish_reason == "length"
    d1 = totals(lw.d)
    assert d1["p2p_failures|cause=deadline"] - d0.get("p2p_failures|cause=deadline", 0) == 1
    assert lw.d.wait_idle(20)
