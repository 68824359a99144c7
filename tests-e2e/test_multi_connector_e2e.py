# SPDX-License-Identifier: Apache-2.0
"""AscendMultiConnector end to end: layerwise P/D plus a prefix pool, real vLLM CPU engines.

The production shape "P/D with a shared prefix pool": P runs ``AscendMultiConnector``
over ``MooncakeLayerwiseConnector`` (producer) and ``AscendStoreConnector`` (embedded
``local`` pool); D runs it over the layerwise consumer and the pool. D gets each request
first and posts its blocks to a metaserver (a test stand-in for the proxy's); P prefills and
pushes every layer into D's blocks. The second request of a shared prefix is served on P from
the pool (P's own prefix cache is reset in between), so the layerwise child must push blocks
another child loaded: what AscendMultiConnector exists for. D's tokens must equal a single
instance's (float32, greedy).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# Engine children import this module for the probe below, by its file name (pytest's
# importlib mode names it after its folder, which they cannot import).
sys.path.insert(0, str(Path(__file__).parent))
HERE = Path(__file__).stem

from test_p2p_layerwise_engine_e2e import run_pd  # noqa: E402

from ascend_kv_testing.engines import EngineProcess  # noqa: E402
from ascend_kv_testing.faults import start_in_parallel  # noqa: E402
from ascend_kv_testing.models import make_tiny_llama  # noqa: E402
from ascend_kv_testing.pd import (  # noqa: E402
    LAYERWISE,
    Metaserver,
    baseline,
    kv_config,
    prompts_of,
)

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.slow]

BS = 32
MULTI = "AscendMultiConnector"
POOL = "AscendStoreConnector"


def pool_totals(llm: Any) -> dict[str, Any]:
    """Runs inside an engine process: the scheduler connector's class and its pool child's
    hit/miss totals."""
    multi = llm.llm_engine.engine_core.engine_core.scheduler.connector
    pool = next(c for c in multi._connectors if type(c).__name__ == POOL)
    rec = pool.connector_scheduler.recorder
    return {"connector": type(multi).__name__,
            "children": [type(c).__name__ for c in multi._connectors],
            **{name: rec.total(name) for name in ("pool_lookups", "pool_hit_tokens",
                                                 "pool_miss_tokens")}}


def _child(cfg: dict[str, Any]) -> dict[str, Any]:
    # vLLM's MultiConnector gives every child the parent's engine_id
    return {k: v for k, v in cfg.items() if k != "engine_id"}


def _multi(role: str, engine_id: str, layerwise: dict[str, Any]) -> dict[str, Any]:
    pool = {"kv_connector": POOL, "kv_role": role,
            "kv_connector_extra_config": {"local_pool_size": "64MB"}}
    return {"kv_connector": MULTI, "kv_role": role, "engine_id": engine_id,
            "kv_connector_extra_config": {"connectors": [_child(layerwise), pool]}}


@pytest.fixture(scope="module")
def mc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = make_tiny_llama(tmp_path_factory.mktemp("mc-model"))
    env = {"MC_TCP_PROGRESS_TIMEOUT_SEC": "1"}
    p_cfg = _multi("kv_producer", "mc-prefill",
                   kv_config("kv_producer", "mc-prefill", connector=LAYERWISE))
    d_cfg = _multi("kv_consumer", "mc-decode",
                   kv_config("kv_consumer", "mc-decode", policy="recompute",
                             connector=LAYERWISE, load_timeout_s=8.0, lease_ttl_s=3.0))
    # vLLM's MultiConnector supports HMA only when every child does: turn the hybrid
    # KV cache manager off, as vLLM does by itself for a single non-HMA connector
    common = {"env": env, "disable_hybrid_kv_cache_manager": True}
    engines = start_in_parallel({
        "p": lambda: EngineProcess(model, p_cfg, max_num_batched_tokens=64, **common),
        "d": lambda: EngineProcess(model, d_cfg, **common),
    })
    server = Metaserver()
    try:
        yield type("MC", (), {"p": engines["p"], "d": engines["d"], "meta": server})
    finally:
        server.close()
        for e in engines.values():
            e.close()


def test_layerwise_pd_with_pool_equals_single_instance_and_hits_the_pool(mc: Any) -> None:
    base = prompts_of([3 * BS], seed=31)[0]
    first, second = (base + tail for tail in prompts_of([10, 21], seed=32))
    want = baseline(mc.d, [first, second])
    before = mc.p.call(f"{HERE}:pool_totals")
    assert before["connector"] == MULTI and before["children"] == [LAYERWISE, POOL]

    assert [g.token_ids for g in run_pd(mc, [first])] == [want[0]]
    # P forgets the prefix; only the pool still has it. D forgets it too: P pushes it all.
    # First both let go of the request's blocks (P holds them until its pushes are
    # reported done): vLLM refuses to reset a prefix cache while blocks are held.
    assert mc.p.wait_idle(20) and mc.d.wait_idle(20)
    assert mc.p.reset_prefix_cache()
    assert mc.d.reset_prefix_cache()

    got = run_pd(mc, [second])
    assert [g.token_ids for g in got] == [want[1]]
    after = mc.p.call(f"{HERE}:pool_totals")
    # the shared 3 blocks came from the pool on P (a full-block prefix of the second prompt)
    assert after["pool_hit_tokens"] - before["pool_hit_tokens"] >= 3 * BS
    for engine in (mc.p, mc.d):
        assert engine.wait_idle(20)
