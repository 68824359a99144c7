# SPDX-License-Identifier: Apache-2.0
"""The kv_aware policy in KV pool deployments: the pool's events (``BlockStored`` /
``BlockRemoved`` with ``medium="cpu"``, as ``AscendStoreConnector`` hands them to vLLM's
publisher) on any P instance's stream feed one shared pool index that counts for every
instance attached to the pool; lost events make the pool forget what that stream told."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from ascend_kv_testing.faults import wait_for
from ascend_kv_testing.requires import require
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.cli import build_parser, kv_settings
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.events import EventsEndpoint, EventStream
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.instances import Instance
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.prefix_index import (
    PoolIndex,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.router import (
    SHARED_POOL,
    KvAwareSettings,
    KvRouter,
)

kv_events = require("vllm.distributed.kv_events")
BS = 4
TOKENS = list(range(100, 117))  # 4 full blocks and one token
A, B, C = "http://a", "http://b", "http://c"


@pytest.fixture(autouse=True)
def _no_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def vllm_block_hashes(tokens: list[int]) -> list[bytes]:
    """The block hashes vLLM's scheduler computes for a request of ``tokens``."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name("sha256")
    kv_cache_utils.init_none_hash(fn)
    req = Request("r", tokens, SamplingParams(max_tokens=1), None,
                  block_hasher=kv_cache_utils.get_request_block_hasher(BS, fn))
    return list(req.block_hashes)


HASHES: list[bytes] = []


def h(i: int) -> bytes:
    if not HASHES:
        HASHES.extend(vllm_block_hashes(TOKENS))
    return HASHES[i]


def stored(first: int, last: int, medium: str) -> Any:
    """vLLM's BlockStored of blocks ``first..last-1`` of TOKENS. With ``medium="cpu"``
    it is what the pool connector's ``to_vllm_events`` makes of its StoredBlock: one
    event a block, vLLM's hash, the parent's hash, the block's tokens."""
    return kv_events.BlockStored(
        block_hashes=[h(i) for i in range(first, last)],
        parent_block_hash=h(first - 1) if first else None,
        token_ids=TOKENS[first * BS:last * BS], block_size=BS, lora_id=None, medium=medium,
        lora_name=None)


def pool_stored(i: int) -> Any:
    return stored(i, i + 1, "cpu")


def removed(i: int, medium: str = "cpu") -> Any:
    return kv_events.BlockRemoved(block_hashes=[h(i)], medium=medium)


class Frames:
    """``(topic, seq, payload)`` frames as vLLM's ZmqEventPublisher sends them."""

    def __init__(self) -> None:
        self.seq = 0
        self.enc = msgspec.msgpack.Encoder()

    def __call__(self, *events: Any) -> list[bytes]:
        payload = self.enc.encode(kv_events.KVEventBatch(ts=time.time(), events=list(events)))
        frames = [b"", self.seq.to_bytes(8, "big"), payload]
        self.seq += 1
        return frames


def fed_router(**settings: Any) -> KvRouter:
    """A router following A, B (and C) by hand-fed frames (no sockets)."""
    r = KvRouter(KvAwareSettings(block_size=BS, **settings))
    for url in (A, B, C):
        r.add(url, None)
        pool = r.pools.get(r.members.get(url, ""))
        r.streams[url] = EventStream(url, EventsEndpoint("tcp://127.0.0.1:1"),
                                     r.indexes[url], r.hasher, pool=pool)
    return r


def insts() -> list[Instance]:
    return [Instance(u, "prefill") for u in (A, B, C)]


# ---------------------------------------------------------------- the pool index
def test_pool_index_owners_removals_and_bound() -> None:
    ix = PoolIndex("pool", max_blocks=3)
    ix.store([1, 2], "a", 16)
    ix.store([2, 3], "b", 16)
    assert ix.matched([1, 2, 3, 4]) == 3 and ix.block_size == 16
    ix.forget("a")  # a's events were lost: 1 goes, 2 stays (b announced it too)
    assert ix.matched([2, 3]) == 2 and not ix.holds(1) and ix.forgotten == 1
    ix.remove([2])  # the store dropped it: gone whoever announced it
    assert not ix.holds(2) and len(ix) == 1
    ix.store([4, 5, 6], "a", 16)  # over the bound: the oldest stored (3) is forgotten
    assert len(ix) == 3 and not ix.holds(3) and ix.evicted == 1
    ix.store([7], "a", 32)
    assert not ix.aligned and ix.as_dict()["block_size_mismatch"] == 32


# ---------------------------------------------------------------- the streams feed it
def test_pool_blocks_of_one_stream_count_for_every_member() -> None:
    r = fed_router(pool_shared=True)
    fa, fb, fc = Frames(), Frames(), Frames()
    r.streams[A].handle(fa(stored(0, 2, "GPU")))  # a holds 2 blocks on its device
    r.streams[B].handle(fb(*[pool_stored(i) for i in range(4)]))  # b wrote 4 to the pool
    r.streams[C].handle(fc())  # c: live, nothing stored
    assert len(r.indexes[B]) == 0 and len(r.pools[SHARED_POOL]) == 4
    assert r.pools[SHARED_POOL].hash_verified == 4  # the pool's hashes are vLLM's
    order, d = r.order(insts(), TOKENS)
    # every member reaches 4 blocks (16 tokens) through the pool
    assert d.cached == {A: 16, B: 16, C: 16} and d.device == {A: 8, B: 0, C: 0}
    assert order[0].url == A and d.reason == "prefix"  # a tie: the device prefix wins
    # a 16-token prompt: the pool gives up to its last token, the device whole blocks
    _, d16 = r.order(insts(), TOKENS[:16])
    assert d16.cached[B] == 15 and d16.device[A] == 8
    # load still trades: a busy, b idle
    a, b, c = insts()
    a.in_flight = 1
    order, d = r.order([a, b, c], TOKENS)
    assert order[0] is b and d.reason == "prefix" and d.predicted_tokens == 16
    # an instance outside the pool, or a pool nobody's stream is live for, counts nothing
    assert r.pool_usable("http://other") is None
    st = r.status(C)
    assert st["pool_index"]["blocks"] == 4 and st["pool_index"]["usable"]
    assert st["prefix_index"]["blocks"] == 0


def test_without_a_shared_pool_pool_events_count_for_their_instance_only() -> None:
    r = fed_router()
    r.streams[B].handle(Frames()(*[pool_stored(i) for i in range(3)]))
    r.streams[A].handle(Frames()())
    assert not r.pools and r.status(B)["pool_index"] is None
    order, d = r.order(insts(), TOKENS)
    assert order[0].url == B and d.cached == {A: 0, B: 12} and d.device[B] == 12


def test_pool_groups_by_instance() -> None:
    r = fed_router(pools={A: "east", B: "east", C: "west"})
    r.streams[A].handle(Frames()(pool_stored(0), pool_stored(1)))
    r.streams[B].handle(Frames()())
    r.streams[C].handle(Frames()())
    _, d = r.order(insts(), TOKENS)
    assert d.cached == {A: 8, B: 8, C: 0}
    assert set(r.pools) == {"east", "west"} and len(r.pools["west"]) == 0


def test_pool_evictions_and_device_removals_are_told_apart() -> None:
    r = fed_router(pool_shared=True)
    fa, fb = Frames(), Frames()
    r.streams[A].handle(fa(stored(0, 3, "GPU"), *[pool_stored(i) for i in range(4)]))
    r.streams[B].handle(fb())
    r.streams[A].handle(fa(removed(1, "GPU")))  # the device dropped block 1: the pool not
    assert r.order(insts()[:2], TOKENS)[1].cached == {A: 16, B: 16}
    assert r.order(insts()[:2], TOKENS)[1].device[A] == 4
    r.streams[B].handle(fb(removed(2)))  # the pool evicted block 2 (b's backend said so)
    _, d = r.order(insts()[:2], TOKENS)
    assert d.cached == {A: 8, B: 8} and len(r.pools[SHARED_POOL]) == 3
    r.streams[A].handle(fa(kv_events.AllBlocksCleared()))  # a reset its device cache only
    assert len(r.indexes[A]) == 0 and len(r.pools[SHARED_POOL]) == 3


def test_lost_events_make_the_pool_forget_that_streams_blocks() -> None:
    r = fed_router(pool_shared=True)
    fa, fb = Frames(), Frames()
    r.streams[A].handle(fa(pool_stored(0), pool_stored(1)))
    r.streams[B].handle(fb(pool_stored(2)))
    pool = r.pools[SHARED_POOL]
    assert len(pool) == 3
    fa.seq += 1  # a batch of a's is lost (no replay socket): its removals may be too
    r.streams[A].handle(fa())
    assert r.streams[A].counts["gaps_rebuilt"] == 1
    assert len(pool) == 1 and pool.holds(r.hasher.keys(TOKENS, BS)[2])
    r.streams[A].handle(fa(pool_stored(0)))
    fb.seq = 0  # b restarted (sequence from 0): what it announced is forgotten
    r.streams[B].handle(fb())
    assert r.streams[B].counts["restarts"] == 1 and len(pool) == 1
    r.streams[A].handle([b"", fa.seq.to_bytes(8, "big"), b"\xc1 garbled"])
    fa.seq += 1
    assert len(pool) == 0  # a garbled batch is a lost batch
    # a pool with no live member stream is not used: routing by load
    r.streams[A].handle(fa(*[pool_stored(i) for i in range(4)]))
    assert r.order(insts()[:2], TOKENS)[1].cached[B] == 16
    for url in (A, B, C):
        r.streams[url].state = "dropped"
    order, d = r.order(insts(), TOKENS)
    assert d.reason == "no_index" and r.pool_usable(B) is None
    r.streams[C].state = "live"  # one member live again: the pool counts for all
    assert r.order(insts(), TOKENS)[1].cached == {A: 16, B: 16, C: 16}
    r.remove(A)  # a removed: its announcements would no longer be corrected
    assert wait_for(lambda: len(pool) == 0, 5)  # (forgotten off the caller's thread)


def test_a_re_added_instance_forgets_at_once() -> None:
    r = fed_router(pool_shared=True)
    r.streams[A].handle(Frames()(pool_stored(0)))
    r.streams[B].handle(Frames()(pool_stored(1)))
    r.add(A, None)  # before its new stream could re-announce anything
    assert len(r.pools[SHARED_POOL]) == 1 and r.members[A] == SHARED_POOL


def test_pool_hash_mismatch_disables_the_pool_only() -> None:
    r = KvRouter(KvAwareSettings(pool_shared=True, hash_seed="not-the-instances"))
    r.add(A, None)
    r.streams[A] = EventStream(A, EventsEndpoint("tcp://127.0.0.1:1"), r.indexes[A],
                               r.hasher, pool=r.pools[SHARED_POOL])
    r.streams[A].handle(Frames()(pool_stored(0)))
    assert r.pools[SHARED_POOL].hash_mismatched == 1 and r.pool_usable(A) is None
    assert r.indexes[A].aligned


def test_predictions_are_split_by_source() -> None:
    from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.metrics import Metrics

    r = fed_router(pool_shared=True)
    r.metrics = m = Metrics()
    r.streams[A].handle(Frames()(stored(0, 1, "GPU"), *[pool_stored(i) for i in range(3)]))
    r.streams[B].handle(Frames()())
    _, d = r.order(insts()[:2], TOKENS)
    assert d.instance == A and d.predicted_tokens == 12
    r.record(d, A, 12)
    r.record(d, B, 12)  # failed over to b: all of it from the pool

    def value(inst: str, source: str) -> float | None:
        return m.registry.get_sample_value(
            "vllm_ascend_pd_proxy_predicted_hit_source_tokens_total",
            {"instance": inst, "source": source})

    assert (value(A, "device"), value(A, "pool")) == (4, 8)
    assert (value(B, "device"), value(B, "pool")) == (0, 12)
    KvRouter(KvAwareSettings(), m).record(d, A, None)  # a second router, same registry
    assert value(A, "device") == 8


# ---------------------------------------------------------------- real publishers
@pytest.fixture
def publishers() -> Iterator[list[Any]]:
    pubs = []
    for _ in range(2):
        port, replay = free_port(), free_port()
        pub = kv_events.ZmqEventPublisher(0, endpoint=f"tcp://*:{port}",
                                          replay_endpoint=f"tcp://*:{replay}")
        pubs.append((pub, EventsEndpoint(f"tcp://127.0.0.1:{port}",
                                         f"tcp://127.0.0.1:{replay}")))
    yield pubs
    for pub, _ in pubs:
        pub.shutdown()


def test_shared_pool_over_vllms_publishers(publishers: list[Any]) -> None:
    (pa, wa), (pb, wb) = publishers
    pa.publish(kv_events.KVEventBatch(ts=time.time(), events=[pool_stored(0), pool_stored(1)]))
    r = KvRouter(KvAwareSettings(pool_shared=True))
    try:
        r.add(A, wa)  # its history (2 pool blocks) comes from the replay socket
        r.add(B, wb)
        assert wait_for(lambda: r.pool_usable(B) is not None, 10.0)
        assert wait_for(lambda: r.order(insts()[:2], TOKENS)[1].cached == {A: 8, B: 8}, 10.0)
        pb.publish(kv_events.KVEventBatch(ts=time.time(), events=[pool_stored(2)]))
        assert wait_for(lambda: r.order(insts()[:2], TOKENS)[1].cached == {A: 12, B: 12}, 10.0)
        pb.publish(kv_events.KVEventBatch(ts=time.time(), events=[removed(0)]))
        assert wait_for(lambda: r.order(insts()[:2], TOKENS)[1].reason == "no_hit", 10.0)
    finally:
        r.stop()


def test_command_line_of_pools() -> None:
    parser = build_parser()
    base = ["--prefill", "h1:1", "--prefill", "h2:1", "--prefill", "h3:1", "--decode", "d:2",
            "--policy", "kv_aware"]
    kv = kv_settings(parser, parser.parse_args([*base, "--pool-shared"]))
    assert kv.pool_shared and kv.pool_of("http://h3:1") == SHARED_POOL and not kv.pools
    kv = kv_settings(parser, parser.parse_args(
        [*base, "--prefill-pool", "x", "--prefill-pool", "-", "--prefill-pool", "y",
         "--pool-max-blocks", "1000"]))
    assert kv.pools == {"http://h1:1": "x", "http://h3:1": "y"} and kv.pool_max_blocks == 1000
    assert kv.pool_of("http://h2:1") is None and kv.pool_medium == "cpu"
    with pytest.raises(SystemExit):
        kv_settings(parser, parser.parse_args([*base, "--pool-max-blocks", "0"]))
    assert "--pool-shared" in parser.format_help()


def test_the_proxy_tokenizes_when_only_a_pool_index_predicts() -> None:
    """Every device index unusable, the pool's usable: the prompt is still tokenized."""
    from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.policies import KvAware

    r = fed_router(pool_shared=True)
    r.streams[B].handle(Frames()(*[pool_stored(i) for i in range(4)]))
    policy = KvAware(r)
    assert policy.predicts(insts())
    r.usable = lambda _url: None  # type: ignore[method-assign]  # no device index usable
    assert r.pool_usable(A) is not None and policy.predicts(insts())
    r.pool_usable = lambda _url: None  # type: ignore[method-assign]
    assert not policy.predicts(insts())
