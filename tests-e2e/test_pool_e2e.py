# SPDX-License-Identifier: Apache-2.0
"""AscendStoreConnector end to end: real vLLM CPU engines, a real Mooncake Store.

* A second engine (a new process) hits the prefix the first one saved in a
  Mooncake pool held by ``mooncake_client`` (the first engine is gone by
  then), for prompts of exactly k blocks, k blocks + 1 and k blocks + 2, and
  produces the tokens of the run without any pool.
* One engine with a small device KV cache gets an evicted prefix back from the
  embedded ``local`` pool.
* The store killed mid-run: lookups miss, saves are dropped, requests are
  recomputed, the engine serves on and the client sees no error.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Engine children import this module for the stats helper below.
sys.path.insert(0, str(Path(__file__).parent))

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.slow]

BLOCK = 32
K = 3
MAX_TOKENS = 8


def _prompt(seed: int, n: int) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(3, 1000) for _ in range(n)]


#: Exactly k blocks, k blocks + 1 (vLLM's ExampleConnector never hits this one), k blocks + 2.
SHARED = [_prompt(1, K * BLOCK), _prompt(2, K * BLOCK + 1), _prompt(3, K * BLOCK + 2)]
EVICTED = _prompt(10, 4 * BLOCK)
FILLERS = [_prompt(11, 12 * BLOCK), _prompt(12, 12 * BLOCK)]
KILLED = [_prompt(20, 2 * BLOCK + 5), _prompt(21, 3 * BLOCK)]
ALL_PROMPTS = [*SHARED, EVICTED, *FILLERS, *KILLED]


def pool_stats(llm: Any) -> dict[str, float]:
    """Runs inside an engine process: totals of the pool's scheduler and worker metrics."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler
    worker = get_kv_transfer_group().connector_worker
    out = {name: sched.recorder.total(name) for name in
           ("pool_lookups", "pool_hit_tokens", "pool_miss_tokens", "pool_lookup_failures")}
    out.update({name: worker.recorder.total(name) for name in
                ("pool_loaded_blocks", "pool_saved_blocks", "pool_failed_load_blocks",
                 "pool_skipped_save_blocks")})
    out["pool_dropped_save_blocks"] = sum(
        worker.recorder.total("pool_dropped_save_blocks", cause=c)
        for c in ("store_unavailable", "store_error", "error", "queue_full"))
    return out


def _kv(**extra: Any) -> dict[str, Any]:
    return {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": extra}


@pytest.fixture(scope="module")
def baseline(tiny_model: Path) -> dict[tuple[int, ...], list[int]]:
    """Tokens of every prompt from an engine without any connector."""
    from ascend_kv_testing.engines import EngineProcess

    with EngineProcess(tiny_model) as engine:
        outs = engine.generate(ALL_PROMPTS, max_tokens=MAX_TOKENS)
    return {tuple(p): o.token_ids for p, o in zip(ALL_PROMPTS, outs, strict=True)}


@pytest.fixture
def holder(mooncake_master: Any) -> Iterator[Any]:
    """A ``mooncake_client`` holding the pool's memory across engine lifetimes."""
    from ascend_kv_testing.mooncake import MooncakeSegmentHolder

    h = MooncakeSegmentHolder(mooncake_master, segment_size="256MB").start()
    try:
        yield h
    finally:
        h.stop()


def test_second_engine_hits_the_prefix_the_first_saved(tiny_model: Path, mooncake_master: Any,
                                                       holder: Any, baseline: dict) -> None:
    from ascend_kv_testing.engines import EngineProcess

    kv = _kv(backend="mooncake", mooncake=mooncake_master.config(global_segment_size=0,
                                                                 local_buffer_size="32MB"))
    with EngineProcess(tiny_model, kv) as first:
        cold = first.generate(SHARED, max_tokens=MAX_TOKENS)
        assert first.wait_idle()
        stats_a = first.call(f"{__name__}:pool_stats")
    assert [o.num_cached_tokens for o in cold] == [0, 0, 0]
    assert stats_a["pool_saved_blocks"] == 3 * K
    # the first engine is gone; its blocks live in mooncake_client's segment
    with EngineProcess(tiny_model, kv) as second:
        warm = second.generate(SHARED, max_tokens=MAX_TOKENS)
        stats_b = second.call(f"{__name__}:pool_stats")
    assert [o.num_cached_tokens for o in warm] == [K * BLOCK - 1, K * BLOCK, K * BLOCK]
    assert stats_b["pool_hit_tokens"] == 3 * K * BLOCK - 1
    assert stats_b["pool_loaded_blocks"] == 3 * K
    assert stats_b["pool_failed_load_blocks"] == 0
    for prompt, a, b in zip(SHARED, cold, warm, strict=True):
        assert a.token_ids == baseline[tuple(prompt)]
        assert b.token_ids == baseline[tuple(prompt)], f"prompt of {len(prompt)} tokens"


def test_local_pool_returns_a_prefix_evicted_from_the_device(tiny_model: Path,
                                                              baseline: dict) -> None:
    from ascend_kv_testing.engines import EngineProcess

    # 16 device blocks: the two 12-block fillers push the first prompt out of vLLM's cache
    with EngineProcess(tiny_model, _kv(local_pool_size="64MB"), num_gpu_blocks_override=16,
                       max_model_len=448, max_num_seqs=1) as engine:
        first = engine.generate([EVICTED], max_tokens=MAX_TOKENS)[0]
        for filler in FILLERS:
            engine.generate([filler], max_tokens=MAX_TOKENS)
        assert engine.wait_idle()
        before = engine.call(f"{__name__}:pool_stats")
        again = engine.generate([EVICTED], max_tokens=MAX_TOKENS)[0]
        after = engine.call(f"{__name__}:pool_stats")
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == len(EVICTED) - 1
    # the hit came from the pool, not from vLLM's own prefix cache
    assert after["pool_hit_tokens"] - before["pool_hit_tokens"] == len(EVICTED) - 1
    assert after["pool_loaded_blocks"] - before["pool_loaded_blocks"] == 4
    assert first.token_ids == again.token_ids == baseline[tuple(EVICTED)]


def test_store_killed_mid_run_degrades_to_recompute(tiny_model: Path, tmp_path: Path,
                                                    baseline: dict) -> None:
    from ascend_kv_testing.engines import EngineProcess
    from ascend_kv_testing.mooncake import MooncakeMaster, MooncakeSegmentHolder

    master = MooncakeMaster(tmp_path / "mc").start()
    holder = MooncakeSegmentHolder(master, segment_size="64MB").start()
    try:
        kv = _kv(backend="mooncake", store_retry_interval_s=30,
                 mooncake=master.config(global_segment_size=0, local_buffer_size="16MB"))
        with EngineProcess(tiny_model, kv) as engine:
            first = engine.generate(KILLED[:1], max_tokens=MAX_TOKENS)[0]
            assert engine.wait_idle()
            saved = engine.call(f"{__name__}:pool_stats")["pool_saved_blocks"]
            holder.stop()
            master.kill()
            engine.reset_prefix_cache()
            # a pool hit before the kill is now a miss; a new prompt's saves are dropped
            outs = engine.generate(KILLED, max_tokens=MAX_TOKENS)
            assert engine.wait_idle()
            again = engine.generate(KILLED[1:], max_tokens=MAX_TOKENS)
            stats = engine.call(f"{__name__}:pool_stats")
    finally:
        holder.stop()
        master.stop()
    assert saved == 2
    assert first.token_ids == baseline[tuple(KILLED[0])]
    for prompt, out in zip(KILLED, outs, strict=True):
        assert out.error is None and out.finish_reason == "length"
        assert out.token_ids == baseline[tuple(prompt)]
    assert again[0].token_ids == baseline[tuple(KILLED[1])]
    assert stats["pool_hit_tokens"] == 0
    assert stats["pool_dropped_save_blocks"] >= 3
    assert stats["pool_failed_load_blocks"] == 0
