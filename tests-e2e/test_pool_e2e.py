# SPDX-License-Identifier: Apache-2.0
"""AscendStoreConnector end to end: real vLLM CPU engines, a real Mooncake Store.

* A second engine (a new process) hits the prefix the first one saved in a
  Mooncake pool held by ``mooncake_client`` (the first engine is gone by
  then), for prompts of exactly k blocks, k blocks + 1 and k blocks + 2, and
  produces the tokens of the run without any pool.
* One engine with a small device KV cache gets evicted prefixes (k blocks,
  k blocks + 1, k blocks + 2, 4 blocks) back from the embedded ``local`` pool,
  for each way of loading: synchronous (default), ``load_async`` (vLLM waits
  for the load between steps) and ``use_layerwise`` (saved and loaded layer by
  layer); tokens equal those of the run without any pool.
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

# Engine children import this module for the helpers below, by its file name: pytest's
# importlib mode names it after its folder ("tests-e2e. ..."), which they cannot import.
sys.path.insert(0, str(Path(__file__).parent))
HERE = Path(__file__).stem

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
    out["num_layers"] = worker.layout.num_layers if worker.layout is not None else 0
    return out


def trace_loads(llm: Any) -> None:
    """Runs inside an engine process: from now on, record what the connector tells vLLM about
    loads (``get_num_new_matched_tokens``'s answers, ``get_transfer_results``' finished async
    loads, the pool worker's ``wait_for_layer_load`` calls in steps with loads); see
    :func:`load_trace`."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector
    worker = get_kv_transfer_group()
    trace: dict[str, list[Any]] = {"matched": [], "recving": [], "layer_waits": []}
    match, results, wait = (sched.get_num_new_matched_tokens, worker.get_transfer_results,
                            worker.connector_worker.wait_for_layer_load)

    def get_num_new_matched_tokens(request: Any, num_computed_tokens: int) -> Any:
        out = match(request, num_computed_tokens)
        trace["matched"].append(out)
        return out

    def get_transfer_results(finished_req_ids: set[str]) -> Any:
        # what vLLM's model runner asks each step (the connector's get_finished with the
        # failed loads: see AscendStoreConnector.get_transfer_results)
        out = results(finished_req_ids)
        trace["recving"].extend(sorted(out.finished_recving))
        return out

    def wait_for_layer_load(layer_name: str, meta: Any = None) -> None:
        if meta is not None and meta.loads:
            trace["layer_waits"].append(layer_name)
        wait(layer_name, meta)

    sched.get_num_new_matched_tokens = get_num_new_matched_tokens
    worker.get_transfer_results = get_transfer_results
    worker.connector_worker.wait_for_layer_load = wait_for_layer_load
    llm._pool_load_trace = trace


def load_trace(llm: Any) -> dict[str, list[Any]]:
    """Runs inside an engine process: what :func:`trace_loads` recorded."""
    return llm._pool_load_trace


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
        stats_a = first.call(f"{HERE}:pool_stats")
    assert [o.num_cached_tokens for o in cold] == [0, 0, 0]
    assert stats_a["pool_saved_blocks"] == 3 * K
    # the first engine is gone; its blocks live in mooncake_client's segment
    with EngineProcess(tiny_model, kv) as second:
        warm = second.generate(SHARED, max_tokens=MAX_TOKENS)
        stats_b = second.call(f"{HERE}:pool_stats")
    assert [o.num_cached_tokens for o in warm] == [K * BLOCK - 1, K * BLOCK, K * BLOCK]
    assert stats_b["pool_hit_tokens"] == 3 * K * BLOCK - 1
    assert stats_b["pool_loaded_blocks"] == 3 * K
    assert stats_b["pool_failed_load_blocks"] == 0
    for prompt, a, b in zip(SHARED, cold, warm, strict=True):
        assert a.token_ids == baseline[tuple(prompt)]
        assert b.token_ids == baseline[tuple(prompt)], f"prompt of {len(prompt)} tokens"


#: kv_connector_extra_config of each way of loading (the pool's ``local`` backend).
MODES: dict[str, dict[str, Any]] = {
    "sync": {},
    "async": {"load_async": True},
    "layerwise": {"use_layerwise": True},
}
#: Prompts whose prefixes the fillers evict from the device: k blocks, k blocks + 1,
#: k blocks + 2 and 4 blocks.
EVICTED_PROMPTS = [*SHARED, EVICTED]


@pytest.fixture(scope="module", params=list(MODES))
def local_run(request: pytest.FixtureRequest, tiny_model: Path) -> dict[str, Any]:
    """One engine per mode: the prompts, fillers that evict them from its 16 device blocks,
    then the prompts again (their prefixes come from the ``local`` pool)."""
    from ascend_kv_testing.engines import EngineProcess

    mode = request.param
    # 16 device blocks: the two 12-block fillers push the prompts out of vLLM's cache
    with EngineProcess(tiny_model, _kv(local_pool_size="64MB", **MODES[mode]),
                       num_gpu_blocks_override=16, max_model_len=448,
                       max_num_seqs=1) as engine:
        cold = engine.generate(EVICTED_PROMPTS, max_tokens=MAX_TOKENS)
        engine.generate(FILLERS, max_tokens=MAX_TOKENS)
        assert engine.wait_idle()
        before = engine.call(f"{HERE}:pool_stats")
        engine.call(f"{HERE}:trace_loads")
        # all four at once: with load_async vLLM allocates every hit's blocks (3+3+3+4 of the
        # 15 usable) and runs one request while the others' loads are in flight
        warm = engine.generate(EVICTED_PROMPTS, max_tokens=MAX_TOKENS)
        assert engine.wait_idle()
        after = engine.call(f"{HERE}:pool_stats")
        trace = engine.call(f"{HERE}:load_trace")
    return {"mode": mode, "cold": cold, "warm": warm, "before": before, "after": after,
            "trace": trace}


def test_local_pool_returns_a_prefix_evicted_from_the_device(local_run: dict[str, Any],
                                                              baseline: dict) -> None:
    mode, before, after = local_run["mode"], local_run["before"], local_run["after"]
    blocks = [len(p) // BLOCK for p in EVICTED_PROMPTS]  # 3, 3, 3, 4 (partial tails not saved)
    # with use_layerwise every block is one object per layer in the pool
    per_block = before["num_layers"] if mode == "layerwise" else 1
    if mode == "layerwise":
        assert per_block == 2  # the tiny Llama's layers
    assert [o.num_cached_tokens for o in local_run["cold"]] == [0, 0, 0, 0]
    assert before["pool_hit_tokens"] == 0 and before["pool_loaded_blocks"] == 0
    saved = sum(blocks) + sum(len(f) // BLOCK for f in FILLERS)
    assert before["pool_saved_blocks"] == saved * per_block
    # every token of the full blocks is cached again (the last prompt token is computed)
    cached = [min(n * BLOCK, len(p) - 1) for n, p in zip(blocks, EVICTED_PROMPTS, strict=True)]
    assert cached == [K * BLOCK - 1, K * BLOCK, K * BLOCK, 4 * BLOCK - 1]
    assert [o.num_cached_tokens for o in local_run["warm"]] == cached
    # ... and it came from the pool, not from vLLM's own prefix cache
    assert after["pool_hit_tokens"] - before["pool_hit_tokens"] == sum(cached)
    assert after["pool_loaded_blocks"] - before["pool_loaded_blocks"] == sum(blocks) * per_block
    assert after["pool_failed_load_blocks"] == 0
    assert after["pool_saved_blocks"] == before["pool_saved_blocks"]  # loaded: not saved again
    trace = local_run["trace"]
    assert [list(m) for m in trace["matched"]] == [[n, mode == "async"] for n in cached]
    assert len(trace["recving"]) == (len(cached) if mode == "async" else 0)
    layer_waits = len(trace["layer_waits"])
    assert layer_waits == (len(cached) * per_block if mode == "layerwise" else 0)
    for prompt, a, b in zip(EVICTED_PROMPTS, local_run["cold"], local_run["warm"], strict=True):
        assert a.token_ids == baseline[tuple(prompt)], f"cold, prompt of {len(prompt)} tokens"
        assert b.token_ids == baseline[tuple(prompt)], f"{mode}, prompt of {len(prompt)} tokens"


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
            saved = engine.call(f"{HERE}:pool_stats")["pool_saved_blocks"]
            holder.stop()
            master.kill()
            engine.reset_prefix_cache()
            # a pool hit before the kill is now a miss; a new prompt's saves are dropped
            outs = engine.generate(KILLED, max_tokens=MAX_TOKENS)
            assert engine.wait_idle()
            again = engine.generate(KILLED[1:], max_tokens=MAX_TOKENS)
            stats = engine.call(f"{HERE}:pool_stats")
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
