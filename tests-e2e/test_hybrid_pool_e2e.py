# SPDX-License-Identifier: Apache-2.0
"""AscendStoreConnector under vLLM's hybrid KV cache manager (HMA), end to end.

The tiny random Llama of ``test_hybrid_e2e``: ``layer_types`` alternate ``sliding_attention``
(a window of 64 tokens, 2 blocks) and ``full_attention``, untied embeddings. The pool declares
``SupportsHMA``, so vLLM keeps two KV cache groups. Two engines (processes) over one Mooncake
Store: the first computes the prompts and saves them, the second hits the prefixes:

* both run two groups (the hybrid manager stayed on);
* the second engine's hit is the longest prefix every group serves (the partial tail is not
  pooled; a full hit leaves the last token to compute), its tokens equal the first engine's
  (which computed every token itself);
* it loads every block of the full-attention group before the hit and, of the window's group,
  only the blocks vLLM keeps for the window (below the window: all of them);
* nothing fails and no block stays held.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.models import make_tiny_llama

# Engine children import this module for pool_stats, by its file name (see test_pool_e2e).
sys.path.insert(0, str(Path(__file__).parent))
HERE = Path(__file__).stem
PROBES = "ascend_kv_testing.probes"

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.slow]

BS = 32
WINDOW = 2 * BS
LAYERS = 4
#: below the window, k * block, k * block + 1, well past the window
LENGTHS = [40, 4 * BS, 4 * BS + 1, 600]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hit_of(n: int) -> int:
    """The pool's hit for an ``n``-token prompt: its full blocks, less the last token."""
    return min(n // BS * BS, n - 1)


def blocks_loaded(n: int) -> int:
    """Blocks of both groups loaded for a hit of ``h`` tokens: every block of the full group,
    of the window's group those vLLM keeps (a block wholly before the window of the token
    after the hit is freed)."""
    h = hit_of(n)
    first_kept = max(0, h - WINDOW + 1) // BS
    return cdiv(h, BS) + cdiv(h, BS) - first_kept


def pool_stats(llm: Any) -> dict[str, float]:
    """Runs inside an engine process: totals of the pool's scheduler and worker metrics."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    sched = llm.llm_engine.engine_core.engine_core.scheduler.connector.connector_scheduler
    worker = get_kv_transfer_group().connector_worker
    out = {name: sched.recorder.total(name) for name in ("pool_lookups", "pool_hit_tokens")}
    out.update({name: worker.recorder.total(name) for name in
                ("pool_loaded_blocks", "pool_saved_blocks", "pool_failed_load_blocks")})
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(
        tmp_path_factory.mktemp("swa-pool-model"), num_hidden_layers=LAYERS,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
        tie_word_embeddings=False)


@pytest.fixture(scope="module")
def kv(mooncake_master: Any) -> Iterator[dict[str, Any]]:
    """The pool's config, over a ``mooncake_client`` holding its memory for both engines."""
    from ascend_kv_testing.mooncake import MooncakeSegmentHolder

    holder = MooncakeSegmentHolder(mooncake_master, segment_size="128MB").start()
    try:
        yield {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
               "kv_connector_extra_config": {
                   "backend": "mooncake",
                   "mooncake": mooncake_master.config(global_segment_size=0,
                                                      local_buffer_size="32MB")}}
    finally:
        holder.stop()


def test_a_second_engine_hits_what_the_first_saved(model: Path, kv: dict[str, Any]) -> None:
    rnd = random.Random(52)
    prompts = [[rnd.randrange(3, 1000) for _ in range(n)] for n in LENGTHS]
    with EngineProcess(model, kv) as first:
        assert first.call(f"{PROBES}:kv_cache_groups") == [f"SlidingWindowSpec/{WINDOW}",
                                                           "FullAttentionSpec/0"]
        cold = first.generate(prompts, max_tokens=8)
        assert first.wait_idle()
        saved = first.call(f"{HERE}:pool_stats")
    assert [o.num_cached_tokens for o in cold] == [0] * len(LENGTHS)
    # every full block of both groups (the window's were all kept while the prompt ran)
    assert saved["pool_saved_blocks"] == sum(2 * (n // BS) for n in LENGTHS)
    with EngineProcess(model, kv) as second:
        assert second.call(f"{PROBES}:kv_cache_groups") == [f"SlidingWindowSpec/{WINDOW}",
                                                            "FullAttentionSpec/0"]
        warm = second.generate(prompts, max_tokens=8)
        assert second.wait_idle()
        stats = second.call(f"{HERE}:pool_stats")
        state = second.call(f"{PROBES}:scheduler_state")
    assert [o.num_cached_tokens for o in warm] == [hit_of(n) for n in LENGTHS]
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert [o.finish_reason for o in warm] == ["length"] * len(LENGTHS)
    assert stats["pool_hit_tokens"] == sum(hit_of(n) for n in LENGTHS)
    # of the 600-token prompt the window's group loads 2 blocks, not 18
    assert blocks_loaded(600) == 18 + 2
    assert stats["pool_loaded_blocks"] == sum(blocks_loaded(n) for n in LENGTHS)
    assert stats["pool_failed_load_blocks"] == 0
    assert state["requests"] == 0 and state["free_blocks"] == state["total_blocks"] - 1
