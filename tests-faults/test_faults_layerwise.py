# SPDX-License-Identifier: Apache-2.0
"""MooncakeLayerwiseConnector (P pushes each layer into D's blocks) with a peer killed
mid-push, on real engines.

* D killed (SIGKILL) while P pushes into its blocks and holds D's write lease: P's writes
  stop once the lease can no longer be renewed, P frees the request's blocks and its push
  state, and serves the next P/D request;
* P killed (SIGKILL) mid-push, after part of the prompt's layers landed in D's blocks: D
  stops waiting when P's write lease lapses (well before its deadline), recomputes the
  prompt, holds nothing afterwards and serves on.

D stands in for the proxy's metaserver with ``ascend_kv_testing.pd.Metaserver``. The D
test runs first (the P test kills the only P). Leases of 3 s with a 1 s transfer stall
bound (``MC_TCP_PROGRESS_TIMEOUT_SEC=1``, as in tests-e2e/test_p2p_layerwise_engine_e2e.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.faults import (
    PUSH_STATE,
    failure_counts,
    holds_nothing,
    start_in_parallel,
    wait_for,
)
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.pd import LAYERWISE, PROBES, Metaserver, baseline, kv_config, prompts_of

HOOKS = "ascend_kv_testing.fault_hooks"
LEASE_S = 3.0
DEADLINE_S = 8.0
ENV = {"MC_TCP_PROGRESS_TIMEOUT_SEC": "1"}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("faults-lw-model"))


@pytest.fixture(scope="module")
def lw(model: Path) -> Iterator[dict[str, Any]]:
    """P ``p`` (chunked prefill, 64 tokens a step), D ``d`` (survivor) and D ``dk`` (killed),
    both D with 3 s write leases, an 8 s deadline and the recompute policy."""
    made = start_in_parallel({
        "p": lambda: EngineProcess(model, kv_config(
            "kv_producer", "flw-p", connector=LAYERWISE, lease_ttl_s=LEASE_S,
            handshake_timeout_s=2.0), max_num_batched_tokens=64, env=ENV),
        **{name: (lambda name=name: EngineProcess(model, kv_config(
            "kv_consumer", f"flw-{name}", policy="recompute", connector=LAYERWISE,
            load_timeout_s=DEADLINE_S, lease_ttl_s=LEASE_S), env=ENV))
           for name in ("d", "dk")},
    })
    meta = Metaserver()
    yield {**made, "meta": meta}
    meta.close()
    for engine in made.values():
        engine.close()


def test_d_killed_while_p_pushes(lw: dict[str, Any], tmp_path: Path,
                                 fault_report: Any) -> None:
    """D dies after P's first layer write, while P holds its write lease: P stops
    pushing once the lease cannot be renewed, frees the blocks, serves on."""
    p, d, dk, meta = lw["p"], lw["d"], lw["dk"], lw["meta"]
    x, w = prompts_of([200, 90], seed=701)
    want_w = baseline(d, [w])[0]
    fail0 = failure_counts(p)
    out: dict[str, Any] = {}
    rid, thread = meta.start_decode(dk, x, out, prefix="flw")
    posted = meta.wait([rid])
    assert p.call(f"{HOOKS}:pause_push", flag_dir=str(tmp_path), after_writes=1, max_wait_s=30)
    p_out: dict[str, Any] = {}
    p_thread = threading.Thread(target=lambda: p_out.update(
        r=p.generate([x], max_tokens=1, kv_params=posted)[0]), daemon=True)
    p_thread.start()
    assert wait_for(lambda: (tmp_path / "pushing").exists(), 60)
    dk.kill()
    thread.join(30)
    assert "error" in out  # D's client: the engine is gone
    killed = time.monotonic()
    time.sleep(LEASE_S)  # P's write window under the lease has passed meanwhile
    (tmp_path / "go").touch()
    p_thread.join(60)
    assert p_out["r"].finish_reason == "length"  # P's own client got its prefill answer
    freed = wait_for(lambda: p.call(f"{PROBES}:step_for", seconds=0.2)["requests"] == 0, 20)
    took = time.monotonic() - killed
    assert fault_report.check("deadline", freed and took < LEASE_S + 15,
                              f"P freed the blocks {took:.1f}s after the kill"), took
    holds_nothing(p, fault_report, zero=PUSH_STATE)
    fail1 = failure_counts(p)
    causes = {k: v - fail0.get(k, 0) for k, v in fail1.items() if v != fail0.get(k, 0)}
    assert sum(causes.values()) >= 1, causes  # the push was stopped and counted
    # P serves on: a new layerwise request to the surviving D
    got = meta.pd_once(p, d, w, prefix="flw")
    assert fault_report.check("survivor", got.token_ids == want_w
                              and got.finish_reason == "length", "P/D answer after the kill")
    holds_nothing(p, fault_report, zero=PUSH_STATE)
    holds_nothing(d, fault_report, zero=PUSH_STATE)
    fault_report(fault="layerwise: D killed (SIGKILL) while P pushes into its blocks",
                 happened=f"P's next write found the lease lapsed and D gone; P stopped the push "
                          f"({', '.join(sorted(causes))}), freed the blocks and its push state "
                          f"{took:.1f}s after the kill (lease {LEASE_S:.0f}s); P served the "
                          "next P/D request",
                 client="P's client: its prefill answer; D's client: connection lost")


def test_p_killed_mid_push(lw: dict[str, Any], fault_report: Any) -> None:
    """P dies after its first layer write into D's blocks: D fails the load when P's lease
    lapses, recomputes within its deadline and serves on."""
    p, d, meta = lw["p"], lw["d"], lw["meta"]
    x, z = prompts_of([200, 70], seed=702)
    want = baseline(d, [x, z])
    fail0 = failure_counts(d)
    out: dict[str, Any] = {}
    rid, thread = meta.start_decode(d, x, out, prefix="flw")
    posted = meta.wait([rid])
    assert p.call(f"{HOOKS}:die_mid_push", after_writes=2)
    with pytest.raises((RuntimeError, EOFError, OSError)):  # P's process is gone
        p.generate([x], max_tokens=1, kv_params=posted, timeout=60)
    p.proc.join(10)
    assert not p.proc.is_alive()
    thread.join(60)
    got = out["d"]
    assert got.token_ids == want[0] and got.finish_reason == "length"
    assert fault_report.check("deadline", out["took"] < DEADLINE_S + 5,
                              f"D's request took {out['took']:.1f}s"), out["took"]
    fail1 = failure_counts(d)
    causes = {k: v - fail0.get(k, 0) for k, v in fail1.items() if v != fail0.get(k, 0)}
    assert causes == {"peer_lost": 1}, causes  # P's lease lapsed, not the deadline
    assert fault_report.check("survivor", d.generate([z], max_tokens=8)[0].token_ids == want[1],
                              "D's next answer")
    holds_nothing(d, fault_report, zero=PUSH_STATE)
    fault_report(fault="layerwise: P killed (SIGKILL) mid-push (after 2 layer writes)",
                 happened=f"D failed the load when P's write lease lapsed (cause peer_lost), "
                          f"recomputed the prompt ({out['took']:.1f}s, deadline "
                          f"{DEADLINE_S:.0f}s) and served the next request",
                 client="the right tokens (recompute policy)")
