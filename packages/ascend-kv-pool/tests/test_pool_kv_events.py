# SPDX-License-Identifier: Apache-2.0
"""KV cache events of the pool (``kv_events_config.enable_kv_cache_events``).

``BlockStored`` for every block this rank saved (once all layers are in with
``use_layerwise``; never for blocks the pool already held or loaded),
``BlockRemoved`` for announced blocks the ``local`` backend evicted, and the
aggregation across workers through vLLM's own ``KVOutputAggregator``: an event
is published once every rank that writes its block reported it, even when
ranks report in different steps.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pool_test_harness import (
    BLOCK,
    NUM_LAYERS,
    Blocks,
    FakeRequest,
    PoolHarness,
    make_kv_caches,
    scheduler_output,
)

from ascend_kv_testing.requires import require
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import LocalBackend
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.context import PoolContext
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.events import (
    PoolEventLog,
    RemovedBlock,
    StoredBlock,
    stored_blocks,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.jobs import (
    BlockEventSpec,
    TransferJob,
)


def req(rid: str, n: int, seed: int = 0) -> FakeRequest:
    return FakeRequest(rid, [(seed * 7919 + i * 31) % 997 + 3 for i in range(n)])


def events_ctx(**kw: Any) -> PoolContext:
    base: dict[str, Any] = dict(model_name="tiny", block_size=BLOCK, num_kv_heads=2,
                                num_layers=NUM_LAYERS, salt="test", kv_events=True)
    base.update(kw)
    return PoolContext(**base)


def stored(request: FakeRequest, blocks: range) -> list[StoredBlock]:
    """The events announcing ``blocks`` of ``request``."""
    hashes = request.block_hashes
    return [StoredBlock(hashes[i], hashes[i - 1] if i else None,
                        tuple(request.all_token_ids[i * BLOCK:(i + 1) * BLOCK]), BLOCK)
            for i in blocks]


def block(h: bytes) -> StoredBlock:
    return StoredBlock(h, None, tuple(range(BLOCK)), BLOCK)


# ---------------------------------------------------------------------- the event log
def test_log_announces_written_blocks_only() -> None:
    log = PoolEventLog(1)
    blocks = [block(b"a"), block(b"b"), None, block(b"d")]
    log.saved(["ka", "kb", "kc", "kd"], written=[True, False, True, False],
              present=[True, True, True, False], blocks=blocks)
    # b was already in the pool, c has no vLLM hash (partial tail), d failed to save
    assert log.take() == [blocks[0]]
    assert log.take() == []


def test_log_rejects_misaligned_reports() -> None:
    with pytest.raises(ValueError, match="2 keys but 1 written"):
        PoolEventLog(1).saved(["a", "b"], [True], [True, True], [None, None])


def test_layerwise_block_is_announced_once_every_layer_is_in() -> None:
    log = PoolEventLog(3)
    b = block(b"x")
    log.saved(["x@0"], [True], [True], [b], layer=0)
    log.saved(["x@1"], [False], [True], [b], layer=1)  # held already: still counts as in
    assert log.take() == []
    log.saved(["x@2"], [True], [True], [b], layer=2)
    assert log.take() == [b]
    # a block whose every layer was there already is not new in the pool
    c = block(b"y")
    for layer in range(3):
        log.saved([f"y@{layer}"], [False], [True], [c], layer=layer)
    assert log.take() == []


def test_a_failed_layer_keeps_the_block_unannounced() -> None:
    log = PoolEventLog(2)
    b = block(b"x")
    log.saved(["x@0"], [True], [True], [b], layer=0)
    log.saved(["x@1"], [False], [False], [b], layer=1)
    assert log.take() == []


def test_eviction_removes_an_announced_block_once() -> None:
    log = PoolEventLog(2, track_removals=True)
    b = block(b"x")
    log.saved(["x@0"], [True], [True], [b], layer=0)
    log.saved(["x@1"], [True], [True], [b], layer=1)
    assert log.take() == [b]
    assert log.tracked_blocks == 1
    log.evicted(["x@1"])
    log.evicted(["x@0"])  # the block is gone already: no second removal
    assert log.take() == [RemovedBlock(b"x")]
    assert log.tracked_blocks == 0


def test_eviction_of_a_layer_cancels_a_block_not_complete_yet() -> None:
    log = PoolEventLog(2, track_removals=True)
    b = block(b"x")
    log.saved(["x@0"], [True], [True], [b], layer=0)
    log.evicted(["x@0"])
    log.saved(["x@1"], [True], [True], [b], layer=1)
    assert log.take() == []


def test_key_evicted_by_a_later_key_of_the_same_save_is_not_announced() -> None:
    log = PoolEventLog(1, track_removals=True)
    a, b = block(b"a"), block(b"b")
    log.evicted(["ka"])  # reported during the put, before the save's outcome
    log.saved(["ka", "kb"], [True, True], [True, True], [a, b])
    assert log.take() == [b]
    log.evicted(["ka"])  # an unknown key later is nothing
    assert log.take() == []


def test_without_eviction_tracking_nothing_is_remembered() -> None:
    log = PoolEventLog(1)
    log.saved(["ka"], [True], [True], [block(b"a")])
    log.evicted(["ka"])
    assert log.take() == [block(b"a")]
    assert log.tracked_blocks == 0


def test_stored_blocks_chain_parents_across_the_picked_blocks() -> None:
    spec = BlockEventSpec(block_hashes=[b"h2", b"h3", None], parent_hash=b"h1",
                          token_ids=list(range(2 * BLOCK + 1)), lora_name="ad", lora_id=7)
    out = stored_blocks(spec, first=2, picked=[0, 1, 2], block_size=BLOCK)
    assert out == [StoredBlock(b"h2", b"h1", tuple(range(BLOCK)), BLOCK, "ad", 7),
                   StoredBlock(b"h3", b"h2", tuple(range(BLOCK, 2 * BLOCK)), BLOCK, "ad", 7),
                   None]
    # a rank saving every other block still names each block's true parent
    assert stored_blocks(spec, first=2, picked=[1], block_size=BLOCK)[0].parent_hash == b"h2"


def test_job_refuses_event_hashes_of_another_length() -> None:
    with pytest.raises(ValueError, match="event hashes"):
        TransferJob("r", ["a", "b"], [1, 2], 0, 2 * BLOCK,
                    events=BlockEventSpec(block_hashes=[b"a"]))


# ---------------------------------------------------------------------- scheduler and worker
def test_events_off_by_default() -> None:
    h = PoolHarness(LocalBackend(capacity=64 << 20))
    result = h.prefill(req("r1", 3 * BLOCK))
    assert all(job.events is None for job in result["meta"].saves)
    assert h.worker.take_events() is None


def test_saved_blocks_are_announced_with_vllm_hashes() -> None:
    backend = LocalBackend(capacity=64 << 20)
    a = PoolHarness(backend, ctx=events_ctx())
    r = req("r1", 3 * BLOCK + 2)
    a.prefill(r)
    assert a.worker.take_events() == stored(r, range(3))
    assert a.worker.take_events() == []
    # another engine loading the same prefix stores nothing, so it announces nothing
    b = PoolHarness(backend, ctx=events_ctx())
    result = b.prefill(req("r2", 3 * BLOCK + 2))
    assert result["external"] == 3 * BLOCK
    assert b.worker.take_events() == []


def test_partial_tail_block_is_saved_but_not_announced() -> None:
    h = PoolHarness(LocalBackend(capacity=64 << 20), ctx=events_ctx(),
                    discard_partial_chunks=False)
    r = req("r1", 2 * BLOCK + 3)
    result = h.prefill(r)
    assert [len(j.hashes) for j in result["meta"].saves] == [3]  # the tail is saved
    assert h.worker.take_events() == stored(r, range(2))


def test_lora_name_travels_with_the_event() -> None:
    h = PoolHarness(LocalBackend(capacity=64 << 20), ctx=events_ctx())
    r = req("r1", 2 * BLOCK)
    r.lora_request = SimpleNamespace(lora_name="adapter-a", lora_int_id=3)
    h.prefill(r)
    events = h.worker.take_events()
    assert [(e.lora_name, e.lora_id) for e in events] == [("adapter-a", 3)] * 2


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 9 * BLOCK), chunk=st.integers(1, 4 * BLOCK))
def test_chunked_prefill_announces_every_full_block_once_in_order(n: int, chunk: int) -> None:
    h = PoolHarness(LocalBackend(capacity=64 << 20), ctx=events_ctx())
    r = req("r1", n, seed=n)
    h.scheduler.get_num_new_matched_tokens(r, 0)
    blocks = h.alloc(-(-n // BLOCK))
    h.scheduler.update_state_after_alloc(r, Blocks(blocks), 0)
    events: list[Any] = []
    done = 0
    while done < n:
        step = min(chunk, n - done)
        out = (scheduler_output(new=[("r1", blocks, 0, step)]) if done == 0 else
               scheduler_output(cached=[("r1", None, done, step)]))
        h.step(out, forward=[(r, blocks, done, done + step)])
        assert h.worker.wait_idle()
        events += h.worker.take_events()
        done += step
    assert events == stored(r, range(n // BLOCK))


def test_evicted_blocks_are_removed() -> None:
    kv = make_kv_caches()
    block_bytes = sum(t[0].numel() * t.element_size() for t in kv.values())
    # room for three blocks; LRU, so the victim is r1's first block
    backend = LocalBackend(capacity=3 * block_bytes, eviction_policy="lru")
    h = PoolHarness(backend, ctx=events_ctx(), kv_caches=kv)
    first, second = req("r1", 2 * BLOCK, seed=1), req("r2", 2 * BLOCK, seed=2)
    h.prefill(first)
    h.prefill(second)
    events = h.worker.take_events()
    # r2's save pushed r1's least recently used first block out (reported during the put,
    # before the save's own outcome)
    assert events == [*stored(first, range(2)), RemovedBlock(first.block_hashes[0]),
                      *stored(second, range(2))]
    assert len(backend) == 3


def test_explicit_removal_is_reported_too() -> None:
    backend = LocalBackend(capacity=64 << 20)
    h = PoolHarness(backend, ctx=events_ctx())
    r = req("r1", BLOCK)
    h.prefill(r)
    h.worker.take_events()
    assert backend.remove(backend.stored_keys()) == 1
    assert h.worker.take_events() == [RemovedBlock(r.block_hashes[0])]


def test_stores_that_do_not_report_evictions_publish_stores_only() -> None:
    class Silent(LocalBackend):
        @classmethod
        def supports_eviction_events(cls) -> bool:
            return False

    backend = Silent(capacity=64 << 20)
    h = PoolHarness(backend, ctx=events_ctx())
    assert h.worker.events is not None and not h.worker.events.track_removals
    r = req("r1", BLOCK)
    h.prefill(r)
    backend.remove(backend.stored_keys())
    assert h.worker.take_events() == stored(r, range(1))


def test_backend_without_eviction_events_says_so() -> None:
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.base import Backend

    class Plain(Backend):
        def register_buffer(self, ptrs: list[int], lengths: list[int]) -> None: ...
        def exists(self, keys: list[str]) -> list[int]: return [0] * len(keys)
        def put(self, keys: list[str], addrs: Any, sizes: Any) -> list[int]: return []
        def get(self, keys: list[str], addrs: Any, sizes: Any) -> list[int]: return []

    assert Plain.supports_eviction_events() is False
    with pytest.raises(NotImplementedError, match="Plain does not support eviction events"):
        Plain().add_eviction_listener(print)


def test_layerwise_saves_announce_each_block_once_all_layers_are_in() -> None:
    backend = LocalBackend(capacity=64 << 20)
    h = PoolHarness(backend, ctx=events_ctx(), use_layerwise=True)
    r = req("r1", 2 * BLOCK)
    h.scheduler.get_num_new_matched_tokens(r, 0)
    blocks = h.alloc(2)
    h.scheduler.update_state_after_alloc(r, Blocks(blocks), 0)
    meta = h.scheduler.build_connector_meta(scheduler_output(new=[("r1", blocks, 0, 2 * BLOCK)]))
    h.worker.start_load_kv(meta)
    h.forward(r, blocks, 0, 2 * BLOCK)
    h.worker.save_kv_layer(h.layers[0], meta)
    assert h.worker.wait_idle()
    assert h.worker.take_events() == []
    for name in h.layers[1:]:
        h.worker.save_kv_layer(name, meta)
    h.worker.wait_for_save(meta)
    assert h.worker.wait_idle()
    assert h.worker.take_events() == stored(r, range(2))
    # evicting one layer of a block removes the block
    backend.remove([backend.stored_keys()[0]])
    assert h.worker.take_events() == [RemovedBlock(r.block_hashes[0])]


# ---------------------------------------------------------------------- aggregation (vLLM)
def _connector_side() -> Any:
    """The scheduler-side state ``update_connector_output``/``take_events`` use."""
    return SimpleNamespace(_kv_cache_events=None)


def _conv(h: bytes) -> Any:
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(h)


def _step(workers: list[Any], scheduler: Any) -> list[Any]:
    """One step: every worker's container through vLLM's aggregator to the scheduler side."""
    from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.store_connector import (
        AscendStoreConnector,
    )

    outputs = [ModelRunnerOutput(req_ids=[], req_id_to_index={},
                                 kv_connector_output=KVConnectorOutput(kv_cache_events=w()))
               for w in workers]
    merged = KVOutputAggregator(len(workers)).aggregate(outputs)
    AscendStoreConnector.update_connector_output(scheduler, merged.kv_connector_output)
    return list(AscendStoreConnector.take_events(scheduler))


def _container(put_step: int, events: list[Any]) -> Any:
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.store_connector import (
        AscendStoreKVEvents,
        to_vllm_events,
    )

    c = AscendStoreKVEvents(num_workers=1, put_step=put_step)
    c.add_events(to_vllm_events(events))
    return c


def test_vllm_events_carry_the_pool_medium_and_hashes() -> None:
    require("vllm")
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash as conv

    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.store_connector import (
        to_vllm_events,
    )

    r = req("r1", 2 * BLOCK)
    out = to_vllm_events([*stored(r, range(2)), RemovedBlock(r.block_hashes[0])])
    first, second, removed = out
    assert isinstance(first, BlockStored) and isinstance(removed, BlockRemoved)
    # vLLM's external hash form (64-bit ints by default), as its own device events use
    assert first.block_hashes == [conv(r.block_hashes[0])] and first.parent_block_hash is None
    assert second.parent_block_hash == conv(r.block_hashes[0])
    assert removed.block_hashes == [conv(r.block_hashes[0])]
    assert second.token_ids == r.all_token_ids[BLOCK:2 * BLOCK] and second.block_size == BLOCK
    assert {e.medium for e in out} == {"cpu"}


def test_event_is_published_once_every_rank_reported_it() -> None:
    require("vllm")
    r = req("r1", 2 * BLOCK)
    e0, e1 = stored(r, range(2))
    sched = _connector_side()
    # rank 0 reports both blocks now, rank 1 only the first (its save thread is slower)
    got = _step([lambda: _container(1, [e0, e1]), lambda: _container(1, [e0])], sched)
    assert [ev.block_hashes for ev in got] == [[_conv(e0.block_hash)]]
    got = _step([lambda: _container(1, []), lambda: _container(1, [e1])], sched)
    assert [ev.block_hashes for ev in got] == [[_conv(e1.block_hash)]]
    assert sched._kv_cache_events is None  # nothing left over
    assert _step([lambda: _container(1, [])] * 2, sched) == []


def test_ranks_sharing_keys_each_report_their_share() -> None:
    require("vllm")
    backend = LocalBackend(capacity=64 << 20)
    # 4 TP ranks, 2 KV heads: ranks (0, 1) and (2, 3) split each head group's blocks
    workers = [PoolHarness(backend, ctx=events_ctx(tp_size=4, tp_rank=rank),
                           kv_caches=make_kv_caches(heads=1)) for rank in range(4)]
    r = req("r1", 4 * BLOCK)
    for h in workers:
        h.prefill(r, finish=False)
        assert h.worker.wait_idle()
    shares = [h.worker.take_events() for h in workers]
    assert [len(s) for s in shares] == [2, 2, 2, 2]
    assert shares[0] == shares[2] and shares[1] == shares[3]
    assert workers[0].worker.put_step == 2
    published = _step([lambda s=s: _container(2, s) for s in shares], _connector_side())
    assert sorted(ev.block_hashes[0] for ev in published) == sorted(map(_conv, r.block_hashes))
