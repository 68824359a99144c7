# SPDX-License-Identifier: Apache-2.0
"""MLA (DeepSeek-V3 attention) on real vLLM CPU engines: a tiny random
``DeepseekV3ForCausalLM`` (one latent of 576 values a token, bfloat16), real Mooncake over
TCP. One engine set per connector, shared by its test class and living only as long as
it, so that no more than two engines run at once: P and D pulling (``MooncakeConnectorV1``),
P and D pushing layer by layer (``MooncakeLayerwiseConnector``, with ``do_virtual``), one
engine with the ``local`` pool (``AscendStoreConnector``), one with CPU offload
(``CPUOffloadingConnector``), two on one Mooncake Store (the second loads what the first
saved).

Two checks, because bf16 greedy tokens alone prove nothing here (``docs/model-shapes.md``):

* the KV bytes: every block D loaded holds, in every layer, exactly P's bytes for that
  block (read in both engines' KV caches, :mod:`ascend_kv_testing.kv_bytes`); and the
  bytes moved are one copy of the latent per block and layer (MLA has no head axis to
  split);
* the tokens, at ``k * block + 1`` prompt lengths, sent one at a time: D's tokens equal a
  single instance serving the prompt from its own prefix cache (the prompt sent twice, the
  second answer compared), which computes the last prompt token from cached blocks as D
  does; a cold prefill takes another bf16 path and may differ at any token.

The backend is the one vLLM CPU picks here: ``AMX_MLA`` on CPUs with AMX (block 128), else
the reference ``CPU_MLA`` (block 16), on which vLLM turns prefix caching off; these engines
keep it on (:mod:`ascend_kv_testing.mla_prefix_cache`), which serves ``k * block + 1``
prompts through the decode kernel for the last token, as D computes it.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.faults import start_in_parallel
from ascend_kv_testing.models import make_tiny_deepseek, mla_engine
from ascend_kv_testing.pd import LAYERWISE, PROBES, Metaserver, kv_config, prefill, prompts_of

KB = "ascend_kv_testing.kv_bytes"
#: keeps vLLM's prefix cache on for MLA on CPU_MLA (see the module docstring)
KEEP_PREFIX_CACHE = "ascend_kv_testing.mla_prefix_cache"
ENGINE = mla_engine()
BS = int(ENGINE["block_size"])
#: one latent (kv_lora_rank 512 + rope 64) of bf16 a token, 2 layers
LATENT_BYTES = (512 + 64) * 2
LAYERS = 2
#: k * block + 1 tokens: D loads the same count as vLLM's own cache would serve
LENGTHS = [BS + 1, 2 * BS + 1] if BS >= 128 else [8 * BS + 1, 16 * BS + 1]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_deepseek(tmp_path_factory.mktemp("mla-model"))


def _start_all(model: Path, specs: dict[str, dict[str, Any]]) -> dict[str, EngineProcess]:
    """Start the engines side by side (each takes ~25 s on 2 cores)."""
    return start_in_parallel({
        name: functools.partial(EngineProcess, model, cfg, pre_import=[KEEP_PREFIX_CACHE],
                                **ENGINE)
        for name, cfg in specs.items()})


@pytest.fixture(scope="class")
def pd(model: Path) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    engines = _start_all(model, {
        "p": kv_config("kv_producer", "mla-prefill", lease_ttl_s=60),
        "d": kv_config("kv_consumer", "mla-decode")})
    try:
        assert engines["d"].call(f"{KB}:record_loads") == 1
        yield engines["p"], engines["d"]
    finally:
        for e in engines.values():
            e.close()


def single_instance(engine: EngineProcess, prompt: list[int], n: int = 8) -> list[int]:
    """The tokens a single instance gives ``prompt`` served from its own prefix cache (sent
    twice, the second answer); the prefix cache is reset afterwards."""
    engine.generate([prompt], max_tokens=n)
    warm = engine.generate([prompt], max_tokens=n)[0]
    assert warm.num_cached_tokens == (len(prompt) - 1) // BS * BS, warm
    assert engine.reset_prefix_cache()
    return warm.token_ids


def digests(engine: EngineProcess, block_ids: list[int]) -> dict[str, list[str]]:
    """Layer name -> SHA-256 of each block's bytes (one rank: TP 1)."""
    ranks = engine.call(f"{KB}:block_digests", block_ids=block_ids)
    assert len(ranks) == 1
    for shape in ranks[0]["shapes"].values():
        # [blocks, block size, latent]: one latent a token, no head axis
        assert shape[1:] == [BS, LATENT_BYTES // 2], shape
    return ranks[0]["layers"]


class TestPull:
    """``MooncakeConnectorV1``: D pulls P's blocks."""

    @pytest.mark.parametrize("length", LENGTHS)
    def test_pull_moves_p_bytes_and_matches_single_instance(self, pd: Any, length: int) -> None:
        p, d = pd
        prompt = prompts_of([length], seed=length)[0]
        want = single_instance(d, prompt)
        d.call(f"{KB}:recorded_loads")
        before = d.call(f"{PROBES}:connector_totals")
        params = prefill(p, [prompt])[0]
        remote = list(params["remote_block_ids"])
        assert len(remote) == -(-length // BS)
        # P holds these blocks for D until D says done: read them now
        p_bytes = digests(p, remote)
        got = d.generate([prompt], max_tokens=8, kv_params=[params])[0]
        assert got.finish_reason == "length"
        loads = d.call(f"{KB}:recorded_loads")
        assert [x["remote"] for x in loads] == [remote]
        local = loads[0]["local"]
        assert len(local) == len(remote)
        # every full block: D's bytes are P's, layer by layer (the last block holds the one
        # prompt token D recomputes, then D's own decode tokens)
        full = (length - 1) // BS
        d_bytes = digests(d, local)
        assert sorted(d_bytes) == sorted(p_bytes) and len(p_bytes) == LAYERS
        for layer, blocks in p_bytes.items():
            assert d_bytes[layer][:full] == blocks[:full], layer
        assert len(set(p_bytes[next(iter(p_bytes))][:full])) == full  # distinct, not all zeros
        # one copy of the latent per block and layer: nothing per head
        after = d.call(f"{PROBES}:connector_totals")
        moved = after.get("p2p_transfer_bytes", 0) - before.get("p2p_transfer_bytes", 0)
        assert moved == len(remote) * BS * LATENT_BYTES * LAYERS
        assert p.wait_idle(20) and d.wait_idle(20)
        assert got.token_ids == want


# ---------------------------------------------------------------- layerwise push
@pytest.fixture(scope="class")
def lw(model: Path) -> Iterator[Any]:
    engines = _start_all(model, {
        "p": kv_config("kv_producer", "mla-lw-prefill", connector=LAYERWISE),
        "d": kv_config("kv_consumer", "mla-lw-decode", connector=LAYERWISE)})
    server = Metaserver()
    try:
        assert engines["d"].call(f"{KB}:record_loads") == 1
        yield SimpleNamespace(p=engines["p"], d=engines["d"], meta=server)
    finally:
        server.close()
        for e in engines.values():
            e.close()


def push(lw: Any, prompt: list[int], rid: str, *, virtual: bool = False) -> Any:
    """D gets the request first and posts its blocks; P prefills with what D posted."""
    kv = {**lw.meta.params(rid), **({"do_virtual": True} if virtual else {})}
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.update(
        d=lw.d.generate([prompt], max_tokens=8, kv_params=[kv])[0]))
    t.start()
    if not virtual:
        posted = lw.meta.wait([rid])
        lw.p.generate([prompt], max_tokens=1, kv_params=posted)
    t.join(300)
    return out["d"]


class TestLayerwise:
    """``MooncakeLayerwiseConnector``: P pushes into D's blocks."""

    @pytest.mark.parametrize("length", LENGTHS[:1])
    def test_layerwise_pushes_p_bytes_and_matches_single_instance(self, lw: Any,
                                                                  length: int) -> None:
        prompt = prompts_of([length], seed=100 + length)[0]
        want = single_instance(lw.d, prompt)
        lw.d.call(f"{KB}:recorded_loads")
        before = lw.p.call(f"{PROBES}:connector_totals")
        got = push(lw, prompt, f"mla-lw-{length}")
        assert got.finish_reason == "length"
        loads = lw.d.call(f"{KB}:recorded_loads")
        assert len(loads) == 1 and not loads[0]["virtual"]
        full = (length - 1) // BS
        # P's blocks of the prompt, found through P's own prefix cache
        p_blocks = lw.p.call(f"{KB}:cached_blocks", prompt=prompt)
        assert len(p_blocks) == full
        p_bytes, d_bytes = digests(lw.p, p_blocks), digests(lw.d, loads[0]["local"][:full])
        assert d_bytes == p_bytes
        after = lw.p.call(f"{PROBES}:connector_totals")
        moved = after.get("p2p_transfer_bytes", 0) - before.get("p2p_transfer_bytes", 0)
        assert moved == -(-length // BS) * BS * LATENT_BYTES * LAYERS
        assert lw.p.wait_idle(20) and lw.d.wait_idle(20)
        assert got.token_ids == want
        lw.p.reset_prefix_cache()
        lw.d.reset_prefix_cache()


    def test_layerwise_virtual_request_moves_nothing_and_finishes(self, lw: Any) -> None:
        prompt = prompts_of([LENGTHS[0]], seed=7)[0]
        d0, p0 = (e.call(f"{PROBES}:connector_totals") for e in (lw.d, lw.p))
        posts = set(lw.meta.posts)
        got = push(lw, prompt, "mla-lw-virtual", virtual=True)
        assert got.finish_reason == "length" and len(got.token_ids) == 8
        d1, p1 = (e.call(f"{PROBES}:connector_totals") for e in (lw.d, lw.p))
        assert d1["p2p_virtual_requests"] - d0.get("p2p_virtual_requests", 0) == 1
        assert p1.get("p2p_transfer_bytes", 0) == p0.get("p2p_transfer_bytes", 0)
        assert set(lw.meta.posts) == posts
        assert [x["virtual"] for x in lw.d.call(f"{KB}:recorded_loads")] == [True]
        assert lw.d.wait_idle(20)
        lw.d.reset_prefix_cache()  # the virtual request's blocks hold no real KV


# ---------------------------------------------------------------- pool and offload
OFFLOAD_TOTALS = "vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.introspect:offload_totals"


def one_copy(n: int) -> int:
    """The bytes of ``n`` full blocks: one latent per token and layer, one copy."""
    return n * BS * LATENT_BYTES * LAYERS


def served_back(engine: EngineProcess, seed: int, totals: str, prefix: str) -> None:
    """One engine: the prompt's blocks go to the connector's store; its own prefix cache is
    reset and the blocks zeroed; the prompt again loads them from the store, byte for byte,
    one copy of the latent per block and layer, and the tokens equal the warm instance's."""
    length = LENGTHS[0]
    prompt = prompts_of([length], seed=seed + length)[0]
    full = (length - 1) // BS
    before = engine.call(totals)
    engine.generate([prompt], max_tokens=8)
    saved = engine.call(f"{KB}:prefix_digests", prompt=prompt)
    assert len(saved["block_ids"]) == full
    warm = engine.generate([prompt], max_tokens=8)[0]  # from vLLM's own prefix cache
    assert warm.num_cached_tokens == full * BS
    assert engine.wait_idle(20)
    mid = engine.call(totals)
    assert mid.get(f"{prefix}_save_bytes", 0) - before.get(f"{prefix}_save_bytes", 0) \
        == one_copy(full)
    assert engine.reset_prefix_cache()
    engine.call(f"{KB}:zero_blocks", block_ids=saved["block_ids"])
    got = engine.generate([prompt], max_tokens=8)[0]
    assert got.num_cached_tokens == full * BS
    after = engine.call(totals)
    assert after.get(f"{prefix}_loaded_blocks", 0) - mid.get(f"{prefix}_loaded_blocks", 0) == full
    assert after.get(f"{prefix}_load_bytes", 0) - mid.get(f"{prefix}_load_bytes", 0) \
        == one_copy(full)
    loaded = engine.call(f"{KB}:prefix_digests", prompt=prompt)
    assert loaded["ranks"][0]["layers"] == saved["ranks"][0]["layers"]
    assert got.token_ids == warm.token_ids
    assert engine.reset_prefix_cache()


def _one_engine(model: Path, kv: dict[str, Any]) -> Iterator[EngineProcess]:
    """One engine with ``kv``, closed when its class is done."""
    engine = _start_all(model, {"engine": kv})["engine"]
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture(scope="class")
def pool(model: Path) -> Iterator[EngineProcess]:
    yield from _one_engine(model, {
        "kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"backend": "local", "local_pool_size": "64MB"}})


class TestLocalPool:
    """``AscendStoreConnector`` with the ``local`` backend."""

    def test_local_pool_serves_the_saved_bytes_back(self, pool: EngineProcess) -> None:
        served_back(pool, 200, f"{PROBES}:pool_totals", "pool")


@pytest.fixture(scope="class")
def offload(model: Path) -> Iterator[EngineProcess]:
    yield from _one_engine(model, {
        "kv_connector": "CPUOffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_swap_space": "64MB"}})


class TestCpuOffload:
    """``CPUOffloadingConnector``: blocks saved to host memory, loaded back."""

    def test_offload_serves_the_saved_bytes_back(self, offload: EngineProcess) -> None:
        served_back(offload, 300, OFFLOAD_TOTALS, "offload")


@pytest.fixture(scope="class")
def store(model: Path, mooncake_master: Any) -> Iterator[dict[str, EngineProcess]]:
    """Two engines on one Mooncake Store; a ``mooncake_client`` holds the pool's memory."""
    from ascend_kv_testing.mooncake import MooncakeSegmentHolder

    holder = MooncakeSegmentHolder(mooncake_master, segment_size="64MB").start()
    cfg = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {
               "backend": "mooncake",
               "mooncake": mooncake_master.config(global_segment_size=0,
                                                  local_buffer_size="16MB")}}
    engines: dict[str, EngineProcess] = {}
    try:
        engines = _start_all(model, {"first": cfg, "second": cfg})
        yield engines
    finally:
        for e in engines.values():
            e.close()
        holder.stop()


class TestMooncakeStorePool:
    """``AscendStoreConnector`` with the Mooncake Store backend: a second engine hits the
    prefix the first saved."""

    def test_second_engine_loads_the_first_engines_bytes(self, store: Any) -> None:
        first, second = store["first"], store["second"]
        length = LENGTHS[0]
        prompt = prompts_of([length], seed=400 + length)[0]
        full = (length - 1) // BS
        first.generate([prompt], max_tokens=8)
        saved = first.call(f"{KB}:prefix_digests", prompt=prompt)
        assert len(saved["block_ids"]) == full
        warm = first.generate([prompt], max_tokens=8)[0]  # from its own prefix cache
        assert warm.num_cached_tokens == full * BS
        assert first.wait_idle(20)
        assert first.call(f"{PROBES}:pool_totals").get("pool_save_bytes", 0) == one_copy(full)
        got = second.generate([prompt], max_tokens=8)[0]
        assert got.num_cached_tokens == full * BS
        totals = second.call(f"{PROBES}:pool_totals")
        assert totals.get("pool_loaded_blocks", 0) == full
        assert totals.get("pool_load_bytes", 0) == one_copy(full)
        loaded = second.call(f"{KB}:prefix_digests", prompt=prompt)
        assert loaded["ranks"][0]["layers"] == saved["ranks"][0]["layers"]
        assert len(set(next(iter(saved["ranks"][0]["layers"].values())))) == full  # not zeros
        assert got.token_ids == warm.token_ids
