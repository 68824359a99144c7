# SPDX-License-Identifier: Apache-2.0
"""The kv_aware policy's parts: vLLM's block hashes, the prefix index, the KV event stream
against vLLM's real ``ZmqEventPublisher`` (gaps, restarts, drops, garbage), the scoring."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest
import zmq

from ascend_kv_testing.requires import require
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.events import EventsEndpoint, EventStream
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.instances import Instance
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.prefix_index import (
    PrefixCacheHasher,
    PrefixIndex,
    block_key,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.router import KvAwareSettings, KvRouter

kv_events = require("vllm.distributed.kv_events")
BS = 4


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


@pytest.fixture(autouse=True)
def _no_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


def vllm_block_hashes(tokens: list[int], algo: str = "sha256") -> list[bytes]:
    """The block hashes vLLM's scheduler computes for a request of ``tokens``."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(fn)
    req = Request("r", tokens, SamplingParams(max_tokens=1), None,
                  block_hasher=kv_cache_utils.get_request_block_hasher(BS, fn))
    return list(req.block_hashes)


def stored(tokens: list[int], parent: bytes | None = None) -> Any:
    """vLLM's BlockStored of ``tokens`` (full blocks), hashed as vLLM does."""
    hashes = vllm_block_hashes(tokens)
    return kv_events.BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                 token_ids=tokens, block_size=BS, lora_id=None,
                                 medium="GPU", lora_name=None)


def batch(*events: Any) -> Any:
    return kv_events.KVEventBatch(ts=time.time(), events=list(events))


class Publisher:
    """vLLM's ZmqEventPublisher on loopback ports."""

    def __init__(self, port: int | None = None, replay: bool = True,
                 buffer_steps: int = 10_000) -> None:
        self.port = port or free_port()
        self.replay_port = free_port() if replay else None
        self.buffer_steps = buffer_steps
        self.pub = self._make()

    def _make(self) -> Any:
        return kv_events.ZmqEventPublisher(
            0, endpoint=f"tcp://*:{self.port}",
            replay_endpoint=f"tcp://*:{self.replay_port}" if self.replay_port else None,
            buffer_steps=getattr(self, "buffer_steps", 10_000))

    @property
    def where(self) -> EventsEndpoint:
        return EventsEndpoint(f"tcp://127.0.0.1:{self.port}",
                              f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port
                              else None)

    def publish(self, *events: Any) -> None:
        self.pub.publish(batch(*events))

    def restart(self) -> None:
        self.pub.shutdown()
        time.sleep(0.2)
        self.pub = self._make()

    def close(self) -> None:
        self.pub.shutdown()


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    p = Publisher()
    yield p
    p.close()


TOKENS = list(range(100, 117))  # 4 full blocks and one token


# ---------------------------------------------------------------- hashes and index
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_block_hashes_are_vllms(algo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Computed without vLLM, equal to what its scheduler computes, for every algorithm
    (xxHash's with a seed both sides share, as vLLM requires)."""
    if algo.startswith("xxhash"):
        monkeypatch.setenv("PYTHONHASHSEED", "1234")
    mine = PrefixCacheHasher(algo).keys(TOKENS, BS)
    assert mine == [block_key(h) for h in vllm_block_hashes(TOKENS, algo)]
    assert len(mine) == 4 and PrefixCacheHasher(algo).keys(TOKENS, BS, limit=2) == mine[:2]
    assert PrefixCacheHasher(algo, seed="other").keys(TOKENS, BS) != mine  # the seed matters


def test_hasher_settings_are_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown prefix-caching hash algo"):
        PrefixCacheHasher("md5")
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        PrefixCacheHasher("xxhash")
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert PrefixCacheHasher("sha256").seed == "7"
    assert block_key(2**70 + 5) == 5 and block_key(b"\x00" * 24 + (9).to_bytes(8, "big")) == 9


def test_prefix_index_media_and_prefix() -> None:
    ix = PrefixIndex()
    ix.store([1, 2, 3], "GPU", 16)
    ix.store([2], "CPU", 16)
    assert ix.block_size == 16 and ix.matched([1, 2, 3, 4]) == 3 and ix.matched([2, 1]) == 2
    ix.remove([2], "GPU")
    assert ix.matched([1, 2, 3]) == 3  # still on CPU
    ix.remove([2], "CPU")
    assert ix.matched([1, 2, 3]) == 1 and len(ix) == 2
    ix.store([9], None, 32)
    assert not ix.aligned and ix.block_size_mismatch == 32
    ix.clear()
    assert len(ix) == 0 and ix.cleared == 1


def test_prefix_index_is_bounded_and_forgets_the_oldest_first() -> None:
    """An instance whose removals never come cannot grow its index past the bound: the
    oldest stored keys go (a 16th of the bound at once), the newest prompt stays whole."""
    ix = PrefixIndex(16, max_blocks=64)
    for start in range(0, 10_000, 8):
        ix.store(list(range(start, start + 8)), "GPU", 16)
        assert len(ix) <= 64
    assert ix.matched(list(range(10_000 - 56, 10_000))) == 56  # the newest prompts whole
    assert ix.matched([0, 1]) == 0 and ix.evicted == 10_000 - len(ix)
    assert ix.as_dict()["max_blocks"] == 64 and ix.as_dict()["evicted"] == ix.evicted
    ix.store([10_000 - 1], "CPU", 16)  # an existing key on another medium: nothing evicted
    assert ix.evicted == 10_000 - len(ix)
    unbounded = PrefixIndex(max_blocks=None)
    unbounded.store(list(range(100_000)), "GPU", 16)
    assert len(unbounded) == 100_000 and unbounded.evicted == 0


def test_the_proxy_bounds_each_instance_index() -> None:
    from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.cli import build_parser, kv_settings

    args = build_parser().parse_args(["--prefill", "http://p:1", "--decode", "http://d:1",
                                      "--kv-index-max-blocks", "1000"])
    router = KvRouter(kv_settings(build_parser(), args))
    router.add("http://p:1", None)
    assert router.indexes["http://p:1"].max_blocks == 1000
    with pytest.raises(SystemExit):
        kv_settings(build_parser(), build_parser().parse_args(
            ["--prefill", "http://p:1", "--decode", "http://d:1", "--kv-index-max-blocks", "0"]))


# ---------------------------------------------------------------- the event stream
def stream_for(pub: Publisher, **kw: Any) -> EventStream:
    return EventStream("p0", pub.where, PrefixIndex(), PrefixCacheHasher(), **kw).start()


def keys(tokens: list[int] = TOKENS) -> list[int]:
    return PrefixCacheHasher().keys(tokens, BS)


def test_stream_follows_store_remove_clear(publisher: Publisher) -> None:
    publisher.publish(stored(TOKENS[:8]))  # before the subscriber: replayed at connect
    s = stream_for(publisher)
    try:
        assert wait_for(lambda: s.index.matched(keys()) == 2 and s.state == "live")
        hashes = vllm_block_hashes(TOKENS)
        publisher.publish(kv_events.BlockStored(
            block_hashes=hashes[2:4], parent_block_hash=hashes[1], token_ids=TOKENS[8:16],
            block_size=BS, lora_id=None, medium="GPU", lora_name=None))
        assert wait_for(lambda: s.index.matched(keys()) == 4)
        assert s.usable and s.index.hash_verified >= 2 and s.index.block_size == BS
        publisher.publish(kv_events.BlockRemoved(block_hashes=[hashes[1]], medium="GPU"))
        assert wait_for(lambda: s.index.matched(keys()) == 1)
        publisher.publish(kv_events.AllBlocksCleared())
        assert wait_for(lambda: len(s.index) == 0 and s.counts.get("cleared") == 1)
        assert s.as_dict()["state"] == "live" and s.last_seq == 3
    finally:
        s.stop()


def test_misaligned_hash_settings_disable_the_index(publisher: Publisher) -> None:
    s = EventStream("p0", publisher.where, PrefixIndex(), PrefixCacheHasher(seed="not-the-same"))
    s.start()
    try:
        publisher.publish(stored(TOKENS[:8]))
        assert wait_for(lambda: s.index.hash_mismatched == 1)
        assert s.state == "live" and not s.usable and not s.index.aligned
    finally:
        s.stop()


def test_a_lost_batch_is_replayed(publisher: Publisher) -> None:
    """Frames fed by hand (one skipped) against the real publisher's replay socket."""
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(publisher.where.endpoint)
    time.sleep(0.3)
    hashes = vllm_block_hashes(TOKENS)
    publisher.publish(stored(TOKENS[:4]))
    publisher.publish(kv_events.BlockStored(
        block_hashes=hashes[1:2], parent_block_hash=hashes[0], token_ids=TOKENS[4:8],
        block_size=BS, lora_id=None, medium="GPU", lora_name=None))
    publisher.publish(kv_events.BlockRemoved(block_hashes=[hashes[0]], medium="GPU"))
    frames = [sub.recv_multipart() for _ in range(3)]
    sub.close(linger=0)
    ctx = zmq.Context()
    try:
        s = EventStream("p0", publisher.where, PrefixIndex(), PrefixCacheHasher())
        s.handle(frames[0], ctx)
        s.handle(frames[2], ctx)  # batch 1 lost: fetched from the replay socket
        assert s.counts.get("gaps_replayed") == 1 and s.last_seq == 2
        assert s.index.matched(keys()[1:2]) == 1 and s.index.matched(keys()) == 0
        s.handle(frames[2], ctx)  # a duplicate after the replay is not a restart
        assert "restarts" not in s.counts and s.state == "live"
        # without a replay socket the index is cleared and rebuilt from live events
        bare = EventStream("p1", EventsEndpoint(publisher.where.endpoint), PrefixIndex(),
                           PrefixCacheHasher())
        bare.handle(frames[0], ctx)
        assert bare.index.matched(keys()) == 1
        bare.handle(frames[2], ctx)
        assert bare.counts.get("gaps_rebuilt") == 1 and len(bare.index) == 0
    finally:
        ctx.term()


def one_block(i: int) -> list[int]:
    return [1000 * i + j for j in range(BS)]


def test_a_stream_started_after_the_buffer_wrapped_goes_live_from_it() -> None:
    """vLLM keeps its last ``buffer_steps`` batches: a subscriber that starts after an
    instance sent more cannot have the first ones. It must go live on what the buffer holds
    (not wait for a batch 0 that never comes, asking again and again), while the instance
    stays idle."""
    pub = Publisher(buffer_steps=4)
    try:
        for i in range(10):
            pub.publish(stored(one_block(i)))
        time.sleep(0.5)  # all sent: the buffer holds batches 6..9
        s = EventStream("p0", pub.where, PrefixIndex(), PrefixCacheHasher()).start()
        try:
            assert wait_for(lambda: s.state == "live", 15), s.as_dict()
            assert s.last_seq == 9 and s.counts.get("gaps_partial") == 1
            held = [i for i in range(10) if s.index.matched(keys(one_block(i))) == 1]
            assert held == [6, 7, 8, 9]
            assert s.usable
            pub.publish(stored(one_block(10)))
            assert wait_for(lambda: s.index.matched(keys(one_block(10))) == 1)
            assert s.last_seq == 10 and s.counts.get("gaps_partial") == 1
        finally:
            s.stop()
    finally:
        pub.close()


def test_a_gap_older_than_the_buffer_clears_what_it_may_have_removed() -> None:
    """A gap the buffer no longer covers may hide a removal: the index forgets what it
    knew and is rebuilt from the buffered batches."""
    pub = Publisher(buffer_steps=3)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.where.endpoint)
    time.sleep(0.3)
    ctx = zmq.Context()
    try:
        pub.publish(stored(one_block(0)))
        pub.publish(kv_events.BlockRemoved(block_hashes=vllm_block_hashes(one_block(0)),
                                           medium="GPU"))
        for i in range(1, 6):
            pub.publish(stored(one_block(i)))
        frames = [sub.recv_multipart() for _ in range(7)]
        s = EventStream("p0", pub.where, PrefixIndex(), PrefixCacheHasher())
        s.handle(frames[0], ctx)
        assert s.index.matched(keys(one_block(0))) == 1
        s.handle(frames[6], ctx)  # batches 1..5 lost; the buffer holds 4..6
        assert s.counts.get("gaps_partial") == 1 and s.last_seq == 6 and s.state == "live"
        held = [i for i in range(6) if s.index.matched(keys(one_block(i))) == 1]
        assert held == [3, 4, 5]  # block 0's removal was lost with batch 1: forgotten
    finally:
        sub.close(linger=0)
        ctx.term()
        pub.close()


def test_restarted_publisher_clears_the_index(publisher: Publisher) -> None:
    s = stream_for(publisher)
    try:
        assert wait_for(lambda: s.state == "live")
        for i in range(3):
            publisher.publish(stored(TOKENS[:4 * (i + 1)]))
        assert wait_for(lambda: s.last_seq == 2 and s.index.matched(keys()) == 3)
        publisher.restart()  # a new engine: sequence numbers from 0, an empty cache
        time.sleep(0.5)
        publisher.publish(stored([7, 7, 7, 7]))
        assert wait_for(lambda: s.counts.get("restarts") == 1 and s.last_seq == 0)
        assert s.index.matched(keys()) == 0 and s.index.matched(keys([7, 7, 7, 7])) == 1
        assert s.usable
    finally:
        s.stop()


def test_dropped_subscriber_resyncs_by_replay(publisher: Publisher) -> None:
    s = stream_for(publisher)
    try:
        assert wait_for(lambda: s.state == "live")
        publisher.publish(stored(TOKENS[:4]))
        assert wait_for(lambda: s.index.matched(keys()) == 1)
        s.drop()
        assert wait_for(lambda: s.state == "dropped")
        assert not s.usable  # load-based while it reconnects
        publisher.publish(stored(TOKENS[:8]))  # sent while nobody listens
        assert wait_for(lambda: s.state == "live" and s.index.matched(keys()) == 2)
        assert s.counts["drops"] == 1 and s.counts.get("gaps_replayed", 0) == 0
    finally:
        s.stop()


def test_garbage_and_unknown_events_do_not_kill_the_stream(publisher: Publisher) -> None:
    port = free_port()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.bind(f"tcp://127.0.0.1:{port}")
    s = EventStream("p0", EventsEndpoint(f"tcp://127.0.0.1:{port}"), PrefixIndex(),
                    PrefixCacheHasher()).start()
    try:
        enc = msgspec.msgpack.Encoder()
        good = enc.encode(batch(stored(TOKENS[:4])))
        unknown = enc.encode([time.time(), [{"type": "BlockFrobbed", "x": 1},
                                            msgspec.to_builtins(stored(TOKENS[:8]),
                                                                builtin_types=(bytes,))], None])

        def send(seq: int, payload: bytes) -> None:
            pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

        time.sleep(0.3)
        assert s.state == "connecting" and not s.usable  # nothing heard yet, no replay socket
        deadline = time.monotonic() + 10
        while s.last_seq is None and time.monotonic() < deadline:  # slow joiner
            send(0, good)
            time.sleep(0.1)
        assert wait_for(lambda: s.state == "live")
        pub.send_multipart((b"", b"short"))
        send(1, b"\xc1 not msgpack")
        assert wait_for(lambda: s.counts.get("bad_frames") == 2)
        assert len(s.index) == 0  # the garbled batch counts as lost
        send(2, unknown)
        assert wait_for(lambda: s.counts.get("unknown_events") == 1)
        assert s.index.matched(keys()) == 2 and s.state == "live"
    finally:
        s.stop()
        pub.close(linger=0)
        ctx.term()


# ---------------------------------------------------------------- scoring
def router_with(cached: dict[str, int], load_weight: float = 0.25) -> KvRouter:
    """A router whose instances hold the first ``cached[url]`` blocks of TOKENS."""
    r = KvRouter(KvAwareSettings(load_weight=load_weight))
    for url, n in cached.items():
        ix = PrefixIndex(BS)
        ix.store(keys()[:n], "GPU", BS)
        s = EventStream(url, EventsEndpoint("tcp://127.0.0.1:1"), ix, None)
        s.state = "live"
        r.streams[url], r.indexes[url] = s, ix
    return r


def test_kv_aware_trades_prefix_against_load() -> None:
    a, b, c = Instance("a", "prefill"), Instance("b", "prefill"), Instance("c", "prefill")
    r = router_with({"a": 0, "b": 3, "c": 1})
    order, d = r.order([a, b, c], TOKENS)
    assert [i.url for i in order] == ["b", "c", "a"] and d.reason == "prefix"
    assert d.predicted_tokens == 12 and d.prompt_tokens == 17
    b.in_flight = 3  # 12/17 - 0.75 < 4/17
    order, d = r.order([a, b, c], TOKENS)
    assert order[0] is c and d.reason == "load" and d.predicted_tokens == 4
    # the last prompt token is never a hit: 16 tokens give at most 3 blocks
    r16 = router_with({"a": 4})
    assert r16.order([a], TOKENS[:16])[1].predicted_tokens == 12
    assert router_with({"a": 0}).order([a, c], TOKENS)[1].reason == "no_hit"
    assert r.order([a, b, c], None)[1].reason == "no_tokens"
    r.streams["b"].state = "dropped"
    r.streams["c"].state = "replaying"
    order, d = r.order([a, b, c], TOKENS)
    assert d.reason == "no_hit" and order[0] is a  # only a's (empty) index is used
    a.healthy = False
    order, _ = r.order([a, b, c], TOKENS)
    assert order[-1] is a


def test_router_follows_added_instances_and_forgets_removed_ones(publisher: Publisher) -> None:
    r = KvRouter(KvAwareSettings())
    try:
        r.add("http://p0", publisher.where)
        r.add("http://p1", None)  # no events: routed by load
        assert r.status("http://p1")["events"] == {"state": "none"}
        assert wait_for(lambda: r.streams["http://p0"].state == "live")
        publisher.publish(stored(TOKENS[:8]))
        assert wait_for(lambda: r.usable("http://p0") is not None)
        p0, p1 = Instance("http://p0", "prefill"), Instance("http://p1", "prefill")
        order, d = r.order([p1, p0], TOKENS)
        assert order[0] is p0 and d.reason == "prefix" and d.predicted_tokens == 8
        r.instance_down("http://p0")  # a failed health check: it may come back empty
        assert r.order([p1, p0], TOKENS)[1].reason == "no_hit"
        assert r.status("http://p0")["prefix_index"]["blocks"] == 0
        stream = r.streams["http://p0"]
        r.remove("http://p0")
        assert wait_for(lambda: not stream._thread.is_alive(), 5)
        assert "http://p0" not in r.indexes and r.usable("http://p0") is None
    finally:
        r.stop()


def test_prompt_blocks_are_hashed_only_while_some_instance_holds_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = Instance("a", "prefill"), Instance("b", "prefill")
    r = router_with({"a": 2, "b": 0})
    calls: list[int] = []
    hash_block = r.hasher.hash_block
    monkeypatch.setattr(r.hasher, "hash_block",
                        lambda parent, tokens: calls.append(1) or hash_block(parent, tokens))
    assert r.order([a, b], TOKENS)[1].predicted_tokens == 8
    assert len(calls) == 3  # two hits on a, then a miss everywhere
    calls.clear()
    assert r.order([a, b], [5] * 17)[1].reason == "no_hit" and len(calls) == 1


def test_a_publisher_that_starts_later_is_picked_up() -> None:
    late = Publisher.__new__(Publisher)
    late.port, late.replay_port = free_port(), free_port()
    s = EventStream("p0", late.where, PrefixIndex(), PrefixCacheHasher(),
                    replay_timeout_s=0.5).start()
    try:
        time.sleep(1.0)
        assert s.state == "connecting" and not s.usable
        late.pub = late._make()  # the instance comes up, idle: its replay socket answers
        assert wait_for(lambda: s.state == "live", 15)
        late.publish(stored(TOKENS[:4]))
        assert wait_for(lambda: s.index.matched(keys()) == 1)
    finally:
        s.stop()
        late.close()


def test_predictions_are_checked_against_the_reported_hit() -> None:
    from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.metrics import Metrics
    from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.router import reported_cached_tokens

    r = router_with({"a": 3, "b": 1})
    r.metrics = m = Metrics()
    _, d = r.order([Instance("a", "prefill"), Instance("b", "prefill")], TOKENS)
    r.record(d, "a", 12)
    r.record(d, "b", 0)  # failed over to b, whose own prediction was 4 tokens
    r.record(d, "a", None)
    r.record(d, "a", 16)

    def value(name: str, **labels: str) -> float | None:
        return m.registry.get_sample_value(f"vllm_ascend_pd_proxy_{name}", labels)

    assert [value("hit_predictions_total", outcome=o) for o in
            ("exact", "over", "unreported", "under")] == [1, 1, 1, 1]
    assert value("predicted_hit_tokens_total", instance="a") == 36
    assert value("predicted_hit_tokens_total", instance="b") == 4
    assert value("reported_hit_tokens_total", instance="a") == 28
    assert value("routed_prompt_tokens_total", instance="a") == 3 * 17
    assert reported_cached_tokens({"usage": {"prompt_tokens_details": {"cached_tokens": 32}}}
                                  ) == 32
    assert reported_cached_tokens({"usage": {"prompt_tokens_details": None}}) is None
