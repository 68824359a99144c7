# SPDX-License-Identifier: Apache-2.0
"""Speculative decoding beside the connectors, on real vLLM CPU engines.

vLLM CPU runs n-gram speculation (``speculative_config: {"method": "ngram"}``): the
drafts come from the prompt and the output so far, and the target model verifies several
tokens a step. A D that loads its prompt's KV from P must then draft and verify on top of
those blocks, and an engine whose prefix comes back from the pool likewise. Checked: the
tokens equal the same speculating engine serving the prompts alone (greedy, float32), the
KV really came from P or the pool, and drafts were proposed, so that the target model
verified several tokens a step over the loaded blocks. (A random model seldom continues
the prompt's phrase, so few drafts are accepted; the verification steps run either way.)

Draft-model and MTP speculation (DeepSeek's next-token layers) need a second model or MTP
weights that vLLM CPU does not run with these tiny models: not tested here.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.pd import PROBES, baseline, kv_config, prefill, prompts_of

BS = 32
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}


def repetitive(lengths: list[int], seed: int) -> list[list[int]]:
    """Prompts that repeat a short random phrase (something for n-gram drafts to find)."""
    out = []
    for n, phrase in zip(lengths, prompts_of([7] * len(lengths), seed), strict=True):
        out.append([phrase[i % len(phrase)] for i in range(n)])
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("spec-model"))


def drafts(engine: EngineProcess) -> dict[str, float]:
    return engine.call(f"{PROBES}:spec_decode_totals")


@pytest.fixture(scope="module")
def pd(model: Path) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    p = EngineProcess(model, kv_config("kv_producer", "spec-prefill", lease_ttl_s=60))
    try:
        d = EngineProcess(model, kv_config("kv_consumer", "spec-decode"),
                          speculative_config=SPEC, disable_log_stats=False)
    except Exception:
        p.close()
        raise
    yield p, d
    d.close()
    p.close()


def test_a_speculating_d_serves_the_kv_p_computed(pd: Any) -> None:
    p, d = pd
    prompts = repetitive([2 * BS + 1, 3 * BS + 5, 100], seed=5)
    want = baseline(d, prompts, n=24)
    before, spec0 = d.call(f"{PROBES}:connector_totals"), drafts(d)
    params = prefill(p, prompts)
    got = d.generate(prompts, max_tokens=24, kv_params=params)
    assert [g.token_ids for g in got] == want
    after, spec1 = d.call(f"{PROBES}:connector_totals"), drafts(d)
    assert after.get("p2p_requests_loaded", 0) - before.get("p2p_requests_loaded", 0) == 3
    proposed = spec1.get("num_draft_tokens", 0) - spec0.get("num_draft_tokens", 0)
    assert proposed > 0, (spec0, spec1)
    assert p.wait_idle(20) and d.wait_idle(20)


def test_a_speculating_engine_takes_its_prefix_from_the_pool(model: Path) -> None:
    kv = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
          "kv_connector_extra_config": {"local_pool_size": "64MB"}}
    prompts = repetitive([3 * BS + 1, 2 * BS + 9], seed=9)
    with EngineProcess(model, kv, speculative_config=SPEC, disable_log_stats=False) as engine:
        cold = engine.generate(prompts, max_tokens=24)
        assert engine.wait_idle()
        assert engine.reset_prefix_cache()  # vLLM's own cache only: the pool keeps them
        spec0 = drafts(engine)
        warm = engine.generate(prompts, max_tokens=24)
        spec1 = drafts(engine)
    assert [w.token_ids for w in warm] == [c.token_ids for c in cold]
    # the full blocks came back (from the pool: vLLM's own cache was reset)
    assert [w.num_cached_tokens for w in warm] == [(len(x) - 1) // BS * BS for x in prompts]
    assert spec1.get("num_draft_tokens", 0) > spec0.get("num_draft_tokens", 0)
