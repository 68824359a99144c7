# SPDX-License-Identifier: Apache-2.0
"""The pool under vLLM's hybrid KV cache manager: a sliding-window group and a full-attention
group whose layers share tensors (a layer of each group one tensor), as vLLM lays them out.

Two engines' scheduler and worker sides over one ``local`` store: what a hit is (the longest
prefix every group serves), which blocks each group saves and loads (a window's: those vLLM
keeps), the bytes of every loaded block, a failed load reported by request, the keys and KV
events naming the group, and the wait for a queued save of a window's block vLLM gave out
again.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from pool_test_harness import BLOCK, HEAD_SIZE, HEADS, FakeRequest, scheduler_output
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

from vllm_ascend.distributed.kv_transfer.core.kv_groups import NULL_BLOCK, KVGroups
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import LocalBackend
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config import AscendStoreConfig
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.context import PoolContext
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.hybrid import (
    SavedWindowBlocks,
    block_runs,
    hybrid_hit,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.keys import (
    KeyMetadata,
    PoolKey,
    parse_key,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.store_scheduler import (
    KVPoolScheduler,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.store_worker import KVPoolWorker

WINDOW = 2 * BLOCK
NUM_BLOCKS = 96
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
SWA, FULL = 0, 1


def hybrid_kv_cache_config() -> KVCacheConfig:
    """vLLM's groups of a model whose even layers use a window of two blocks."""
    spec = {"block_size": BLOCK, "num_kv_heads": HEADS, "head_size": HEAD_SIZE,
            "dtype": torch.float32}
    return KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([LAYERS[0], LAYERS[2]], SlidingWindowSpec(**spec,
                                                                   sliding_window=WINDOW)),
        KVCacheGroupSpec([LAYERS[1], LAYERS[3]], FullAttentionSpec(**spec))])


GROUPS = KVGroups.from_config(hybrid_kv_cache_config())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def value(tokens: list[int], group: int, tensor: int) -> torch.Tensor:
    """What the fake forward writes into group ``group``'s block of ``tokens`` in a tensor."""
    gen = torch.Generator().manual_seed(hash((tuple(tokens), group, tensor)) & 0x7FFFFFFF)
    return torch.randn((HEADS, BLOCK, 2 * HEAD_SIZE), generator=gen)


class HybridBlocks:
    """``KVCacheBlocks`` stand-in: one list per group."""

    def __init__(self, ids: list[list[int]]) -> None:
        self.ids = ids

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(list(g) for g in self.ids)


class HybridEngine:
    """One engine's pool sides over a KV cache where layers 0/1 and 2/3 share a tensor (a
    layer of each group), with vLLM's block lists (a window's freed blocks are null)."""

    def __init__(self, backend: LocalBackend) -> None:
        self.ctx = PoolContext(model_name="tiny", block_size=BLOCK, num_kv_heads=HEADS,
                               num_layers=4, salt="test", groups=GROUPS)
        self.cfg = AscendStoreConfig.from_dict({"store_retry_interval_s": 0.2})
        self.tensors = [torch.zeros(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE) for _ in range(2)]
        kv = {name: self.tensors[i // 2] for i, name in enumerate(LAYERS)}
        self.worker = KVPoolWorker(self.ctx, self.cfg, backend=backend,
                                   start_lookup_server=False)
        self.worker.register_kv_caches(kv)
        self.scheduler = KVPoolScheduler(self.ctx, self.cfg, lookup_client=self)
        self.lookups: list[list[int]] = []
        self._next = 1  # block 0 is vLLM's null block

    # the lookup client, calling the worker in-process
    failures = 0

    def lookup(self, hashes: list[str], token_end: int) -> int:
        raise AssertionError("a hybrid engine asks for every group's blocks")

    def lookup_groups(self, hashes: list[str], groups: list[int]) -> list[list[bool]]:
        self.lookups.append(groups)
        return self.worker.lookup_groups(hashes, groups)

    def allocate(self, n_tokens: int, computed: int) -> list[list[int]]:
        """vLLM's lists for a request with ``computed`` tokens known: the window's blocks
        wholly before the window of the next token are null."""
        n = cdiv(n_tokens, BLOCK)
        out = []
        for group in GROUPS.groups:
            skipped = group.first_kept(computed)
            ids = [NULL_BLOCK] * skipped + list(range(self._next, self._next + n - skipped))
            self._next += n - skipped
            out.append(ids)
        assert self._next <= NUM_BLOCKS
        return out

    def forward(self, req: FakeRequest, blocks: list[list[int]], start: int, end: int) -> None:
        tokens = req.all_token_ids
        for g, ids in enumerate(blocks):
            for i in range(start // BLOCK, cdiv(end, BLOCK)):
                if ids[i] != NULL_BLOCK:
                    for t, tensor in enumerate(self.tensors):
                        tensor[ids[i]] = value(tokens[i * BLOCK:(i + 1) * BLOCK], g, t)

    def holds(self, req: FakeRequest, blocks: list[list[int]], group: int, pos: int) -> bool:
        chunk = req.all_token_ids[pos * BLOCK:(pos + 1) * BLOCK]
        return all(torch.equal(tensor[blocks[group][pos]], value(chunk, group, t))
                   for t, tensor in enumerate(self.tensors))

    def step(self, out: Any, forward: tuple[FakeRequest, list[list[int]], int, int] | None = None
             ) -> tuple[Any, set[str], set[str]]:
        meta = self.scheduler.build_connector_meta(out)
        self.worker.start_load_kv(meta)
        if forward is not None:
            self.forward(*forward)
        self.worker.wait_for_save(meta)
        sending, recving = self.worker.get_finished(set(out.finished_req_ids))
        return meta, sending, recving

    def prefill(self, req: FakeRequest) -> dict[str, Any]:
        """Schedule ``req`` as vLLM does: the pool's hit loaded (asynchronously), the rest
        computed, its saves done, the request finished."""
        ext, is_async = self.scheduler.get_num_new_matched_tokens(req, 0)
        blocks = self.allocate(req.num_tokens, ext)
        self.scheduler.update_state_after_alloc(req, HybridBlocks(blocks), ext)
        result: dict[str, Any] = {"external": ext, "async": is_async, "blocks": blocks,
                                  "recving": set(), "failed": set()}
        if ext:
            load_meta, _s, recving = self.step(scheduler_output())
            result["loads"] = load_meta.loads
            deadline = time.monotonic() + 10
            while req.request_id not in recving and time.monotonic() < deadline:
                time.sleep(0.005)
                recving |= self.worker.get_finished(set())[1]
            result["recving"] = recving
            result["failed"] = self.worker.take_failed_loads()
            result["errors"] = self.worker.get_block_ids_with_load_errors()
        out = scheduler_output(new=[(req.request_id, [], ext, req.num_tokens - ext)])
        out.scheduled_new_reqs[0].block_ids = tuple(blocks)
        meta, _s, _r = self.step(out, (req, blocks, ext, req.num_tokens))
        result["saves"] = meta.saves
        result["delay_free"], _ = self.scheduler.request_finished(req, tuple(blocks))
        assert self.worker.wait_idle()
        self.step(scheduler_output(finished={req.request_id}))
        return result

    def close(self) -> None:
        self.worker.shutdown()


@pytest.fixture
def engines() -> Any:
    backend = LocalBackend(capacity=64 << 20)
    a, b = HybridEngine(backend), HybridEngine(backend)
    yield a, b, backend
    a.close()
    b.close()


def prompt(n: int, rid: str, seed: int = 0) -> FakeRequest:
    return FakeRequest(rid, [(seed * 7919 + i * 31) % 1000 + 1 for i in range(n)])


# ---------------------------------------------------------------- the rule
def test_a_hit_is_the_longest_prefix_every_group_serves() -> None:
    n = 10 * BLOCK + 2  # 11 hashes, the last one the partial tail
    every = [True] * 11
    # all held: one token less than the prompt
    assert hybrid_hit(GROUPS, [every, every], block_size=BLOCK, token_end=n, num_tokens=n,
                      num_computed=0) == n - 1
    # the window's group lacks block 9: the hit ends where its window needs no block 9
    # (36 tokens: blocks 7 and 8), though the full group holds every block
    window = [i != 9 for i in range(11)]
    assert hybrid_hit(GROUPS, [window, every], block_size=BLOCK, token_end=n, num_tokens=n,
                      num_computed=0) == 9 * BLOCK
    # the window's group needs nothing before its window: blocks 0..6 missing do not matter
    window = [i >= 7 for i in range(11)]
    assert hybrid_hit(GROUPS, [window, every], block_size=BLOCK, token_end=n, num_tokens=n,
                      num_computed=0) == n - 1
    # the full group needs every block: block 3 missing caps the hit at 3 blocks, and the
    # window's group must hold the window before it (blocks 1 and 2; it holds 7.. only)
    full = [i != 3 for i in range(11)]
    assert hybrid_hit(GROUPS, [window, full], block_size=BLOCK, token_end=n, num_tokens=n,
                      num_computed=0) == 0
    assert hybrid_hit(GROUPS, [every, full], block_size=BLOCK, token_end=n, num_tokens=n,
                      num_computed=0) == 3 * BLOCK
    # blocks vLLM has locally are not asked for; no hit beyond them is a miss
    assert hybrid_hit(GROUPS, [[False] * 4 + every[4:], [False] * 4 + every[4:]],
                      block_size=BLOCK, token_end=n, num_tokens=n,
                      num_computed=4 * BLOCK) == n - 1
    assert hybrid_hit(GROUPS, [every, full], block_size=BLOCK, token_end=n, num_tokens=n,
                      num_computed=3 * BLOCK) == 0


def test_block_runs_leave_out_the_null_block() -> None:
    assert block_runs([0, 0, 5, 6, 7], 1, 5) == [(2, [5, 6, 7])]
    assert block_runs([1, 2, 0, 4], 0, 9) == [(0, [1, 2]), (3, [4])]
    assert block_runs([0, 0], 0, 2) == []


def test_keys_name_the_group() -> None:
    meta = KeyMetadata("tiny", 1)
    key = PoolKey(meta, "ab12", group=1)
    assert key.to_string() == "tiny@pcp0@dcp0@head_or_tp_rank:1@pp_rank:0@group:1@ab12"
    assert parse_key(key.to_string()) == key
    assert parse_key(PoolKey(meta, "ab12").to_string()).group is None  # one group: unchanged


# ---------------------------------------------------------------- two engines
def test_a_second_engine_hits_what_the_first_saved(engines: Any) -> None:
    a, b, backend = engines
    req = prompt(10 * BLOCK + 2, "r1")  # 10 full blocks; the partial tail is not pooled
    first = a.prefill(req)
    assert first["external"] == 0 and a.lookups == [[SWA, FULL]] and first["delay_free"]
    # A saved every full block of both groups (all kept while the prompt was computed), each
    # group under keys of its own
    saved = {(j.group, j.first_block + i) for j in first["saves"] for i in range(len(j.hashes))}
    assert saved == {(g, i) for g in (SWA, FULL) for i in range(10)}
    keys = [parse_key(k) for k in backend.stored_keys()]
    assert sorted(k.group for k in keys if isinstance(k, PoolKey)) == [0] * 10 + [1] * 10

    again = prompt(10 * BLOCK + 2, "r2")
    second = b.prefill(again)
    hit = 10 * BLOCK
    assert second["external"] == hit and second["async"]  # loads are asynchronous
    assert second["recving"] == {"r2"} and not second["failed"] and not second["errors"]
    blocks = second["blocks"]
    # the window's group loads only what vLLM keeps for the window of the token after the hit
    kept = GROUPS.groups[SWA].first_kept(hit)
    assert kept == 8 and blocks[SWA][:kept] == [NULL_BLOCK] * kept
    loaded = {(j.group, j.first_block + i): bid for j in second["loads"]
              for i, bid in enumerate(j.block_ids)}
    assert sorted(loaded) == [(SWA, i) for i in range(kept, 10)] + [(FULL, i)
                                                                    for i in range(10)]
    assert NULL_BLOCK not in loaded.values()
    for group, pos in loaded:
        assert b.holds(again, blocks, group, pos), (group, pos)
    # B computed the partial tail only, which is not pooled: it saved nothing
    assert second["saves"] == []


def test_a_missing_window_block_shortens_the_hit(engines: Any) -> None:
    a, b, backend = engines
    req = prompt(10 * BLOCK + 2, "r1", seed=1)
    a.prefill(req)
    gone = [k for k in backend.stored_keys()
            if parse_key(k).group == SWA and parse_key(k).chunk_hash == a.scheduler
            .request_hashes(req, req.num_tokens)[9]]
    assert len(gone) == 1 and backend.remove(gone) == 1
    again = prompt(10 * BLOCK + 2, "r2", seed=1)
    ext, _async = b.scheduler.get_num_new_matched_tokens(again, 0)
    # 41 and 40 tokens need the window's block 9; 36 needs blocks 7 and 8 only
    assert ext == 9 * BLOCK


def test_a_failed_load_is_reported_by_request(engines: Any) -> None:
    """With several groups vLLM takes failed loads by request (never block ids)."""
    a, b, backend = engines
    req = prompt(6 * BLOCK, "r1", seed=2)
    a.prefill(req)
    again = prompt(6 * BLOCK, "r2", seed=2)
    ext, is_async = b.scheduler.get_num_new_matched_tokens(again, 0)
    assert ext == 6 * BLOCK - 1 and is_async
    backend.remove([k for k in backend.stored_keys() if parse_key(k).group == FULL][:1])
    blocks = b.allocate(again.num_tokens, ext)
    b.scheduler.update_state_after_alloc(again, HybridBlocks(blocks), ext)
    b.step(scheduler_output())
    deadline = time.monotonic() + 10
    recving: set[str] = set()
    while "r2" not in recving and time.monotonic() < deadline:
        time.sleep(0.005)
        recving |= b.worker.get_finished(set())[1]
    assert recving == {"r2"}
    assert b.worker.take_failed_loads() == {"r2"}
    assert b.worker.get_block_ids_with_load_errors() == set()


def test_saves_skip_the_null_block_and_wait_for_a_reused_window_block() -> None:
    """A window's block saved in one step and given out again by vLLM in a later one: the
    workers wait for the save that reads it first, once."""
    engine = HybridEngine(LocalBackend(capacity=64 << 20))
    try:
        s = engine.scheduler
        req = prompt(4 * BLOCK, "r1", seed=3)
        s.get_num_new_matched_tokens(req, 0)
        s.update_state_after_alloc(req, HybridBlocks([[0, 0, 5, 6], [1, 2, 3, 4]]), 0)
        out = scheduler_output(new=[("r1", [], 0, req.num_tokens)])
        out.scheduled_new_reqs[0].block_ids = ([0, 0, 5, 6], [1, 2, 3, 4])
        meta = s.build_connector_meta(out)
        runs = sorted((j.group, j.first_block, j.block_ids) for j in meta.saves)
        assert runs == [(SWA, 2, [5, 6]), (FULL, 0, [1, 2, 3, 4])]
        other = prompt(BLOCK, "r2", seed=4)
        s.get_num_new_matched_tokens(other, 0)
        s.update_state_after_alloc(other, HybridBlocks([[9], [5]]), 0)
        out = scheduler_output(new=[("r2", [], 0, BLOCK)])
        out.scheduled_new_reqs[0].block_ids = ([9], [5])  # block 5 back, in the full group
        assert s.build_connector_meta(out).wait_saves == {"r1"}
        out = scheduler_output(cached=[("r2", [7], BLOCK, 1)])
        out.scheduled_cached_reqs.new_block_ids = [([5], [7])]
        assert s.build_connector_meta(out).wait_saves == set()  # waited for once
    finally:
        engine.close()


def test_saved_window_blocks_are_bounded_by_block_ids() -> None:
    saved = SavedWindowBlocks()
    saved.saving("a", [1, 2])
    saved.saving("b", [2, 3])
    assert len(saved) == 3
    assert saved.reused([2, 4]) == {"b"} and len(saved) == 2


def test_kv_events_name_the_group() -> None:
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.events import (
        RemovedBlock,
        StoredBlock,
    )
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.store_connector import (
        to_vllm_events,
    )

    stored, removed = to_vllm_events([
        StoredBlock(b"\x01" * 32, None, tuple(range(BLOCK)), BLOCK, group=SWA),
        RemovedBlock(b"\x02" * 32, group=FULL)])
    assert stored.group_idx == SWA and removed.group_idx == FULL


def test_the_group_layout_is_in_the_cache_fingerprint() -> None:
    """An instance with the hybrid manager off (one group, a tensor a layer) or with another
    window hashes the same tokens to other keys: it never reads these objects."""
    from types import SimpleNamespace

    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.context import (
        context_from_vllm,
    )

    model = SimpleNamespace(model="/models/tiny", dtype="float32", use_mla=False,
                            get_total_num_kv_heads=lambda: HEADS,
                            get_num_layers=lambda parallel: 4)
    cfg = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        model_config=model, cache_config=SimpleNamespace(block_size=BLOCK, cache_dtype="auto"),
        kv_transfer_config=SimpleNamespace(kv_role="kv_both", engine_id="e"))
    hybrid = context_from_vllm(cfg, hybrid_kv_cache_config())
    assert hybrid.hybrid and hybrid.groups == GROUPS
    assert context_from_vllm(cfg, hybrid_kv_cache_config()).salt == hybrid.salt
    single = context_from_vllm(cfg, None)
    assert not single.hybrid and single.salt != hybrid.salt and "hma" not in single.salt
    other = hybrid_kv_cache_config()
    spec = other.kv_cache_groups[0].kv_cache_spec
    other.kv_cache_groups[0] = KVCacheGroupSpec(other.kv_cache_groups[0].layer_names,
                                                SlidingWindowSpec(
                                                    block_size=BLOCK, num_kv_heads=HEADS,
                                                    head_size=HEAD_SIZE, dtype=spec.dtype,
                                                    sliding_window=3 * BLOCK))
    assert context_from_vllm(cfg, other).salt not in (hybrid.salt, single.salt)


def test_the_worker_finishes_a_queued_save_before_a_step_that_reuses_its_block() -> None:
    """A save still queued (the store slow) when a step's metadata names its request in
    ``wait_saves``: ``start_load_kv`` returns only once the save read the block."""
    import threading

    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.store_contract import (
        AscendConnectorMetadata,
        TransferJob,
    )

    release, order = threading.Event(), []

    class SlowStore(LocalBackend):
        def put(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]
                ) -> list[int]:
            release.wait(10)
            order.append("put")
            return super().put(keys, addrs, sizes)

    engine = HybridEngine(SlowStore(capacity=64 << 20))
    try:
        job = TransferJob("r1", ["ab" * 32], [5], 2, 3 * BLOCK, group=SWA)
        engine.worker.wait_for_save(AscendConnectorMetadata(saves=[job]))
        threading.Timer(0.3, release.set).start()
        engine.worker.start_load_kv(AscendConnectorMetadata(wait_saves={"r1"}))
        order.append("step")
        assert order == ["put", "step"]
    finally:
        release.set()
        engine.close()


def test_the_worker_refuses_a_lookup_of_groups_it_does_not_have() -> None:
    engine = HybridEngine(LocalBackend(capacity=64 << 20))
    try:
        with pytest.raises(ValueError, match=r"KV cache groups \[2\]: this engine has \[0, 1\]"):
            engine.worker.lookup_groups(["ab"], [0, 2])
    finally:
        engine.close()
