# SPDX-License-Identifier: Apache-2.0
"""``inline_reads`` end to end: real vLLM CPU engines for P and D, real Mooncake over TCP.

D starts each window read from vLLM's own ``start_load_kv`` and vLLM's ``get_finished``
polls it to its end (same-host reads off in both engines, so that the bytes go through the
transfer engine, as between hosts). D must produce exactly the tokens a single instance
produces, read every request that way, and free everything; params that were changed on
the way are no window read: they are claimed on a pull thread and refused, failing only
their own request.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.pd import PROBES, baseline, kv_config, prefill, prompts_of
from vllm_ascend.distributed.kv_transfer.core.local_reads import LOCAL_READS_ENV

BS = 32
#: P's read window here: long enough for D to take every request up within it on a busy
#: machine (the default, 1 s, leaves D 0.5 s after the clocks' margin)
WINDOW_S = 10.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("inline-model"))


@pytest.fixture(scope="module")
def pd(model: Path) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    env = {LOCAL_READS_ENV: "0"}
    p = EngineProcess(model, kv_config("kv_producer", "e2e-inline-prefill", lease_ttl_s=60,
                                       read_window_s=WINDOW_S), env=env)
    try:
        d = EngineProcess(model, kv_config("kv_consumer", "e2e-inline-decode",
                                           inline_reads=True), env=env)
    except Exception:
        p.close()
        raise
    yield p, d
    d.close()
    p.close()


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


def test_inline_reads_load_what_a_single_instance_computes(pd: Any) -> None:
    p, d = pd
    # D's first request to P goes to a pull thread: D fetches P's metadata there
    first = prompts_of([40], seed=10)
    want = baseline(d, first)
    before = d.call(f"{PROBES}:connector_totals")
    assert [g.token_ids for g in d.generate(first, max_tokens=8,
                                            kv_params=prefill(p, first))] == want
    after = d.call(f"{PROBES}:connector_totals")
    assert _delta(after, before, "p2p_requests_loaded") == 1
    assert _delta(after, before, "p2p_inline_reads") == 0
    lengths = [5, BS, BS + 1, 2 * BS + 1, 3 * BS - 1, 200]
    prompts = prompts_of(lengths, seed=11)
    want = baseline(d, prompts)
    before = d.call(f"{PROBES}:connector_totals")
    params = prefill(p, prompts)
    got = d.generate(prompts, max_tokens=8, kv_params=params)  # all at once
    assert [g.token_ids for g in got] == want
    after = d.call(f"{PROBES}:connector_totals")
    for key in ("p2p_requests_loaded", "p2p_inline_reads", "p2p_window_reads"):
        assert _delta(after, before, key) == len(prompts), key
    assert _delta(after, before, "p2p_transfer_bytes") > 0
    assert p.wait_idle(30)  # P freed every block (after its window)
    state = p.call(f"{PROBES}:scheduler_state")
    assert state["requests"] == 0 and state["free_blocks"] == state["total_blocks"] - 1


def test_changed_params_fail_only_their_request(pd: Any) -> None:
    p, d = pd
    prompts = prompts_of([70, 70], seed=12)
    want = baseline(d, prompts[1:])
    before = d.call(f"{PROBES}:connector_totals")
    params = prefill(p, prompts)
    bogus = {**params[0], "remote_request_id": "a-request-p-never-had"}
    res = d.generate(prompts, max_tokens=8, kv_params=[bogus, params[1]])
    assert res[0].finish_reason == "error" and res[0].token_ids == []
    assert res[1].token_ids == want[0]
    after = d.call(f"{PROBES}:connector_totals")
    assert _delta(after, before, "p2p_inline_reads") == 1  # the good one only
    # the real params of the first still load (P held its blocks; D's claim of the bogus id
    # was retried for CLAIM_RETRY_S, so this one may come after the window and be claimed):
    # P is left holding none
    d.reset_prefix_cache()
    ok = d.generate(prompts[:1], max_tokens=8, kv_params=[params[0]])[0]
    assert ok.token_ids == baseline(d, prompts[:1])[0]
    assert _delta(d.call(f"{PROBES}:connector_totals"), after, "p2p_requests_loaded") == 1
    assert d.wait_idle(20)
    assert d.call(f"{PROBES}:scheduler_state")["requests"] == 0
    assert p.wait_idle(30)
