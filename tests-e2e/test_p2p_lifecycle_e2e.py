# SPDX-License-Identifier: Apache-2.0
"""MooncakeConnectorV1 when a peer goes away: leases on P, deadlines and recompute on D."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.pd import PREFILL, PROBES, baseline, kv_config, prefill, prompts_of

LEASE_S = 3.0
DEADLINE_S = 8.0


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("pd-fault-model"))


@pytest.fixture(scope="module")
def pd(model: Path) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    p = EngineProcess(model, kv_config("kv_producer", "fault-prefill", lease_ttl_s=LEASE_S))
    try:
        d = EngineProcess(model, kv_config("kv_consumer", "fault-decode", policy="recompute",
                                           load_timeout_s=DEADLINE_S, handshake_timeout_s=2.0))
    except Exception:
        p.close()
        raise
    yield p, d
    d.close()
    p.close()


def test_recompute_policy_gives_the_right_tokens_after_a_failed_load(pd: Any) -> None:
    p, d = pd
    prompts = prompts_of([75], seed=11)
    want = baseline(d, prompts)
    params = prefill(p, prompts)
    bogus = {**params[0], "remote_request_id": "unknown-to-p"}
    got = d.generate(prompts, max_tokens=8, kv_params=[bogus])[0]
    assert got.finish_reason != "error" and got.token_ids == want[0]


def test_p_frees_blocks_when_d_never_comes(pd: Any) -> None:
    """D dies after P prefilled: no Done, no renewal; the lease lapses and P frees once."""
    p, _d = pd
    p.call(f"{PROBES}:step_for", seconds=LEASE_S + 1.0)  # earlier tests' leases run out
    expired_before = p.call(f"{PROBES}:connector_totals").get("p2p_expired_leases", 0)
    start = p.call(f"{PROBES}:scheduler_state")
    p.generate(prompts_of([100], seed=12), max_tokens=1, kv_params=[dict(PREFILL)])
    held = p.call(f"{PROBES}:scheduler_state")
    assert held["requests"] == 1 and held["free_blocks"] < start["free_blocks"]
    state = p.call(f"{PROBES}:step_for", seconds=LEASE_S + 1.5)
    assert state["requests"] == 0 and state["free_blocks"] == start["free_blocks"]
    totals = p.call(f"{PROBES}:connector_totals")
    assert totals.get("p2p_expired_leases", 0) - expired_before == 1


def test_p_killed_before_d_reads(pd: Any) -> None:
    """P dies while D waits: D's request ends within its deadline (recomputed), D serves on."""
    p, d = pd
    prompts = prompts_of([90, 30], seed=13)
    want = baseline(d, prompts)
    params = prefill(p, prompts[:1])
    p.kill()
    start = time.monotonic()
    got = d.generate(prompts[:1], max_tokens=8, kv_params=params)[0]
    assert time.monotonic() - start < DEADLINE_S + 5
    assert got.token_ids == want[0]
    totals = d.call(f"{PROBES}:connector_totals")
    assert sum(v for k, v in totals.items() if k.startswith("p2p_failures")) >= 1
    # D keeps serving ordinary requests and holds nothing
    assert d.generate(prompts[1:], max_tokens=8)[0].token_ids == want[1]
    assert d.wait_idle(20)
    assert d.call(f"{PROBES}:scheduler_state")["requests"] == 0
