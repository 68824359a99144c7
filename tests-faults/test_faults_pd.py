# SPDX-License-Identifier: Apache-2.0
"""MooncakeConnectorV1 with a peer killed at each step of the exchange, on real engines.

(P killed before D's read and D that never comes are in tests-e2e/test_p2p_lifecycle_e2e.py.)

* a read stalled past D's deadline must not land in blocks vLLM handed to another request;
* D killed while it reads (P granted the claim and holds the blocks for a dead reader);
* P killed after it granted D's claim, before D's read completed;
* P killed while a large read is in flight (the read cut into pieces on a slow link: part
  of the KV has landed in D's blocks when P dies);
* P killed after D read everything.

Faults are placed exactly with hooks inside the engines (``ascend_kv_testing.fault_hooks``)
and a SIGKILL from outside. Every test ends with the survivor serving new requests and
its scheduler and connector holding nothing.
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
    connector_totals,
    failure_counts,
    holds_nothing,
    leak_state,
    start_in_parallel,
    wait_for,
)
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.pd import PROBES, baseline, kv_config, prefill, prompts_of

HOOKS = "ascend_kv_testing.fault_hooks"
BS = 32
LEASE_S = 3.0
DEADLINE_S = 6.0
#: D with a tiny cache whose freed blocks are reused at once (the late-read test)
SMALL_DEADLINE_S = 3.0
SMALL_BLOCKS = 17  # 16 usable: 512 tokens


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("faults-pd-model"))


@pytest.fixture(scope="module")
def engines(model: Path) -> Iterator[dict[str, EngineProcess]]:
    """P ``pa``, ``pb`` and ``pc`` (leases of 3 s), D ``d`` (recompute, 6 s deadline) and D ``dc``
    (fail policy, 3 s deadline, 16 usable blocks)."""
    made = start_in_parallel({
        "pa": lambda: EngineProcess(model, kv_config("kv_producer", "fpd-pa", lease_ttl_s=LEASE_S)),
        "pb": lambda: EngineProcess(model, kv_config("kv_producer", "fpd-pb", lease_ttl_s=LEASE_S)),
        "pc": lambda: EngineProcess(model, kv_config("kv_producer", "fpd-pc", lease_ttl_s=LEASE_S)),
        "d": lambda: EngineProcess(model, kv_config(
            "kv_consumer", "fpd-d", policy="recompute", load_timeout_s=DEADLINE_S,
            handshake_timeout_s=2.0)),
        "dc": lambda: EngineProcess(model, kv_config(
            "kv_consumer", "fpd-dc", policy="fail", load_timeout_s=SMALL_DEADLINE_S,
            handshake_timeout_s=2.0), num_gpu_blocks_override=SMALL_BLOCKS, max_model_len=512),
    })
    yield made
    for engine in made.values():
        engine.close()


def test_a_read_stalled_past_the_deadline_never_lands_in_reused_blocks(
        engines: dict[str, EngineProcess], tmp_path: Path, fault_report: Any) -> None:
    """D's read of X stalls (network) past X's deadline; X fails. Its blocks must not go
    back to vLLM while the read can still land: otherwise the late read overwrites the
    KV of whatever request got them (here Y's cached prefix, seen by Y's next run)."""
    pb, dc = engines["pb"], engines["dc"]
    x, y = prompts_of([200, 440], seed=101)
    want_y = baseline(dc, [y])[0]
    params = prefill(pb, [x])
    stall_s = SMALL_DEADLINE_S + 3.0
    assert dc.call(f"{HOOKS}:pause_before_read", flag_dir=str(tmp_path), max_wait_s=stall_s)
    start = time.monotonic()
    got_x = dc.generate([x], max_tokens=4, kv_params=params)[0]
    x_took = time.monotonic() - start
    assert got_x.finish_reason == "error"  # fail policy: a clear error, not wrong tokens
    # Y takes 14 of the 16 blocks: most of X's old blocks; its full blocks stay cached
    first_y = dc.generate([y], max_tokens=8)[0]
    assert wait_for(lambda: (tmp_path / "resumed").exists(), stall_s + 5)
    time.sleep(1.0)  # the stalled read has resumed and finished by now
    again_y = dc.generate([y], max_tokens=8)[0]
    assert again_y.num_cached_tokens and again_y.num_cached_tokens >= 13 * BS
    assert fault_report.check("survivor", first_y.token_ids == want_y, "Y's first answer")
    assert fault_report.check("survivor", again_y.token_ids == want_y,
                              "a late read overwrote blocks vLLM had reused")
    # X ended once its read could no longer land: the stall, not the deadline, bounds it
    assert fault_report.check("deadline", SMALL_DEADLINE_S <= x_took < stall_s + 5,
                              f"X ended after {x_took:.1f}s")
    t = connector_totals(dc)
    assert t.get("p2p_failures|cause=deadline", 0) == 1
    holds_nothing(dc, fault_report)
    assert fault_report.check("zero", wait_for(lambda: leak_state(pb)["p2p_held"] == 0, 10),
                              "P still held X's blocks")  # D's Done released P
    fault_report(fault="D's read stalls past D's deadline (network stall, then resumes)",
                 happened=f"X failed at its deadline; its blocks went back to vLLM only when "
                          f"the stalled read returned ({x_took:.1f}s); the reused blocks kept "
                          "their KV (Y's cached prefix gave Y's tokens)",
                 deadline=f"failed at {SMALL_DEADLINE_S:.0f}s, released after the read "
                          f"({x_took:.1f}s)",
                 client="clear error (fail policy)")


def test_d_killed_while_p_holds_its_blocks(engines: dict[str, EngineProcess],
                                          fault_report: Any) -> None:
    """D dies in the middle of its read (after P granted the claim): P's lease lapses, P
    frees the blocks exactly once and keeps serving P/D requests."""
    pb, dc, d = engines["pb"], engines["dc"], engines["d"]
    x, w = prompts_of([150, 90], seed=102)
    want_w = baseline(d, [w])[0]
    expired0 = connector_totals(pb).get("p2p_expired_leases", 0)
    params = prefill(pb, [x])
    assert wait_for(lambda: leak_state(pb)["p2p_held"] == 1, 5)  # registered at P's next step
    assert dc.call(f"{HOOKS}:die_on_read")
    with pytest.raises((RuntimeError, EOFError, OSError)):  # the engine process is gone
        dc.generate([x], max_tokens=4, kv_params=params, timeout=60)
    dc.proc.join(10)
    assert not dc.proc.is_alive()
    start = time.monotonic()
    freed = wait_for(lambda: pb.call(f"{PROBES}:step_for", seconds=0.2)["requests"] == 0,
                     LEASE_S + 5)
    took = time.monotonic() - start
    assert fault_report.check("deadline", freed and took < LEASE_S + 5,
                              f"P freed the blocks after {took:.1f}s")
    holds_nothing(pb, fault_report)
    assert connector_totals(pb).get("p2p_expired_leases", 0) - expired0 == 1
    # P serves on: a new P/D request with the surviving D
    got = d.generate([w], max_tokens=8, kv_params=prefill(pb, [w]))[0]
    assert fault_report.check("survivor", got.token_ids == want_w, "P/D answer after the kill")
    holds_nothing(pb, fault_report)
    holds_nothing(d, fault_report)
    fault_report(fault="D killed (SIGKILL) during its read, P holding the blocks",
                 happened=f"P's lease lapsed and P freed the blocks once after {took:.1f}s "
                          f"(lease {LEASE_S:.0f}s); P served the next P/D request",
                 client="D's client: connection lost (D is gone)")


def test_p_killed_after_granting_the_claim(engines: dict[str, EngineProcess], tmp_path: Path,
                                          fault_report: Any) -> None:
    """P dies between granting D's claim and D's read: D's read fails, D recomputes within
    its deadline and serves on."""
    pa, d = engines["pa"], engines["d"]
    x, z = prompts_of([180, 60], seed=103)
    want = baseline(d, [x, z])
    failures0 = sum(failure_counts(d).values())
    params = prefill(pa, [x])
    assert d.call(f"{HOOKS}:pause_before_read", flag_dir=str(tmp_path), max_wait_s=30)
    out: dict[str, Any] = {}

    def decode() -> None:
        t = time.monotonic()
        out["x"] = d.generate([x], max_tokens=8, kv_params=params)[0]
        out["took"] = time.monotonic() - t

    thread = threading.Thread(target=decode)
    thread.start()
    assert wait_for(lambda: (tmp_path / "reading").exists(), 30)
    pa.kill()
    (tmp_path / "go").touch()
    thread.join(120)
    assert out["x"].token_ids == want[0] and out["x"].finish_reason == "length"
    assert fault_report.check("deadline", out["took"] < DEADLINE_S + 5,
                              f"X took {out['took']:.1f}s")
    failures = sum(failure_counts(d).values())
    assert failures - failures0 == 1
    assert fault_report.check("survivor", d.generate([z], max_tokens=8)[0].token_ids == want[1],
                              "D's next answer")
    holds_nothing(d, fault_report)
    fault_report(fault="P killed after granting D's claim, before D's read completed",
                 happened=f"D's read failed; D recomputed the prompt ({out['took']:.1f}s) and "
                          "served the next request",
                 client="the right tokens (recompute policy)")


def test_p_killed_while_a_large_read_is_in_flight(engines: dict[str, EngineProcess],
                                                   tmp_path: Path, fault_report: Any) -> None:
    """P dies while D's read of a long prompt is really on the wire (cut into 64 pieces on
    a slow link, the kill lands after the first piece): the rest of the read fails, D
    recomputes within its deadline (no half-loaded block is served) and serves on."""
    pc, d = engines["pc"], engines["d"]
    x, z = prompts_of([1400, 60], seed=105)
    want = baseline(d, [x, z])
    failures0 = failure_counts(d)
    params = prefill(pc, [x])
    assert d.call(f"{HOOKS}:slow_read", flag_dir=str(tmp_path), pieces=64, pause_s=0.03)
    out: dict[str, Any] = {}

    def decode() -> None:
        t = time.monotonic()
        out["x"] = d.generate([x], max_tokens=8, kv_params=params)[0]
        out["took"] = time.monotonic() - t

    thread = threading.Thread(target=decode)
    thread.start()
    assert wait_for(lambda: (tmp_path / "reading").exists(), 30, interval_s=0.005)
    pc.kill()
    thread.join(120)
    landed, pieces = map(int, (tmp_path / "pieces").read_text().split())
    assert 1 <= landed < pieces, (landed, pieces)  # the kill landed mid-read
    assert out["x"].token_ids == want[0] and out["x"].finish_reason == "length"
    assert fault_report.check("deadline", out["took"] < DEADLINE_S + 5,
                              f"X took {out['took']:.1f}s")
    failures = {k: v - failures0.get(k, 0) for k, v in failure_counts(d).items()
                if v != failures0.get(k, 0)}
    assert sum(failures.values()) == 1, failures
    assert fault_report.check("survivor", d.generate([z], max_tokens=8)[0].token_ids == want[1],
                              "D's next answer")
    # the same prompt again: nothing half-read was cached under its hashes
    assert fault_report.check("survivor", d.generate([x], max_tokens=8)[0].token_ids == want[0],
                              "the same prompt again")
    holds_nothing(d, fault_report)
    cause = next(iter(failures))
    fault_report(fault="P killed while D's read of a long prompt is in flight (1400 tokens, "
                       "the read cut into pieces on a slow link)",
                 happened=f"{landed} of {pieces} pieces had landed; the rest of the read "
                          f"failed (cause {cause}); D recomputed the prompt "
                          f"({out['took']:.1f}s) and served the next request",
                 client="the right tokens (recompute policy)")


def test_p_killed_after_d_read_everything(engines: dict[str, EngineProcess],
                                          fault_report: Any) -> None:
    """P dies once D has its KV: D's request completes untouched and D serves on."""
    pb, d = engines["pb"], engines["d"]
    x, z = prompts_of([120, 70], seed=104)
    want = baseline(d, [x, z])
    loaded0 = connector_totals(d).get("p2p_requests_loaded", 0)
    got = d.generate([x], max_tokens=8, kv_params=prefill(pb, [x]))[0]
    assert got.token_ids == want[0]
    assert connector_totals(d).get("p2p_requests_loaded", 0) - loaded0 == 1
    pb.kill()
    # D's lease renewer and handshake cache still name the dead P: nothing may hang on it
    state_after = d.call(f"{PROBES}:step_for", seconds=2.0)
    assert fault_report.check("deadline", state_after["requests"] == 0,
                              f"D still ran {state_after['requests']} request(s) 2s later")
    assert fault_report.check("survivor", d.generate([z], max_tokens=8)[0].token_ids == want[1],
                              "D's next answer")
    holds_nothing(d, fault_report)
    fault_report(fault="P killed after D read everything",
                 happened="D's request had completed; D served the next request",
                 client="the right tokens")
