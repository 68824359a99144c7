# SPDX-License-Identifier: Apache-2.0
"""D retries a pull that a stalled or dropped read, or a starved side channel, broke.

Real P and D workers in one process, bytes over the real Mooncake transfer engine on
loopback. Faults: the engine's read returns rc=-1 (what Mooncake's TCP transport returns
once it dropped a connection without progress), P's side channel answers too late (a P
process starved of CPU), P's lease lapses while D waits to retry. The request must
complete with P's bytes while the deadline and the lease leave time, every retry counted,
and otherwise fail exactly once; P's held blocks are freed either way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from p2p_worker_harness import numbered_caches, pd_vllm_config

from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.params import RemotePrefill
from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import Claim, GetMeta
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull import reader as pull_reader
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import (
    MooncakeConnectorMetadata,
    RecvMeta,
    SendMeta,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.worker import PullWorker

BS, NB, HEADS, HD, LAYERS = 16, 12, 4, 8, 2


@pytest.fixture(autouse=True, params=["overlapped", "claims_first"])
def claim_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The first try overlaps its claims with the read, or claims first."""
    monkeypatch.setattr(pull_reader, "OVERLAP_MIN_CPUS",
                        0 if request.param == "overlapped" else 1 << 30)
    return str(request.param)


#: D's retries here: a short first back-off, "unknown request" not retried long
D_RETRIES = {"read_retry": {"delay_s": 0.05}, "claim_retry": {"deadline_s": 0.3}}


def _vllm_config(role: str, kv_port: int) -> Any:
    return pd_vllm_config(role, kv_port, block_size=BS, heads=HEADS)


def _worker(role: str, port: int, engine: str, cfg: dict[str, Any]) -> PullWorker:
    return PullWorker(_vllm_config(role, port), MooncakeP2PConfig.from_dict(cfg), engine,
                      MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)


def _caches(fill: bool) -> dict[str, Any]:
    return numbered_caches(fill, layers=LAYERS, blocks=NB, heads=HEADS, block_size=BS,
                           head_size=HD)


@pytest.fixture
def pd() -> Iterator[Any]:
    p_port, d_port = free_port(), free_port()
    p = _worker("kv_producer", p_port, "P", {"lease_ttl_s": 30.0})
    d = _worker("kv_consumer", d_port, "D", {"load_timeout_s": 6.0, "handshake_timeout_s": 0.5,
                                            **D_RETRIES})
    p.register_kv_caches(_caches(fill=True))
    d.register_kv_caches(_caches(fill=False))
    ns = SimpleNamespace(p=p, d=d, p_port=p_port)
    yield ns
    ns.p.shutdown()
    ns.d.shutdown()  # the test's own D where it made one


class FlakyEngine:
    """Mooncake's engine whose first ``fail`` reads return rc=-1 (a dropped connection)
    after ``stall_s``; everything else goes to the real engine.

    A read is one synchronous call (``VLLM_ASCEND_KV_TE_WAIT=spin``), or a thread's run of
    asynchronous submissions up to its next status poll (``yield``, the default, and
    ``submit_read``): every range of a failing read ends failed, ``stall_s`` after it was
    submitted."""

    def __init__(self, real: Any, fail: int, stall_s: float = 0.0,
                 on_fail: Any = None) -> None:
        self.real, self.fail, self.stall_s, self.on_fail = real, fail, stall_s, on_fail
        self.reads = 0
        self._lock = threading.Lock()
        # per thread: whether it submitted since its last poll, and whether that read fails
        self._submitting: dict[int, bool] = {}
        self._failing: dict[int, bool] = {}
        # batch ids of failing ranges -> (when they fail, whether on_fail is still owed)
        self._dropped: dict[int, list[Any]] = {}
        self._next_id = 1 << 62

    def _take_failure(self) -> bool:
        with self._lock:
            self.reads += 1
            failing = self.fail > 0
            self.fail -= failing
            return failing

    def _fail_now(self) -> int:
        if self.on_fail is not None:
            self.on_fail()
        return -1

    def batch_transfer_sync_read(self, *args: Any) -> int:
        if self._take_failure():
            time.sleep(self.stall_s)
            return self._fail_now()
        return int(self.real.batch_transfer_sync_read(*args))

    def batch_transfer_async_read(self, *args: Any) -> int:
        tid = threading.get_ident()
        if not self._submitting.get(tid):  # the first range of a read
            self._submitting[tid] = True
            self._failing[tid] = self._take_failure()
            owed = True
        else:
            owed = False
        if not self._failing[tid]:
            return int(self.real.batch_transfer_async_read(*args))
        with self._lock:
            self._next_id += 1
            self._dropped[self._next_id] = [time.monotonic() + self.stall_s, owed]
            return self._next_id

    def transfer_check_status(self, batch: int) -> int:
        self._submitting[threading.get_ident()] = False
        dropped = self._dropped.get(batch)
        if dropped is None:
            return int(self.real.transfer_check_status(batch))
        if time.monotonic() < dropped[0]:
            return 0
        del self._dropped[batch]
        return self._fail_now() if dropped[1] else -1

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def _hold(pd: Any, rid: str, blocks: list[int]) -> None:
    pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={rid: SendMeta(rid, blocks)}))


def _recv(pd: Any, rid: str, remote_rid: str, remote_blocks: list[int],
          local: list[int]) -> None:
    remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=pd.p_port,
                           request_id=remote_rid, block_ids=remote_blocks, tp_size=1,
                           pcp_size=1, dcp_size=1)
    pd.d.start_load_kv(MooncakeConnectorMetadata(requests={rid: RecvMeta(
        rid, local, remote, remote_block_ids=remote_blocks)}))


def _ends(worker: PullWorker, rid: str, timeout: float = 30.0) -> tuple[int, set[int]]:
    """Poll D until ``rid`` ended; then keep polling a little: how often it was reported
    finished, and the blocks reported as failed."""
    deadline = time.monotonic() + timeout
    seen, failed = 0, set()
    while time.monotonic() < deadline:
        _s, recving = worker.get_finished()
        failed |= worker.get_block_ids_with_load_errors()
        if recving and rid in recving:
            seen += 1
            deadline = min(deadline, time.monotonic() + 1.0)
        time.sleep(0.01)
    assert seen, f"{rid} did not finish within {timeout}s"
    return seen, failed


def _released(p: PullWorker, rid: str, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sending, _r = p.get_finished()
        if sending and rid in sending:
            assert p.holder is not None and len(p.holder.held) == 0
            return True
        time.sleep(0.01)
    return False


def _same_bytes(pd: Any, local: list[int], remote: list[int]) -> None:
    assert pd.d.layout is not None and pd.p.layout is not None
    for layer in range(LAYERS):
        d_t = pd.d.layout.layers[layer].regions[0].tensor
        p_t = pd.p.layout.layers[layer].regions[0].tensor
        for lb, rb in zip(local, remote, strict=True):
            torch.testing.assert_close(d_t[lb], p_t[rb], rtol=0, atol=0)


@pytest.mark.parametrize("wait", ["yield", "spin"])
def test_a_dropped_read_is_retried_and_the_request_completes(
        pd: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        wait: str) -> None:
    assert pd.d.te is not None
    flaky = FlakyEngine(pd.d.te.raw, fail=1, stall_s=0.3)
    monkeypatch.setattr(pd.d.te, "_engine", flaky)
    monkeypatch.setattr(pd.d.te, "wait", wait)  # the default, and Mooncake's own wait
    _hold(pd, "r", [7, 2, 9])
    with caplog.at_level("WARNING", logger=pull_reader.__name__):
        _recv(pd, "d", "r", [7, 2, 9], [1, 4, 5])
        seen, failed = _ends(pd.d, "d")
    assert (seen, failed) == (1, set())
    _same_bytes(pd, [1, 4, 5], [7, 2, 9])
    rec = pd.d.recorder
    assert rec.total("p2p_read_retries", reason="transfer") == 1
    assert rec.total("p2p_requests_loaded") == 1
    assert not any(k.startswith("p2p_failures") for k in rec.totals())
    assert flaky.reads >= 2
    warnings = [r for r in caplog.records if "retry 1/" in r.getMessage()]
    assert len(warnings) == 1 and "rc=-1" in warnings[0].getMessage()
    assert _released(pd.p, "r")  # D's Done freed P's blocks once
    assert pd.p.recorder.total("p2p_requests_served") == 1


def test_a_starved_side_channel_is_retried_within_the_deadline(pd: Any) -> None:
    """P's side channel answers GetMeta and the first Claim only after D's 0.5 s timeout
    (a P process without CPU time): D asks again instead of failing the request."""
    server = pd.p.holder.server
    real = server.handler
    slow = {"GetMeta": 1, "Claim": 1}

    def starved(msg: Any) -> Any:
        kind = type(msg).__name__
        if isinstance(msg, (GetMeta, Claim)) and slow[kind] > 0:
            slow[kind] -= 1
            time.sleep(0.8)
        return real(msg)

    server.handler = starved
    _hold(pd, "r", [3, 4])
    _recv(pd, "d", "r", [3, 4], [6, 7])
    seen, failed = _ends(pd.d, "d")
    assert (seen, failed) == (1, set())
    _same_bytes(pd, [6, 7], [3, 4])
    assert pd.d.recorder.total("p2p_read_retries", reason="peer_timeout") >= 1
    assert pd.d.recorder.total("p2p_requests_loaded") == 1
    assert _released(pd.p, "r")


#: D's deadline in the test of reads failing until it (room for several retries)
FAILING_DEADLINE_S = 3.0


def test_reads_failing_until_the_deadline_fail_the_request_once(
        pd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read drops: D retries within its 3 s deadline (at most READ_RETRIES times),
    then the request fails exactly once, its blocks reported once, and P is told."""
    pd.d.shutdown()  # a D whose deadline (not the retry count) ends the load, sooner
    pd.d = _worker("kv_consumer", free_port(), "D", {
        "load_timeout_s": FAILING_DEADLINE_S, "handshake_timeout_s": 0.5, **D_RETRIES,
        "read_retry": {"delay_s": 0.05, "max_delay_s": 0.5}})
    pd.d.register_kv_caches(_caches(fill=False))
    assert pd.d.te is not None
    flaky = FlakyEngine(pd.d.te.raw, fail=1 << 30, stall_s=0.4)
    monkeypatch.setattr(pd.d.te, "_engine", flaky)
    _hold(pd, "r", [1, 2])
    start = time.monotonic()
    _recv(pd, "d", "r", [1, 2], [3, 4])
    seen, failed = _ends(pd.d, "d")
    took = time.monotonic() - start
    assert (seen, failed) == (1, {3, 4})
    rec = pd.d.recorder
    retries = rec.total("p2p_read_retries", reason="transfer")
    assert 1 <= retries <= pd.d.cfg.read_retry.retries
    failures = {k: v for k, v in rec.totals().items() if k.startswith("p2p_failures")}
    assert sum(failures.values()) == 1, failures
    assert retries >= 2  # the deadline left room for more than one retry
    assert took < FAILING_DEADLINE_S + 2.0
    assert _released(pd.p, "r")  # Done(success=False): P did not wait for its lease


def test_a_lease_gone_meanwhile_is_not_retried(pd: Any, monkeypatch: pytest.MonkeyPatch,
                                               claim_mode: str) -> None:
    """The read drops, and P frees the blocks before D's retry (its lease lapsed): the
    retry's claim is refused and the request fails at once, as released."""
    assert pd.d.te is not None

    def lapse() -> None:
        assert pd.p.holder is not None
        pd.p.holder.held.complete("r")
        pd.p.holder._release("r")

    monkeypatch.setattr(pd.d.te, "_engine", FlakyEngine(pd.d.te.raw, fail=1, on_fail=lapse))
    _hold(pd, "r", [5])
    _recv(pd, "d", "r", [5], [8])
    seen, failed = _ends(pd.d, "d")
    assert (seen, failed) == (1, {8})
    # overlapped, the claim may be answered after the lapse: refused before any retry
    retries = pd.d.recorder.total("p2p_read_retries", reason="transfer")
    assert retries == 1 if claim_mode == "claims_first" else retries <= 1
    assert pd.d.recorder.total("p2p_failures", cause="released") == 1


def test_a_p_that_refuses_connections_is_not_retried(pd: Any) -> None:
    """Nothing listens on P's side channel any more (P died): no retry, a fast failure."""
    assert pd.p.holder is not None
    pd.p.holder.stop()
    _hold(pd, "r", [5])
    start = time.monotonic()
    _recv(pd, "d", "r", [5], [8])
    seen, failed = _ends(pd.d, "d")
    assert (seen, failed) == (1, {8})
    assert time.monotonic() - start < 1.0 + 1.5  # one 0.5 s timeout, no retries
    assert pd.d.recorder.total("p2p_read_retries", reason="peer_timeout") == 0
    assert pd.d.recorder.total("p2p_failures", cause="peer_timeout") == 1


def test_retries_and_concurrent_loads(pd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four requests at once, four reads dropping: all complete, each once."""
    assert pd.d.te is not None
    monkeypatch.setattr(pd.d.te, "_engine", FlakyEngine(pd.d.te.raw, fail=4, stall_s=0.1))
    for i in range(4):
        _hold(pd, f"r{i}", [i])
        _recv(pd, f"d{i}", f"r{i}", [i], [4 + i])
    deadline = time.monotonic() + 30
    ended: list[str] = []
    failed: set[int] = set()
    while time.monotonic() < deadline and len(ended) < 4:
        _s, recving = pd.d.get_finished()
        ended += sorted(recving or ())
        failed |= pd.d.get_block_ids_with_load_errors()
        time.sleep(0.01)
    assert sorted(ended) == ["d0", "d1", "d2", "d3"] and failed == set()
    _same_bytes(pd, [4, 5, 6, 7], [0, 1, 2, 3])
    assert pd.d.recorder.total("p2p_read_retries", reason="transfer") == 4


def test_read_retry_attempts_bound_the_retries(pd: Any,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """``read_retry.attempts`` 3: every read drops, D reads three times in all (two retries)
    and fails the request once, well before its deadline."""
    pd.d.shutdown()
    pd.d = _worker("kv_consumer", free_port(), "D", {
        "load_timeout_s": 20.0, "handshake_timeout_s": 0.5, **D_RETRIES,
        "read_retry": {"attempts": 3, "delay_s": 0.05}})
    pd.d.register_kv_caches(_caches(fill=False))
    assert pd.d.te is not None
    flaky = FlakyEngine(pd.d.te.raw, fail=1 << 30)
    monkeypatch.setattr(pd.d.te, "_engine", flaky)
    _hold(pd, "r", [1, 2])
    start = time.monotonic()
    _recv(pd, "d", "r", [1, 2], [3, 4])
    seen, failed = _ends(pd.d, "d")
    assert (seen, failed) == (1, {3, 4})
    assert time.monotonic() - start < 10.0  # not the 20 s deadline
    assert pd.d.recorder.total("p2p_read_retries", reason="transfer") == 2
    assert flaky.reads == 3
    assert pd.d.recorder.total("p2p_failures", cause="transfer") == 1


def test_claim_retry_attempts_bound_the_claims_p_does_not_know(pd: Any) -> None:
    """``claim_retry`` with 3 attempts: P answers "unknown request" to every claim (it never
    held the request); D claims three times, then fails the request with P's answer."""
    pd.d.shutdown()
    pd.d = _worker("kv_consumer", free_port(), "D", {
        "load_timeout_s": 20.0, "handshake_timeout_s": 0.5,
        "claim_retry": {"attempts": 3, "deadline_s": None, "delay_s": 0.01}})
    pd.d.register_kv_caches(_caches(fill=False))
    server = pd.p.holder.server
    real = server.handler
    claims: list[str] = []

    def counting(msg: Any) -> Any:
        if isinstance(msg, Claim):
            claims.append(msg.request_id)
        return real(msg)

    server.handler = counting
    start = time.monotonic()
    _recv(pd, "d", "never-held", [1], [3])
    seen, failed = _ends(pd.d, "d")
    assert (seen, failed) == (1, {3})
    assert claims == ["never-held"] * 3
    assert time.monotonic() - start < 10.0
    assert pd.d.recorder.total("p2p_failures", cause="unknown_request") == 1
