# SPDX-License-Identifier: Apache-2.0
"""CPUOffloadingConnector under vLLM's hybrid KV cache manager (HMA), end to end.

The tiny random Llama of ``test_hybrid_e2e``: ``layer_types`` alternate ``sliding_attention``
(a window of 64 tokens, 2 blocks) and ``full_attention``, untied embeddings. The connector
declares ``SupportsHMA``, so vLLM keeps two KV cache groups. One engine computes the prompts
(saving them to host memory), drops its own prefix cache, and serves the prompts again:

* the engine runs two groups (the hybrid manager stayed on);
* every prompt's prefix comes back from host memory: the hit is the longest prefix every
  group serves (full blocks; a full hit leaves the last token to compute), the tokens equal
  the first run's (which computed every token);
* the blocks loaded are every block of the full-attention group before the hit and, of the
  window's group, only those vLLM keeps for the window; nothing failed, nothing stays held.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.models import make_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROBES = "ascend_kv_testing.probes"
TOTALS = "vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.introspect:offload_totals"
BS = 32
WINDOW = 2 * BS
LAYERS = 4
#: below the window, k * block, k * block + 1, well past the window
LENGTHS = [40, 4 * BS, 4 * BS + 1, 600]
OFFLOAD = {"kv_connector": "CPUOffloadingConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"cpu_swap_space": "128MB"}}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def hit_of(n: int) -> int:
    """Host memory's hit for an ``n``-token prompt: its full blocks, less the last token."""
    return min(n // BS * BS, n - 1)


def blocks_loaded(n: int) -> int:
    """Blocks of both groups loaded for the hit: every block of the full group, of the
    window's group those vLLM keeps for the window of the token after the hit."""
    h = hit_of(n)
    return cdiv(h, BS) + cdiv(h, BS) - max(0, h - WINDOW + 1) // BS


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(
        tmp_path_factory.mktemp("swa-offload-model"), num_hidden_layers=LAYERS,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
        tie_word_embeddings=False)


def test_a_prefix_dropped_from_the_device_comes_back_from_host_memory(model: Path) -> None:
    rnd = random.Random(52)
    prompts = [[rnd.randrange(3, 1000) for _ in range(n)] for n in LENGTHS]
    with EngineProcess(model, OFFLOAD) as engine:
        assert engine.call(f"{PROBES}:kv_cache_groups") == [f"SlidingWindowSpec/{WINDOW}",
                                                            "FullAttentionSpec/0"]
        cold = engine.generate(prompts, max_tokens=8)
        assert engine.wait_idle()
        before = engine.call(TOTALS)
        assert engine.reset_prefix_cache()  # the device's own cache is gone
        warm = engine.generate(prompts, max_tokens=8)
        assert engine.wait_idle()
        after = engine.call(TOTALS)
        state = engine.call(f"{PROBES}:scheduler_state")
    assert [o.num_cached_tokens for o in cold] == [0] * len(LENGTHS)
    # every full block of both groups (the window's were all kept while the prompt ran)
    assert before["offload_saved_blocks"] == sum(2 * (n // BS) for n in LENGTHS)
    # (a failed load would be recomputed: fewer cached tokens)
    assert [o.num_cached_tokens for o in warm] == [hit_of(n) for n in LENGTHS]
    assert [o.token_ids for o in warm] == [o.token_ids for o in cold]
    assert [o.finish_reason for o in warm] == ["length"] * len(LENGTHS)
    # of the 600-token prompt the window's group loads 2 blocks, not 18
    assert blocks_loaded(600) == 18 + 2
    loaded = after["offload_loaded_blocks"] - before["offload_loaded_blocks"]
    assert loaded == sum(blocks_loaded(n) for n in LENGTHS)
    assert state["requests"] == 0 and state["free_blocks"] == state["total_blocks"] - 1
