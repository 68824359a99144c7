# SPDX-License-Identifier: Apache-2.0
"""CPUOffloadingConnector in a real vLLM CPU engine.

A long prefix is pushed out of a small device KV cache by other requests;
the next request with that prefix gets it back from host memory (seen in
``num_cached_tokens`` and in the connector's counters), and its tokens equal
those of an engine without offload.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.engines import EngineProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

BLOCK = 32
#: 80 blocks of 32 tokens: two ~1000-token prompts fit, a third evicts the first
DEVICE_BLOCKS = 80
OFFLOAD = {"kv_connector": "CPUOffloadingConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"cpu_swap_space": "256MB"}}
TOTALS = "vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.introspect:offload_totals"


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


#: 961 = 30 * 32 + 1 (the length ExampleConnector never hits) and 960 = 30 * 32 (the last
#: block is loaded and its last token recomputed)
PROMPT_A = _prompt(1, 30 * BLOCK + 1)
PROMPT_B = _prompt(2, 30 * BLOCK)
FILLERS = [_prompt(10 + i, 1100) for i in range(3)]


def _sequence(engine: EngineProcess) -> dict[str, Any]:
    """A and B, fillers that evict them from the device, then A and B again."""
    out: dict[str, Any] = {}
    out["a1"], out["b1"] = engine.generate([PROMPT_A, PROMPT_B], max_tokens=16)
    for filler in FILLERS:
        engine.generate([filler], max_tokens=2)
    (out["a2"],) = engine.generate([PROMPT_A], max_tokens=16)
    (out["b2"],) = engine.generate([PROMPT_B], max_tokens=16)
    return out


@pytest.fixture(scope="module")
def baseline(tiny_model: Path) -> dict[str, Any]:
    with EngineProcess(tiny_model, num_gpu_blocks_override=DEVICE_BLOCKS) as engine:
        return _sequence(engine)


@pytest.fixture(scope="module")
def offload(tiny_model: Path) -> Iterator[tuple[EngineProcess, dict[str, Any]]]:
    with EngineProcess(tiny_model, OFFLOAD, num_gpu_blocks_override=DEVICE_BLOCKS) as engine:
        yield engine, _sequence(engine)


def test_fillers_evict_the_prefix_from_the_device(baseline: dict[str, Any]) -> None:
    # without offload the repeated prompts find little or nothing of themselves on the device
    assert baseline["a2"].num_cached_tokens <= len(PROMPT_A) // 2
    assert baseline["b2"].num_cached_tokens <= len(PROMPT_B) // 2
    assert baseline["a2"].token_ids == baseline["a1"].token_ids


def test_repeated_prefix_comes_back_from_host_memory(
        offload: tuple[EngineProcess, dict[str, Any]], baseline: dict[str, Any]) -> None:
    engine, out = offload
    assert out["a1"].num_cached_tokens == 0
    # every token but the last is cached again; the device alone could not do that
    assert out["a2"].num_cached_tokens == len(PROMPT_A) - 1
    assert out["b2"].num_cached_tokens == len(PROMPT_B) - 1
    totals = engine.call(TOTALS)
    device_hits = baseline["a2"].num_cached_tokens + baseline["b2"].num_cached_tokens
    assert totals["offload_hit_tokens"] >= (len(PROMPT_A) + len(PROMPT_B) - 2) - device_hits
    assert totals["offload_load_bytes"] > 0 and totals["offload_loaded_blocks"] > 0
    assert totals["offload_save_bytes"] > 0
    pool = totals["pool"]
    assert pool["pinned_blocks"] == 0 and pool["pending_blocks"] == 0
    assert pool["cached_blocks"] == pool["committed_blocks"] - pool["evictions"]


def test_tokens_equal_a_run_without_offload(offload: tuple[EngineProcess, dict[str, Any]],
                                            baseline: dict[str, Any]) -> None:
    _, out = offload
    for key in ("a1", "b1", "a2", "b2"):
        assert out[key].token_ids == baseline[key].token_ids, key


def test_engine_drains_and_holds_no_blocks(offload: tuple[EngineProcess, dict[str, Any]]) -> None:
    engine, _ = offload
    assert engine.wait_idle(timeout=30), "finished requests' blocks are released after saves"
    (again,) = engine.generate([PROMPT_A], max_tokens=4)
    assert again.num_cached_tokens == len(PROMPT_A) - 1
