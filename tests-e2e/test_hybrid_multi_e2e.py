# SPDX-License-Identifier: Apache-2.0
"""vLLM's ``MultiConnector`` over the pull and a prefix pool, with the hybrid KV cache manager on.

vLLM keeps its hybrid KV cache manager on under ``MultiConnector`` only when every child
declares ``SupportsHMA``; ``MooncakeConnectorV1`` and ``AscendStoreConnector`` both do. The
sliding-window model of ``test_hybrid_e2e.py`` (layers alternating a 64-token window and full
attention): P runs ``MultiConnector`` over the pull producer and an embedded ``local`` pool, D
over the pull consumer and a pool of its own.

* both engines keep two KV cache groups under ``MultiConnector``;
* D's tokens equal a single instance's (the same model, HMA on) at lengths below, at and past
  the window and block boundaries;
* the second request of a shared prefix is served on P from the pool (P's own prefix cache
  reset in between), D still pulls, the tokens equal;
* every block is back on both sides once idle.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.faults import start_in_parallel
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.pd import PROBES, baseline, kv_config, prefill, prompts_of

BS = 32
WINDOW = 2 * BS
LAYERS = 4
POOL = "AscendStoreConnector"


def _multi(role: str, engine_id: str, pull: dict[str, Any]) -> dict[str, Any]:
    child = {k: v for k, v in pull.items() if k != "engine_id"}
    pool = {"kv_connector": POOL, "kv_role": role,
            "kv_connector_extra_config": {"local_pool_size": "64MB"}}
    return {"kv_connector": "MultiConnector", "kv_role": role, "engine_id": engine_id,
            "kv_load_failure_policy": pull["kv_load_failure_policy"],
            "kv_connector_extra_config": {"connectors": [child, pool]}}


@pytest.fixture(scope="module")
def mc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    model = make_tiny_llama(
        tmp_path_factory.mktemp("swa-multi-model"), num_hidden_layers=LAYERS,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"] * 2,
        tie_word_embeddings=False)
    cfgs = {"p": _multi("kv_producer", "swa-mc-prefill",
                        kv_config("kv_producer", "swa-mc-prefill", lease_ttl_s=60)),
            "d": _multi("kv_consumer", "swa-mc-decode",
                        kv_config("kv_consumer", "swa-mc-decode"))}
    engines = start_in_parallel({name: (lambda cfg=cfg: EngineProcess(model, cfg))
                                 for name, cfg in cfgs.items()})
    try:
        yield engines["p"], engines["d"]
    finally:
        for e in engines.values():
            e.close()


def _idle(*engines: EngineProcess) -> None:
    for engine in engines:
        assert engine.wait_idle(20)
        state = engine.call(f"{PROBES}:scheduler_state")
        assert state["requests"] == 0 and state["free_blocks"] == state["total_blocks"] - 1


def test_pd_and_pool_with_the_hybrid_manager_on(
        mc: tuple[EngineProcess, EngineProcess]) -> None:
    p, d = mc
    for engine in (p, d):
        assert engine.call(f"{PROBES}:kv_cache_groups") == [f"SlidingWindowSpec/{WINDOW}",
                                                            "FullAttentionSpec/0"]
    lengths = [40, 2 * BS + 1, 3 * BS + WINDOW - 1, 300]
    prompts = prompts_of(lengths, seed=58)
    want = baseline(d, prompts)
    params = prefill(p, prompts)
    assert all("remote_block_groups" in x for x in params)
    got = d.generate(prompts, max_tokens=8, kv_params=params)
    assert [g.token_ids for g in got] == want
    _idle(p, d)


def test_second_request_of_a_shared_prefix_hits_the_pool_on_p(
        mc: tuple[EngineProcess, EngineProcess]) -> None:
    p, d = mc
    base = prompts_of([6 * BS], seed=59)[0]
    first, second = (base + tail for tail in prompts_of([10, 21], seed=60))
    want = baseline(d, [first, second])
    pool_before = p.call(f"{PROBES}:pool_totals")
    got = d.generate([first], max_tokens=8, kv_params=prefill(p, [first]))
    assert got[0].token_ids == want[0]
    _idle(p, d)
    assert p.reset_prefix_cache() is not False
    assert d.reset_prefix_cache() is not False
    got = d.generate([second], max_tokens=8, kv_params=prefill(p, [second]))
    assert got[0].token_ids == want[1]
    pool_after = p.call(f"{PROBES}:pool_totals")
    # the shared 6 blocks came from the pool on P: every group's, as far as a hit uses them
    assert pool_after.get("pool_hit_tokens", 0) - pool_before.get("pool_hit_tokens", 0) >= 6 * BS
    assert pool_after.get("pool_loaded_blocks", 0) > pool_before.get("pool_loaded_blocks", 0)
    _idle(p, d)
