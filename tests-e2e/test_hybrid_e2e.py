# SPDX-License-Identifier: Apache-2.0
"""A sliding-window model under vLLM's hybrid KV cache manager (HMA), end to end.

A tiny random Llama whose ``layer_types`` alternate ``sliding_attention`` (a window of 64
tokens, 2 blocks) and ``full_attention``, with untied embeddings (a tied random model repeats
its input token whatever its KV). vLLM runs it with two KV cache groups that share one block
pool, and a layer of each group shares one tensor with a layer of the other.

``MooncakeConnectorV1`` declares ``SupportsHMA``, so vLLM keeps the hybrid manager on:

* D's tokens equal a single instance (the same model, HMA on) for prompts below the window,
  at ``k * block``, ``k * block + 1``, at the length where the window's first block is freed
  one token later, and well past the window;
* D reads, of the window's group, only the blocks its manager keeps, and the bytes moved are
  those pairs of blocks, fewer than the whole prompt's blocks of every layer (what the same
  model moves with the hybrid manager off);
* a D with the hybrid manager off fails the load of a P's request that has it on with a
  clear error, and P frees the request's blocks;
* ``MooncakeLayerwiseConnector`` (P prefills in chunks of 2 blocks and pushes each layer's
  own group's blocks as the layer is computed) gives the same tokens, and pushes fewer bytes
  than every layer's whole prompt.

One P and one D at a time (each class), real Mooncake over TCP.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.faults import start_in_parallel
from ascend_kv_testing.models import TINY_LLAMA, make_tiny_llama
from ascend_kv_testing.pd import (
    LAYERWISE,
    PROBES,
    Metaserver,
    baseline,
    kv_config,
    prefill,
    prompts_of,
)

KB = "ascend_kv_testing.kv_bytes"
STATS = "vllm_ascend.distributed.kv_transfer.kv_p2p.mooncake_layerwise_connector:push_stats"
BS = 32
WINDOW = 2 * BS
LAYERS = 4
#: a block of one tensor: K and V of 32 tokens, 2 heads of 64 float32 values
PAGE = 2 * BS * int(TINY_LLAMA["num_key_value_heads"]) * int(TINY_LLAMA["head_dim"]) * 4
#: below the window, k * block, k * block + 1, the lengths where the window's first block is
#: freed (159: 159 - 64 + 1 = 3 blocks) and one past, well past the window
LENGTHS = [40, 2 * BS, 2 * BS + 1, 4 * BS, 4 * BS + 1, 3 * BS + WINDOW - 1, 3 * BS + WINDOW,
           300, 600]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def pairs_kept(n: int) -> int:
    """Blocks D reads for an ``n``-token prompt: D computes the last prompt token itself, so it
    loads ``n - 1`` tokens: every block of them for the full-attention group, and for the
    window's group those vLLM keeps (a block wholly before the window of token ``n - 1`` is
    freed)."""
    loaded = n - 1
    full = cdiv(loaded, BS)
    first_kept = max(0, loaded - WINDOW + 1) // BS
    return full + (full - first_kept)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(
        tmp_path_factory.mktemp("swa-model"), num_hidden_layers=LAYERS, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
        tie_word_embeddings=False)


@pytest.fixture(scope="class")
def p(model: Path) -> Iterator[EngineProcess]:
    """P of the pull, HMA on (one class)."""
    engine = EngineProcess(model, kv_config("kv_producer", "swa-prefill", lease_ttl_s=60))
    yield engine
    engine.close()


@pytest.fixture(scope="class")
def d(model: Path) -> Iterator[EngineProcess]:
    """D with the hybrid manager on (one class)."""
    engine = EngineProcess(model, kv_config("kv_consumer", "swa-decode"))
    assert engine.call(f"{KB}:record_loads") == 1
    yield engine
    engine.close()


@pytest.fixture(scope="class")
def d_off(model: Path) -> Iterator[EngineProcess]:
    """D with the hybrid manager off (one class)."""
    engine = EngineProcess(model, kv_config("kv_consumer", "swa-decode-off"),
                           disable_hybrid_kv_cache_manager=True)
    yield engine
    engine.close()


def groups_of(engine: EngineProcess) -> list[str]:
    return engine.call(f"{PROBES}:kv_cache_groups")


class TestHybridPull:
    """P and D with the hybrid manager on."""

    def test_both_run_two_groups(self, p: EngineProcess, d: EngineProcess) -> None:
        for engine in (p, d):
            assert groups_of(engine) == [f"SlidingWindowSpec/{WINDOW}", "FullAttentionSpec/0"]

    def test_tokens_equal_single_instance_and_only_kept_blocks_move(
            self, p: EngineProcess, d: EngineProcess) -> None:
        prompts = prompts_of(LENGTHS, seed=52)
        want = baseline(d, prompts)
        d.call(f"{KB}:recorded_loads")
        before = d.call(f"{PROBES}:connector_totals")
        params = prefill(p, prompts)
        for n, x in zip(LENGTHS, params, strict=True):
            runs = x["remote_block_groups"]
            # every run ends at the last block of the n - 1 tokens P computed (D computes the last)
            assert [first + count for first, count in runs] == [cdiv(n - 1, BS)] * 2, runs
            assert len(x["remote_block_ids"]) == sum(count for _, count in runs)
        got = d.generate(prompts, max_tokens=8, kv_params=params)
        assert [g.finish_reason for g in got] == ["length"] * len(prompts)
        assert [g.token_ids for g in got] == want
        loads = {x["request_id"]: x for x in d.call(f"{KB}:recorded_loads")}
        assert sorted(len(x["local"]) for x in loads.values()) == sorted(
            pairs_kept(n) for n in LENGTHS)
        for load in loads.values():
            assert 0 not in load["local"] and len(load["local"]) == len(load["remote"])
        after = d.call(f"{PROBES}:connector_totals")
        moved = after.get("p2p_transfer_bytes", 0) - before.get("p2p_transfer_bytes", 0)
        # one page of each of the two shared tensors per pair of blocks
        assert moved == sum(pairs_kept(n) for n in LENGTHS) * 2 * PAGE
        # with the hybrid manager off D reads every layer's page of every prompt block
        hma_off = sum(cdiv(n, BS) for n in LENGTHS) * LAYERS * PAGE
        assert moved < hma_off
        long_only = pairs_kept(600) * 2 * PAGE
        assert long_only < 0.6 * cdiv(600, BS) * LAYERS * PAGE
        assert after.get("p2p_requests_loaded", 0) - before.get("p2p_requests_loaded", 0) == len(
            LENGTHS)
        assert p.wait_idle(20)
        state = p.call(f"{PROBES}:scheduler_state")
        assert state["requests"] == 0 and state["free_blocks"] == state["total_blocks"] - 1

    def test_d_serves_its_own_prefix_then_loads_the_rest(
            self, p: EngineProcess, d: EngineProcess) -> None:
        """D's prefix cache holds the first blocks of a prompt: D reads the rest only."""
        [long] = prompts_of([400], seed=53)
        want = baseline(d, [long])
        d.generate([long[:200]], max_tokens=1)  # D caches the first 6 blocks of both groups
        params = prefill(p, [long])
        d.call(f"{KB}:recorded_loads")
        got = d.generate([long], max_tokens=8, kv_params=params)[0]
        assert got.token_ids == want[0]
        [load] = d.call(f"{KB}:recorded_loads")
        # D's own cache served the first 6 blocks of both groups (the window's two last
        # ones among them): D read the full group's blocks past them and the window's
        assert len(load["local"]) == pairs_kept(400) - 6
        d.reset_prefix_cache()


class TestHybridMismatch:
    """A D with the hybrid manager off against P's request with it on."""

    def test_load_fails_clearly_and_p_frees(self, p: EngineProcess,
                                            d_off: EngineProcess) -> None:
        [group] = groups_of(d_off)  # one group for every layer (it keeps the window)
        assert group.startswith("FullAttentionSpec/")
        prompts = prompts_of([150, 90], seed=54)
        want = baseline(d_off, prompts[1:])
        params = prefill(p, prompts[:1])
        got = d_off.generate(prompts, max_tokens=8, kv_params=[params[0], None])
        assert got[0].finish_reason == "error" and got[0].token_ids == []
        assert got[1].token_ids == want[0]  # the other request is served
        assert d_off.wait_idle(20)
        totals = d_off.call(f"{PROBES}:connector_totals")
        assert sum(v for k, v in totals.items() if k.startswith("p2p_failures")) >= 1
        assert d_off.call(f"{PROBES}:scheduler_state")["requests"] == 0
        assert p.wait_idle(20)
        state = p.call(f"{PROBES}:scheduler_state")
        assert state["requests"] == 0 and state["free_blocks"] == state["total_blocks"] - 1


@pytest.fixture(scope="class")
def lw(model: Path) -> Iterator[tuple[EngineProcess, EngineProcess, Metaserver]]:
    """Layerwise P (chunked prefill, 64 tokens a step) and D, HMA on, started side by side."""
    engines = start_in_parallel({
        "p": lambda: EngineProcess(model, kv_config("kv_producer", "swa-lw-prefill",
                                                    connector=LAYERWISE),
                                   max_num_batched_tokens=64),
        "d": lambda: EngineProcess(model, kv_config("kv_consumer", "swa-lw-decode",
                                                    connector=LAYERWISE)),
    })
    server = Metaserver()
    try:
        yield engines["p"], engines["d"], server
    finally:
        server.close()
        for e in engines.values():
            e.close()


class TestHybridLayerwise:
    """P pushes layer by layer, HMA on."""

    def test_tokens_equal_single_instance(self, lw: tuple[EngineProcess, EngineProcess,
                                                          Metaserver]) -> None:
        p, d, meta = lw
        assert groups_of(p) == groups_of(d) == [f"SlidingWindowSpec/{WINDOW}",
                                                "FullAttentionSpec/0"]
        lengths = [40, 2 * BS + 1, 3 * BS + WINDOW - 1, 300]
        prompts = prompts_of(lengths, seed=55)
        want = baseline(d, prompts)
        d0, p0 = (e.call(f"{PROBES}:connector_totals") for e in (d, p))
        got = [meta.pd_once(p, d, prompt, prefix="swa-lw") for prompt in prompts]
        assert [g.token_ids for g in got] == want
        posts = list(meta.posts.values())[-len(lengths):]
        for n, post in zip(lengths, posts, strict=True):
            # D posts the blocks it keeps of each group, of the n - 1 tokens it loads
            runs = post["remote_block_groups"]
            assert [first + count for first, count in runs] == [cdiv(n - 1, BS)] * 2
            assert runs[0][0] == max(0, n - 1 - WINDOW + 1) // BS and runs[1][0] == 0
        d1, p1 = (e.call(f"{PROBES}:connector_totals") for e in (d, p))
        assert d1.get("p2p_requests_loaded", 0) - d0.get("p2p_requests_loaded", 0) == len(
            lengths)
        assert not any(k.startswith("p2p_failures") and d1[k] != d0.get(k, 0) for k in d1)
        pushed = p1["p2p_transfer_bytes"] - p0.get("p2p_transfer_bytes", 0)
        # each layer pushes its own group's pages: at least D's kept pairs, 2 layers a pair
        # (a block P computed over two steps goes twice), fewer than every layer's prompt
        assert sum(pairs_kept(n) for n in lengths) * 2 * PAGE <= pushed
        assert pushed < sum(cdiv(n, BS) for n in lengths) * LAYERS * PAGE
        # every layer went out from its own hook, as it was computed
        stats = p.call(STATS)
        assert stats["hooked"] > 0 and stats["fallback"] == 0
        for engine in (p, d):
            assert engine.wait_idle(20)
            state = engine.call(f"{PROBES}:scheduler_state")
            assert state["requests"] == 0 and state["free_blocks"] == state["total_blocks"] - 1

    def test_virtual_request_moves_nothing(self, lw: tuple[EngineProcess, EngineProcess,
                                                           Metaserver]) -> None:
        """``do_virtual`` with HMA on: D reports the request received at once, nothing is
        posted or pushed."""
        p, d, meta = lw
        [prompt] = prompts_of([300], seed=57)
        d0, p0 = (e.call(f"{PROBES}:connector_totals") for e in (d, p))
        posts = set(meta.posts)
        got = d.generate([prompt], max_tokens=8, kv_params=[{
            "do_remote_prefill": True, "metaserver": meta.url, "request_id": "swa-virtual",
            "do_virtual": True}])[0]
        assert got.finish_reason == "length" and len(got.token_ids) == 8
        d1, p1 = (e.call(f"{PROBES}:connector_totals") for e in (d, p))
        assert d1["p2p_virtual_requests"] - d0.get("p2p_virtual_requests", 0) == 1
        assert p1.get("p2p_transfer_bytes", 0) == p0.get("p2p_transfer_bytes", 0)
        assert set(meta.posts) == posts
        d.reset_prefix_cache()  # the virtual request's blocks hold no real KV
