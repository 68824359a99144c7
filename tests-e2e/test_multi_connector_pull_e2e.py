# SPDX-License-Identifier: Apache-2.0
"""vLLM's own ``MultiConnector`` end to end: pull P/D plus a prefix pool, real vLLM CPU engines.

The production shape "P/D with a shared prefix pool" in its pull form: P runs vLLM's
``MultiConnector`` over ``MooncakeConnectorV1`` (producer) and ``AscendStoreConnector``
(embedded ``local`` pool); D runs it over the pull consumer and a pool of its own. P prefills
with ``do_remote_decode``, D pulls P's blocks with the returned ``kv_transfer_params``. No
``AscendMultiConnector`` is needed here: the pull child reads P's blocks after P is done, so it
never has to know which child filled them. D's tokens must equal a single instance's (float32,
greedy), and the second request of a shared prefix is served on P from the pool (P's own
prefix cache is reset in between), with D still pulling every block.

Both children of P hold a finished request's blocks (the pull child until D is done, the pool
child until its save is done); vLLM's ``MultiConnector`` counts the extra hold and frees the
blocks once both report, which the idle checks below cover.
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

from ascend_kv_testing.engines import EngineProcess  # noqa: E402
from ascend_kv_testing.faults import start_in_parallel  # noqa: E402
from ascend_kv_testing.models import make_tiny_llama  # noqa: E402
from ascend_kv_testing.pd import PROBES, baseline, kv_config, prefill, prompts_of  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.slow]

BS = 32
MULTI = "MultiConnector"
PULL = "MooncakeConnectorV1"
PULL_CLASS = "MooncakeConnector"  # the class registered under PULL
POOL = "AscendStoreConnector"


def children_totals(llm: Any) -> dict[str, Any]:
    """Runs inside an engine process: the scheduler connector's class, its children's class
    names and the worker-side children's counters summed."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    multi = llm.llm_engine.engine_core.engine_core.scheduler.connector
    totals: dict[str, Any] = {"connector": type(multi).__name__,
                              "children": [type(c).__name__ for c in multi._connectors]}
    for child in get_kv_transfer_group()._connectors:
        recorder = getattr(child, "recorder", None)
        for key, value in (recorder.totals() if recorder is not None else {}).items():
            totals[key] = totals.get(key, 0.0) + value
    return totals


def _child(cfg: dict[str, Any]) -> dict[str, Any]:
    # vLLM's MultiConnector gives every child the parent's engine_id
    return {k: v for k, v in cfg.items() if k != "engine_id"}


def _multi(role: str, engine_id: str, pull: dict[str, Any]) -> dict[str, Any]:
    pool = {"kv_connector": POOL, "kv_role": role,
            "kv_connector_extra_config": {"local_pool_size": "64MB"}}
    return {"kv_connector": MULTI, "kv_role": role, "engine_id": engine_id,
            "kv_load_failure_policy": pull["kv_load_failure_policy"],
            "kv_connector_extra_config": {"connectors": [_child(pull), pool]}}


@pytest.fixture(scope="module")
def mc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    model = make_tiny_llama(tmp_path_factory.mktemp("mcp-model"))
    cfgs = {"p": _multi("kv_producer", "mcp-prefill",
                        kv_config("kv_producer", "mcp-prefill", lease_ttl_s=60)),
            "d": _multi("kv_consumer", "mcp-decode", kv_config("kv_consumer", "mcp-decode"))}
    # vLLM's MultiConnector supports HMA only when every child does: turn the hybrid
    # KV cache manager off, as vLLM does by itself for a single non-HMA connector
    engines = start_in_parallel({
        name: (lambda cfg=cfg: EngineProcess(model, cfg, disable_hybrid_kv_cache_manager=True))
        for name, cfg in cfgs.items()})
    try:
        yield type("MC", (), {"p": engines["p"], "d": engines["d"]})
    finally:
        for e in engines.values():
            e.close()


def _idle(*engines: EngineProcess) -> None:
    for engine in engines:
        assert engine.wait_idle(20)
        state = engine.call(f"{PROBES}:scheduler_state")
        # every block back: vLLM keeps one null block out of the free list
        assert state["requests"] == 0 and state["free_blocks"] == state["total_blocks"] - 1


def test_pull_pd_through_multi_connector_equals_single_instance(mc: Any) -> None:
    # < 1 block, exactly k blocks, k blocks + 1, a longer one
    lengths = [5, BS, 2 * BS + 1, 150]
    prompts = prompts_of(lengths, seed=41)
    want = baseline(mc.d, prompts)
    before = mc.d.call(f"{HERE}:children_totals")
    assert before["connector"] == MULTI and before["children"] == [PULL_CLASS, POOL]
    pool_before = mc.p.call(f"{PROBES}:pool_totals")
    params = prefill(mc.p, prompts)
    assert [len(x["remote_block_ids"]) for x in params] == [-(-n // BS) for n in lengths]
    got = mc.d.generate(prompts, max_tokens=8, kv_params=params)
    assert [g.token_ids for g in got] == want
    after = mc.d.call(f"{HERE}:children_totals")
    assert after.get("p2p_requests_loaded", 0) - before.get("p2p_requests_loaded", 0) == len(
        prompts)
    # P's pool child saved every full block, so both children held those requests' blocks:
    # P freed each block once D was done and its pool save was done (two holds, one free)
    _idle(mc.p, mc.d)
    pool_after = mc.p.call(f"{PROBES}:pool_totals")
    full_blocks = sum(n // BS for n in lengths)
    assert pool_after.get("pool_saved_blocks", 0) - pool_before.get("pool_saved_blocks", 0) \
        >= full_blocks


def test_second_request_of_a_shared_prefix_hits_the_pool_on_p(mc: Any) -> None:
    base = prompts_of([3 * BS], seed=42)[0]
    first, second = (base + tail for tail in prompts_of([10, 21], seed=43))
    want = baseline(mc.d, [first, second])
    pool_before = mc.p.call(f"{PROBES}:pool_totals")
    d_before = mc.d.call(f"{HERE}:children_totals")

    got = mc.d.generate([first], max_tokens=8, kv_params=prefill(mc.p, [first]))
    assert [g.token_ids for g in got] == [want[0]]
    _idle(mc.p, mc.d)
    # P forgets the prefix; only the pool still has it. D forgets it too: D pulls it all.
    assert mc.p.reset_prefix_cache() is not False
    assert mc.d.reset_prefix_cache() is not False

    params = prefill(mc.p, [second])
    assert len(params[0]["remote_block_ids"]) == -(-len(second) // BS)
    got = mc.d.generate([second], max_tokens=8, kv_params=params)
    assert [g.token_ids for g in got] == [want[1]]
    pool_after = mc.p.call(f"{PROBES}:pool_totals")
    # the shared 3 blocks came from the pool on P (a full-block prefix of the second prompt)
    assert pool_after.get("pool_hit_tokens", 0) - pool_before.get("pool_hit_tokens", 0) >= 3 * BS
    assert pool_after.get("pool_loaded_blocks", 0) - pool_before.get("pool_loaded_blocks", 0) >= 3
    d_after = mc.d.call(f"{HERE}:children_totals")
    assert d_after.get("p2p_requests_loaded", 0) - d_before.get("p2p_requests_loaded", 0) == 2
    _idle(mc.p, mc.d)
