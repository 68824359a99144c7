# SPDX-License-Identifier: Apache-2.0
"""MooncakeConnectorV1 end to end: real vLLM CPU engines for P and D, real Mooncake over TCP.

P prefills with ``do_remote_decode`` and ``max_tokens=1``; D gets P's
``kv_transfer_params`` and must produce exactly the tokens a single instance
produces (float32, greedy). Bad params must fail only their own request.
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


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("pd-model"))


@pytest.fixture(scope="module")
def pd(model: Path) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    p = EngineProcess(model, kv_config("kv_producer", "e2e-prefill", lease_ttl_s=60))
    try:
        d = EngineProcess(model, kv_config("kv_consumer", "e2e-decode"))
    except Exception:
        p.close()
        raise
    yield p, d
    d.close()
    p.close()


def test_pd_equals_single_instance_for_every_length(pd: Any) -> None:
    p, d = pd
    # < 1 block, exactly k blocks, k blocks + 1 (a peer connector misses that one), + 2
    lengths = [5, BS, 2 * BS, BS + 1, 2 * BS + 1, 2 * BS + 2, 3 * BS - 1, 200]
    prompts = prompts_of(lengths, seed=1)
    want = baseline(d, prompts)
    before = d.call(f"{PROBES}:connector_totals")
    params = prefill(p, prompts)
    assert [len(x["remote_block_ids"]) for x in params] == [-(-n // BS) for n in lengths]
    got = d.generate(prompts, max_tokens=8, kv_params=params)  # all at once: concurrent loads
    assert [g.token_ids for g in got] == want
    after = d.call(f"{PROBES}:connector_totals")
    assert after.get("p2p_requests_loaded", 0) - before.get("p2p_requests_loaded", 0) == len(
        prompts)
    assert after.get("p2p_transfer_bytes", 0) > before.get("p2p_transfer_bytes", 0)
    # P freed every block once D was done
    assert p.wait_idle(20)
    state = p.call(f"{PROBES}:scheduler_state")
    assert state["requests"] == 0 and state["free_blocks"] == state["total_blocks"] - 1


def test_wrong_request_id_fails_cleanly_and_d_serves_on(pd: Any) -> None:
    p, d = pd
    prompts = prompts_of([70], seed=2)
    want = baseline(d, prompts)
    params = prefill(p, prompts)
    bogus = {**params[0], "remote_request_id": "a-request-p-never-had"}
    res = d.generate(prompts, max_tokens=8, kv_params=[bogus])[0]
    assert res.finish_reason == "error" and res.token_ids == []
    # the real params still work afterwards (P kept its blocks for the real request)
    d.reset_prefix_cache()
    ok = d.generate(prompts, max_tokens=8, kv_params=[params[0]])[0]
    assert ok.token_ids == want[0]
    assert d.wait_idle(20)
    totals = d.call(f"{PROBES}:connector_totals")
    assert totals.get("p2p_failures|cause=unknown_request", 0) >= 1


def test_blocks_p_does_not_hold_fail_cleanly(pd: Any) -> None:
    p, d = pd
    prompts = prompts_of([96, 96], seed=3)
    params = prefill(p, prompts)
    # ask request 0 for request 1's blocks: P only serves a request's own blocks
    swapped = {**params[0], "remote_block_ids": params[1]["remote_block_ids"]}
    res = d.generate([prompts[0]], max_tokens=4, kv_params=[swapped])[0]
    assert res.finish_reason == "error"
    d.reset_prefix_cache()
    want = baseline(d, prompts)
    got = d.generate(prompts, max_tokens=8, kv_params=params)
    assert [g.token_ids for g in got] == want


@pytest.mark.parametrize("change", [
    {"remote_block_ids": None},
    {"remote_block_ids": [0, 1, 2, 3, 4, 5, 6]},   # longer than the prompt needs
    {"remote_block_ids": [-1, 2]},
    {"remote_port": "not-a-port"},
    {"remote_host": 42},
    {"remote_tp_size": 0},
])
def test_malformed_params_fail_that_request_only(pd: Any, change: dict[str, Any]) -> None:
    p, d = pd
    prompts = prompts_of([40, 40], seed=4)
    want = baseline(d, prompts[1:])
    params = prefill(p, prompts)
    res = d.generate(prompts, max_tokens=8, kv_params=[{**params[0], **change}, params[1]])
    assert res[0].finish_reason == "error" and res[0].token_ids == []
    assert res[1].token_ids == want[0]
    # nothing leaks on D: every block is free again once idle
    assert d.wait_idle(20)
    state = d.call(f"{PROBES}:scheduler_state")
    assert state["requests"] == 0


def test_unrelated_requests_are_untouched(pd: Any) -> None:
    p, d = pd
    prompts = prompts_of([50, 80], seed=5)
    want = baseline(d, prompts)
    got = d.generate(prompts, max_tokens=8, kv_params=[None, {}])
    assert [g.token_ids for g in got] == want
