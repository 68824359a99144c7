# SPDX-License-Identifier: Apache-2.0
"""The pool's scheduler and worker sides driven like vLLM drives them.

Lookup, full hit reporting one token less, save-skip, partial chunks,
synchronous / async / layerwise loads, failed loads reported for recompute,
a store that went away, delayed frees, preemption, TP key sharing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pool_test_harness import (
    BLOCK,
    Blocks,
    FakeRequest,
    PoolHarness,
    make_kv_caches,
    scheduler_output,
)

from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import LocalBackend
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.context import PoolContext
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.errors import (
    BackendUnavailableError,
)


def req(rid: str, n: int, seed: int = 0) -> FakeRequest:
    return FakeRequest(rid, [(seed * 7919 + i * 31) % 997 + 3 for i in range(n)])


def pair(backend: Any = None, **cfg: Any) -> tuple[PoolHarness, PoolHarness]:
    """Two engines sharing one pool (the second starts with an empty device cache)."""
    backend = LocalBackend(capacity=64 << 20) if backend is None else backend
    return PoolHarness(backend, **cfg), PoolHarness(backend, **cfg)


def assert_loaded(h: PoolHarness, request: FakeRequest, blocks: list[int], n_blocks: int) -> None:
    for i in range(n_blocks):
        for layer in range(len(h.layers)):
            torch.testing.assert_close(h.kv[h.layers[layer]][blocks[i]],
                                       h.expected(request, i, layer), rtol=0, atol=0)


# ---------------------------------------------------------------------- lookup and hits
@pytest.mark.parametrize("extra", [0, 1, 2])
def test_second_engine_hits_what_the_first_saved(extra: int) -> None:
    a, b = pair()
    n = 4 * BLOCK + extra
    first = a.prefill(req("r1", n))
    assert first["external"] == 0
    assert first["delay_free"] is True and first["sending"] == {"r1"}
    second = b.prefill(req("r2", n))
    # a full hit (length exactly k blocks) reports one token less; otherwise the full blocks
    assert second["external"] == (n - 1 if extra == 0 else 4 * BLOCK)
    assert second["errors"] == set()
    assert_loaded(b, req("r2", n), second["blocks"], 4 if extra else 3)
    assert b.worker.recorder.total("pool_loaded_blocks") == 4
    assert b.scheduler.recorder.total("pool_hit_tokens") == second["external"]


def test_miss_below_one_block_and_on_a_different_prefix() -> None:
    a, b = pair()
    a.prefill(req("r1", 3 * BLOCK))
    assert b.scheduler.get_num_new_matched_tokens(req("x", BLOCK - 1), 0) == (0, False)
    assert b.scheduler.get_num_new_matched_tokens(req("y", 3 * BLOCK, seed=5), 0) == (0, False)
    assert b.scheduler.recorder.total("pool_miss_tokens") == 3 * BLOCK


def test_partial_prefix_hit_stops_at_the_first_missing_block() -> None:
    a, b = pair()
    a.prefill(req("r1", 2 * BLOCK))
    longer = req("r2", 5 * BLOCK)  # shares the first two blocks
    assert b.scheduler.get_num_new_matched_tokens(longer, 0) == (2 * BLOCK, False)
    # local prefix-cache hits are not loaded again
    assert b.scheduler.get_num_new_matched_tokens(longer, BLOCK) == (BLOCK, False)
    assert b.scheduler.get_num_new_matched_tokens(longer, 2 * BLOCK) == (0, False)


def test_lookup_of_a_length_1_mod_block_size_prompt_hits() -> None:
    # vLLM's ExampleConnector saves align(len) and looks up align(len - 1): never hits these
    a, b = pair()
    a.prefill(req("r1", 3 * BLOCK + 1))
    assert b.scheduler.get_num_new_matched_tokens(req("r2", 3 * BLOCK + 1), 0)[0] == 3 * BLOCK


# ---------------------------------------------------------------------- saves
def test_save_skips_the_prefix_already_in_the_pool() -> None:
    backend = LocalBackend(capacity=64 << 20)
    a, b = pair(backend)
    a.prefill(req("r1", 2 * BLOCK))
    assert len(backend) == 2
    result = b.prefill(req("r2", 5 * BLOCK))  # loads two blocks, computes and saves three
    assert result["external"] == 2 * BLOCK
    saves = result["meta"].saves
    assert [job.first_block for job in saves] == [2] and len(saves[0].hashes) == 3
    assert b.worker.recorder.total("pool_saved_blocks") == 3
    assert len(backend) == 5


def test_blocks_stored_by_someone_else_are_skipped_by_the_worker() -> None:
    backend = LocalBackend(capacity=64 << 20)
    a, b = pair(backend)
    a.prefill(req("r1", 3 * BLOCK))
    # b computes the same prompt from scratch (its scheduler saw no hit: lookups disabled)
    b.scheduler.can_load = False
    b.prefill(req("r2", 3 * BLOCK))
    assert b.worker.recorder.total("pool_skipped_save_blocks") == 3
    assert b.worker.recorder.total("pool_saved_blocks") == 0


def test_chunked_prefill_saves_each_chunk_once() -> None:
    backend = LocalBackend(capacity=64 << 20)
    h = PoolHarness(backend)
    r = req("r1", 5 * BLOCK + 2)
    h.scheduler.get_num_new_matched_tokens(r, 0)
    blocks = h.alloc(6)
    h.scheduler.update_state_after_alloc(r, Blocks(blocks[:3]), 0)
    m1, *_ = h.step(scheduler_output(new=[("r1", blocks[:3], 0, 2 * BLOCK + 1)]),
                    forward=[(r, blocks, 0, 2 * BLOCK + 1)])
    m2, *_ = h.step(scheduler_output(cached=[("r1", blocks[3:], 2 * BLOCK + 1, 3 * BLOCK + 1)]),
                    forward=[(r, blocks, 2 * BLOCK + 1, 5 * BLOCK + 2)])
    m3, *_ = h.step(scheduler_output(cached=[("r1", None, 5 * BLOCK + 2, 1)]))  # decode
    assert [(j.first_block, len(j.hashes)) for j in m1.saves] == [(0, 2)]
    assert [(j.first_block, len(j.hashes)) for j in m2.saves] == [(2, 3)]
    assert m3.saves == []  # only prompt blocks are saved
    assert h.worker.wait_idle()
    assert len(backend) == 5


def test_discard_partial_chunks_false_saves_and_hits_the_prompt_tail() -> None:
    backend = LocalBackend(capacity=64 << 20)
    a, b = pair(backend, discard_partial_chunks=False)
    n = 3 * BLOCK + 2
    first = a.prefill(req("r1", n))
    assert first["meta"].saves[0].token_end == n
    assert len(backend) == 4  # three full blocks and the tail
    second = b.prefill(req("r2", n))
    assert second["external"] == n - 1  # full hit, tail included
    assert_loaded(b, req("r2", n), second["blocks"], 3)
    # a longer prompt with the same first n tokens does not match the tail
    assert b.scheduler.get_num_new_matched_tokens(req("r3", n + 2), 0)[0] == 3 * BLOCK


def test_discard_partial_chunks_true_never_saves_a_tail() -> None:
    backend = LocalBackend(capacity=64 << 20)
    a, _b = pair(backend)
    a.prefill(req("r1", 3 * BLOCK + 2))
    assert len(backend) == 3


def test_consumer_neither_saves_nor_loads_unless_asked() -> None:
    backend = LocalBackend(capacity=64 << 20)
    producer = PoolHarness(backend)
    producer.prefill(req("r1", 2 * BLOCK))
    ctx = PoolContext(model_name="tiny", block_size=BLOCK, num_kv_heads=2, kv_role="kv_consumer",
                      salt="test")
    consumer = PoolHarness(backend, ctx=ctx)
    assert consumer.scheduler.get_num_new_matched_tokens(req("r2", 2 * BLOCK), 0) == (0, False)
    result = consumer.prefill(req("r3", 3 * BLOCK, seed=9))
    assert result["meta"].saves == [] and result["delay_free"] is False
    loading = PoolHarness(backend, ctx=ctx, consumer_is_to_load=True, consumer_is_to_put=True)
    assert loading.scheduler.get_num_new_matched_tokens(req("r4", 2 * BLOCK), 0)[0] == \
        2 * BLOCK - 1
    assert loading.prefill(req("r5", 3 * BLOCK, seed=11))["meta"].saves


# ---------------------------------------------------------------------- async and layerwise
def test_async_load_reports_finished_recving() -> None:
    a, b = pair(load_async=True)
    a.prefill(req("r1", 3 * BLOCK + 1))
    result = b.prefill(req("r2", 3 * BLOCK + 1))
    assert result["async"] is True and result["external"] == 3 * BLOCK
    assert "r2" in result["recving"]
    assert result["load_meta"].loads[0].is_async
    assert_loaded(b, req("r2", 3 * BLOCK + 1), result["blocks"], 3)


def test_layerwise_save_and_load_per_layer() -> None:
    backend = LocalBackend(capacity=64 << 20)
    a, b = pair(backend, use_layerwise=True)
    r = req("r1", 3 * BLOCK)
    a.scheduler.get_num_new_matched_tokens(r, 0)
    blocks = a.alloc(3)
    a.scheduler.update_state_after_alloc(r, Blocks(blocks), 0)
    meta = a.scheduler.build_connector_meta(scheduler_output(new=[("r1", blocks, 0, 3 * BLOCK)]))
    a.worker.start_load_kv(meta)
    a.forward(r, blocks, 0, 3 * BLOCK)
    for name in a.layers:
        a.worker.wait_for_layer_load(name)
        a.worker.save_kv_layer(name, meta)
    a.worker.wait_for_save(meta)
    assert a.worker.wait_idle()
    assert len(backend) == 3 * len(a.layers)  # one object per block and layer
    assert all("@pp_rank" not in k for k in backend.stored_keys())

    r2 = req("r2", 3 * BLOCK)
    ext, is_async = b.scheduler.get_num_new_matched_tokens(r2, 0)
    assert (ext, is_async) == (3 * BLOCK - 1, False)
    blocks2 = b.alloc(3)
    b.scheduler.update_state_after_alloc(r2, Blocks(blocks2), ext)
    meta2 = b.scheduler.build_connector_meta(scheduler_output(new=[("r2", blocks2, ext, 1)]))
    b.worker.start_load_kv(meta2)
    for name in b.layers:
        b.worker.wait_for_layer_load(name)
    assert b.worker.get_block_ids_with_load_errors() == set()
    assert_loaded(b, r2, blocks2, 3)


def test_layerwise_step_without_loads_does_not_wait_for_an_earlier_steps_layers() -> None:
    """vLLM (0.32+) calls ``start_load_kv`` after the forward pass on steps without
    synchronous loads: the forward of such a step must not wait for, nor report again, the
    layer loads of the step before (here: one that timed out)."""
    import threading
    import time

    backend = LocalBackend(capacity=64 << 20)
    a, b = pair(backend, use_layerwise=True, load_timeout_s=0.3)
    r1 = req("r1", 3 * BLOCK)
    a.scheduler.get_num_new_matched_tokens(r1, 0)
    blocks1 = a.alloc(3)
    a.scheduler.update_state_after_alloc(r1, Blocks(blocks1), 0)
    meta1 = a.scheduler.build_connector_meta(scheduler_output(new=[("r1", blocks1, 0, 3 * BLOCK)]))
    a.forward(r1, blocks1, 0, 3 * BLOCK)
    for name in a.layers:
        a.worker.save_kv_layer(name, meta1)
    assert a.worker.wait_idle()
    r = req("r2", 3 * BLOCK)
    ext, _ = b.scheduler.get_num_new_matched_tokens(r, 0)
    assert ext == 3 * BLOCK - 1
    blocks = b.alloc(3)
    b.scheduler.update_state_after_alloc(r, Blocks(blocks), ext)
    gate = threading.Event()
    original = b.worker._run_load
    b.worker._run_load = lambda task: (gate.wait(10), original(task))  # the store hangs
    try:
        meta = b.scheduler.build_connector_meta(scheduler_output(new=[("r2", blocks, ext, 1)]))
        b.worker.start_load_kv(meta)  # a step with loads: started before the forward
        for name in b.layers:
            b.worker.wait_for_layer_load(name, meta)
        assert b.worker.get_block_ids_with_load_errors() == set(blocks)  # recomputed
        # the next step (r2 recomputes): its loads are started after its forward
        nxt = b.scheduler.build_connector_meta(scheduler_output(cached=[("r2", None, 0, 3 * BLOCK)]))
        start = time.monotonic()
        for name in b.layers:
            b.worker.wait_for_layer_load(name, nxt)
        assert time.monotonic() - start < 0.2
        b.worker.start_load_kv(nxt)
        assert b.worker.get_block_ids_with_load_errors() == set()  # reported once
    finally:
        gate.set()


# ---------------------------------------------------------------------- failures
def test_failed_load_reports_its_blocks_for_recompute() -> None:
    backend = LocalBackend(capacity=64 << 20)
    a, b = pair(backend)
    a.prefill(req("r1", 4 * BLOCK))
    r = req("r2", 4 * BLOCK)
    ext, _ = b.scheduler.get_num_new_matched_tokens(r, 0)
    # the third block disappears between lookup and load (eviction by another instance)
    victim = backend.stored_keys()[2]
    backend.remove([victim])
    blocks = b.alloc(4)
    b.scheduler.update_state_after_alloc(r, Blocks(blocks), ext)
    _meta, _s, _r, errors = b.step(scheduler_output(new=[("r2", blocks, ext, 1)]))
    assert errors == {blocks[2]}
    assert b.worker.recorder.total("pool_failed_load_blocks") == 1
    assert b.worker.get_block_ids_with_load_errors() == set()  # reported once


class FlakyBackend(LocalBackend):
    """A local pool whose store can be switched off (as if the master died)."""

    down = False

    def _check(self, op: str) -> None:
        if self.down:
            raise BackendUnavailableError(f"store down during {op}", backend="flaky", op=op,
                                          rc=-900)

    def exists(self, keys: list[str]) -> list[int]:
        self._check("exists")
        return super().exists(keys)

    def put(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        self._check("put")
        return super().put(keys, addrs, sizes)

    def get(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        self._check("get")
        return super().get(keys, addrs, sizes)


def test_a_store_that_went_away_means_misses_and_counted_drops() -> None:
    backend = FlakyBackend(capacity=64 << 20)
    a, b = pair(backend, store_retry_interval_s=60.0)
    a.prefill(req("r1", 2 * BLOCK))
    backend.down = True
    assert b.scheduler.get_num_new_matched_tokens(req("r2", 2 * BLOCK), 0) == (0, False)
    result = b.prefill(req("r3", 3 * BLOCK, seed=3))
    assert result["external"] == 0 and result["sending"] == {"r3"}  # blocks still released
    assert b.worker.recorder.total("pool_dropped_save_blocks", cause="store_unavailable") == 3
    # the guard is tripped: no further store calls until the retry interval passed
    assert not b.worker.guard.available()
    backend.down = False
    assert b.scheduler.get_num_new_matched_tokens(req("r4", 2 * BLOCK), 0) == (0, False)
    b.worker.guard._down_until = 0.0
    assert b.scheduler.get_num_new_matched_tokens(req("r5", 2 * BLOCK), 0)[0] == 2 * BLOCK - 1


def test_store_dying_between_lookup_and_load_fails_the_blocks() -> None:
    backend = FlakyBackend(capacity=64 << 20)
    a, b = pair(backend)
    a.prefill(req("r1", 2 * BLOCK + 1))
    r = req("r2", 2 * BLOCK + 1)
    ext, _ = b.scheduler.get_num_new_matched_tokens(r, 0)
    backend.down = True
    blocks = b.alloc(3)
    b.scheduler.update_state_after_alloc(r, Blocks(blocks), ext)
    _m, _s, _r, errors = b.step(scheduler_output(new=[("r2", blocks, ext, 1)]))
    assert errors == set(blocks[:2])


def test_full_save_queue_drops_and_counts() -> None:
    import threading
    import time

    h = PoolHarness(LocalBackend(capacity=64 << 20), max_pending_saves=1)
    gate = threading.Event()
    original = h.worker._run_save
    h.worker._send._run = lambda task: (gate.wait(5), original(task))
    results = [h.prefill(req("r0", 2 * BLOCK, seed=0), finish=False)]
    deadline = time.monotonic() + 5
    while h.worker._send.depth and time.monotonic() < deadline:
        time.sleep(0.005)  # the thread took r0's save and waits at the gate
    results += [h.prefill(req(f"r{i}", 2 * BLOCK, seed=i), finish=False) for i in (1, 2)]
    gate.set()
    assert h.worker.wait_idle()
    assert all(r["meta"].saves for r in results)
    assert h.worker.recorder.total("pool_dropped_save_blocks", cause="queue_full") == 2
    assert h.worker.recorder.total("pool_saved_blocks") == 4
    assert not h.worker._pending.has("r2")  # a dropped save holds no blocks


# ---------------------------------------------------------------------- lifecycle
def test_finished_request_keeps_blocks_until_its_saves_are_done() -> None:
    import threading

    backend = LocalBackend(capacity=64 << 20)
    h = PoolHarness(backend)
    gate = threading.Event()
    original = h.worker._run_save
    h.worker._send._run = lambda task: (gate.wait(5), original(task))
    result = h.prefill(req("r1", 2 * BLOCK), finish=False)
    delay, _ = h.scheduler.request_finished(req("r1", 2 * BLOCK), result["blocks"])
    assert delay is True
    _m, sending, _r, _e = h.step(scheduler_output(finished={"r1"}))
    assert sending == set()  # save still pending: blocks stay held
    gate.set()
    assert h.worker.wait_idle()
    _m, sending, _r, _e = h.step(scheduler_output())
    assert sending == {"r1"}
    _m, sending, _r, _e = h.step(scheduler_output())
    assert sending == set()  # reported exactly once


def test_request_without_saves_is_freed_at_once() -> None:
    h = PoolHarness(LocalBackend(capacity=1 << 20))
    r = req("short", BLOCK - 1)
    assert h.prefill(r)["delay_free"] is False


def test_preemption_waits_for_pending_saves() -> None:
    import threading

    h = PoolHarness(LocalBackend(capacity=64 << 20))
    gate = threading.Event()
    original = h.worker._run_save
    h.worker._send._run = lambda task: (gate.wait(0.3), original(task))
    h.prefill(req("r1", 2 * BLOCK), finish=False)
    assert h.worker._pending.has("r1")
    h.worker.handle_preemptions({"r1"})  # returns only once the save is done
    assert not h.worker._pending.has("r1")


def test_resumed_request_loads_into_its_new_blocks() -> None:
    backend = LocalBackend(capacity=64 << 20)
    a, b = pair(backend)
    a.prefill(req("r1", 3 * BLOCK))
    r = req("r2", 3 * BLOCK)
    r.output_token_ids = [5, 6]
    ext, _ = b.scheduler.get_num_new_matched_tokens(r, 0)
    assert ext == 3 * BLOCK  # prompt blocks hit; generated tokens are computed
    blocks = b.alloc(4)
    b.scheduler.update_state_after_alloc(r, Blocks(blocks), ext)
    meta, *_ = b.step(scheduler_output(cached=[("r2", blocks, ext, 2)], resumed={"r2"}))
    assert meta.loads and meta.loads[0].block_ids == blocks[:3]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(n=st.integers(1, 9 * BLOCK), extra=st.integers(0, 2 * BLOCK),
       partial=st.booleans())
def test_any_prefix_length_round_trips(n: int, extra: int, partial: bool) -> None:
    backend = LocalBackend(capacity=64 << 20)
    a, b = pair(backend, discard_partial_chunks=not partial)
    a.prefill(req("r1", n))
    r = req("r2", n + extra)
    ext, _ = b.scheduler.get_num_new_matched_tokens(r, 0)
    full = n // BLOCK * BLOCK
    if extra == 0:
        expected = n - 1 if (partial or n % BLOCK == 0) and n > 0 else full
    else:
        expected = full
    expected = max(0, min(expected, r.num_tokens - 1)) if n >= BLOCK or partial else 0
    if not partial and n < BLOCK:
        expected = 0
    assert ext == expected
    if ext:
        result = b.prefill(r)
        assert result["errors"] == set()
        assert_loaded(b, r, result["blocks"], ext // BLOCK)


# ---------------------------------------------------------------------- tensor parallel
def test_tp_ranks_with_the_same_heads_split_the_saves() -> None:
    backend = LocalBackend(capacity=64 << 20)
    # 4 TP ranks, 2 KV heads: ranks (0, 1) and (2, 3) hold the same heads
    workers = []
    for rank in range(4):
        ctx = PoolContext(model_name="tiny", block_size=BLOCK, tp_size=4, tp_rank=rank,
                          num_kv_heads=2, salt="test")
        h = PoolHarness(backend, ctx=ctx, kv_caches=make_kv_caches(heads=1))
        workers.append(h)
    r = req("r1", 4 * BLOCK)
    for h in workers:
        h.prefill(r, finish=False)
        assert h.worker.wait_idle()
    keys = backend.stored_keys()
    assert len(keys) == 8  # 4 blocks x 2 head groups, each written once
    assert {k.split("@")[3] for k in keys} == {"head_or_tp_rank:0", "head_or_tp_rank:1"}
    saved = [h.worker.recorder.total("pool_saved_blocks") for h in workers]
    assert saved == [2, 2, 2, 2]


def test_lookup_rank_checks_every_head_group_on_a_shared_store() -> None:
    class Shared(LocalBackend):
        shared_across_processes = True

    backend = Shared(capacity=64 << 20)
    ctx0 = PoolContext(model_name="tiny", block_size=BLOCK, tp_size=2, tp_rank=0,
                       num_kv_heads=2, salt="test")
    ctx1 = PoolContext(model_name="tiny", block_size=BLOCK, tp_size=2, tp_rank=1,
                       num_kv_heads=2, salt="test")
    h0 = PoolHarness(backend, ctx=ctx0, kv_caches=make_kv_caches(heads=1))
    h1 = PoolHarness(backend, ctx=ctx1, kv_caches=make_kv_caches(heads=1))
    r = req("r1", 3 * BLOCK)
    h0.prefill(r, finish=False)
    assert h0.worker.wait_idle()
    # rank 1 did not save yet: rank 0's lookup must not report the blocks
    assert h0.scheduler.get_num_new_matched_tokens(req("r2", 3 * BLOCK), 0) == (0, False)
    h1.prefill(r, finish=False)
    assert h1.worker.wait_idle()
    assert h0.scheduler.get_num_new_matched_tokens(req("r3", 3 * BLOCK), 0)[0] == 3 * BLOCK - 1


def test_host_staging_path_round_trips() -> None:
    backend = LocalBackend(capacity=64 << 20)
    a, b = pair(backend)
    for h in (a, b):
        h.worker._staging = True  # as with a device KV cache and a host-only backend
    a.prefill(req("r1", 3 * BLOCK))
    result = b.prefill(req("r2", 3 * BLOCK + 1))
    assert result["external"] == 3 * BLOCK and result["errors"] == set()
    assert_loaded(b, req("r2", 3 * BLOCK + 1), result["blocks"], 3)


def test_consumer_putting_for_a_pipeline_parallel_prefill_is_refused() -> None:
    """Upstream re-keys such saves per prefill stage; ours would store keys that P never
    hits, so the combination fails at start-up with the key named, not silently."""
    from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError

    backend = LocalBackend(capacity=64 << 20)
    ctx = PoolContext(model_name="tiny", block_size=BLOCK, num_kv_heads=2, kv_role="kv_consumer",
                      salt="test")
    with pytest.raises(ConfigError, match="prefill_pp_size=2 with consumer_is_to_put") as info:
        PoolHarness(backend, ctx=ctx, consumer_is_to_put=True, prefill_pp_size=2)
    assert info.value.key == "prefill_pp_size" and info.value.value == 2
    # the key alone (a producer, or a consumer that does not put) changes nothing
    PoolHarness(backend, prefill_pp_size=2)
    PoolHarness(backend, ctx=ctx, consumer_is_to_load=True, prefill_pp_size=2)
