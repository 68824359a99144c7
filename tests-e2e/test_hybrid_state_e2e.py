# SPDX-License-Identifier: Apache-2.0
"""A hybrid state-space model under vLLM's hybrid KV cache manager, through the P/D pull.

A tiny random Qwen3-Next (``ascend_kv_testing.models.make_tiny_qwen3_next``): layers 0 and 2
are Gated DeltaNet (a conv and an SSM state a request, vLLM's ``MambaSpec`` group), 1 and 3
full attention; bfloat16, which vLLM CPU's GDN kernel requires. vLLM puts each state in the
pages of an attention layer's tensor: a state layer moves with that tensor's page
(``KVCacheLayout.aliases``), block id by block id.

P prefills all but the prompt's last token, so its state is the state D starts from; D loads
the full-attention blocks and the state block and computes the last token itself:

* P says each group's run: every attention block of the ``n - 1`` tokens, and one state
  block at the last position; D reads exactly those, pair by pair;
* the state D loaded is P's, byte for byte, where it can be read after D's request (``n - 1``
  a multiple of the block: D's first token opens a new block and vLLM keeps the loaded one as
  its checkpoint);
* for those lengths D's tokens equal a single instance that computes the last token from the
  same state (the prompt sent twice: the second hits vLLM's own cache at ``n - 1`` tokens).
  bfloat16 greedy tokens of a cold prefill take another path through the GDN kernels (one
  chunk of ``n`` tokens against ``n - 1`` and a step) and may differ at any token: at other
  lengths the load is checked, not the tokens;
* P frees every block once D is done, D holds nothing.

One P and one D, real Mooncake over TCP.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.faults import start_in_parallel
from ascend_kv_testing.models import make_tiny_qwen3_next, qwen3_next_engine
from ascend_kv_testing.pd import PROBES, kv_config, prefill, prompts_of

KB = "ascend_kv_testing.kv_bytes"
ENGINE = qwen3_next_engine()
BS = int(ENGINE["block_size"])
#: ``n - 1`` a multiple of the block: the state's bytes and the tokens are checked
EXACT = [BS + 1, 3 * BS + 1, 12 * BS + 1]
LENGTHS = [20, BS, BS + 2, 3 * BS, 150, 400, *EXACT]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_qwen3_next(tmp_path_factory.mktemp("qwen3-next"))


@pytest.fixture(scope="module")
def pd(model: Path) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    engines = start_in_parallel({
        "p": lambda: EngineProcess(model, kv_config("kv_producer", "gdn-prefill",
                                                    lease_ttl_s=60), **ENGINE),
        "d": lambda: EngineProcess(model, kv_config("kv_consumer", "gdn-decode"), **ENGINE),
    })
    try:
        assert engines["d"].call(f"{KB}:record_loads") == 1
        yield engines["p"], engines["d"]
    finally:
        for e in engines.values():
            e.close()


def single_instance(engine: EngineProcess, prompt: list[int], n: int = 8) -> list[int]:
    """The tokens a single instance gives ``prompt`` computing its last token from its own
    cached state at ``len(prompt) - 1`` (sent twice, the second answer); the prefix cache is
    reset afterwards."""
    engine.generate([prompt], max_tokens=n)
    warm = engine.generate([prompt], max_tokens=n)[0]
    assert warm.num_cached_tokens == len(prompt) - 1, warm
    assert engine.reset_prefix_cache()
    return warm.token_ids


def page_digest(engine: EngineProcess, block: int) -> str:
    """SHA-256 of page ``block`` of every attention layer's tensor: a state layer's conv and
    SSM state lie in those pages (which the digests of ``kv_bytes`` read, not the states)."""
    ranks = engine.call(f"{KB}:block_digests", block_ids=[block])
    assert len(ranks) == 1
    layers = ranks[0]["layers"]
    return hashlib.sha256("".join(f"{k}:{v[0]}" for k, v in sorted(layers.items()))
                          .encode()).hexdigest()


def test_state_group_and_attention_group(pd: tuple[EngineProcess, EngineProcess]) -> None:
    for engine in pd:
        assert engine.call(f"{PROBES}:kv_cache_groups") == ["MambaSpec/0", "FullAttentionSpec/0"]


def test_d_loads_ps_state_and_equals_a_single_instance(
        pd: tuple[EngineProcess, EngineProcess]) -> None:
    p, d = pd
    prompts = prompts_of(LENGTHS, seed=56)
    want = {n: single_instance(d, prompt) for n, prompt in zip(LENGTHS, prompts, strict=True)
            if n in EXACT}
    d.call(f"{KB}:recorded_loads")
    params = prefill(p, prompts)
    for n, x in zip(LENGTHS, params, strict=True):
        state, attention = x["remote_block_groups"]
        loaded = cdiv(n - 1, BS)  # P computed the n - 1 tokens D loads
        assert attention == [0, loaded], x
        assert state == [loaded - 1, 1], x  # the state: one block, at the last position
    # P holds the state of each request until D is done: its bytes as P computed them
    p_state = [page_digest(p, x["remote_block_ids"][0]) for x in params]
    got = d.generate(prompts, max_tokens=8, kv_params=params)
    assert [g.finish_reason for g in got] == ["length"] * len(prompts)
    loads = d.call(f"{KB}:recorded_loads")
    assert len(loads) == len(prompts)
    by_remote = {tuple(x["remote"]): x for x in loads}
    for n, x, digest in zip(LENGTHS, params, p_state, strict=True):
        load = by_remote[tuple(x["remote_block_ids"])]
        # the state block first, then the attention blocks, pair by pair
        assert len(load["local"]) == len(x["remote_block_ids"])
        assert load["remote"][0] == x["remote_block_ids"][0]
        if n in EXACT:
            # D's first computed token opened a new block: the loaded state stayed as vLLM's
            # checkpoint at the block boundary, where it can still be read
            assert page_digest(d, load["local"][0]) == digest, n
    assert {n: g.token_ids for n, g in zip(LENGTHS, got, strict=True) if n in EXACT} == want
    for engine in (p, d):
        assert engine.wait_idle(20)
        state = engine.call(f"{PROBES}:scheduler_state")
        assert state["requests"] == 0
