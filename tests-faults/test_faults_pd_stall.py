# SPDX-License-Identifier: Apache-2.0
"""A P process paused (SIGSTOP) while D pulls from it: D retries within its deadline.

What a 2-core machine under load does to a P/D pair (issue 18, "real client load"): P gets
no CPU for seconds, so D's ``GetMeta`` to P times out, or D's read makes no progress and
Mooncake's TCP transport drops it (``MC_TCP_PROGRESS_TIMEOUT_SEC``, then rc=-1). Here P is
a real process (a P worker of ``MooncakeConnectorV1`` over the real transfer engine) that
the test stops and continues; D is a D worker in the test process.

* P paused before D's first ``GetMeta``: D asks again, the request completes;
* P paused while D reads (right after P granted the claim): the read drops after the
  progress bound, D retries on a fresh session once P runs again, the request completes
  with P's bytes, the retries are counted, and D's ``Done`` frees P's blocks;
* P paused past D's deadline: the request fails at its deadline, exactly once, and P's
  blocks are freed (D's ``Done`` once P runs again, or P's lease).

* P paused as D's window read goes out from vLLM's thread (``inline_reads``): vLLM's
  ``get_finished`` never waits for it; the read drops after the progress bound, and a pull
  thread claims and loads the request once P runs again.

These go over the transfer engine: D's same-host reads are off for them (P offers them).
With them on, D copies P's blocks from P's memory, which needs no CPU of P's:

* P paused while D reads from its memory: the read ends at once with P's bytes, no retry.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ascend_kv_testing.faults import wait_for
from vllm_ascend.distributed.kv_transfer.core.local_reads import LOCAL_READS_ENV
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.core.transfer_engine import peek_transfer_engine
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.params import RemotePrefill
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import (
    MooncakeConnectorMetadata,
    RecvMeta,
    window_tag,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.worker import PullWorker

BS, NB, HEADS, HD, LAYERS = 16, 32, 4, 32, 4
#: Mooncake's bound on a transfer without progress, in both processes
PROGRESS_S = 2
LEASE_S = 8.0
HANDSHAKE_S = 1.0

# P: a worker of MooncakeConnectorV1 that holds what the test tells it on stdin
# ("hold <rid> <b,b,...>", "held?") and steps like an engine (expiring leases).
P_SCRIPT = r"""
import sys, threading, time, queue
from types import SimpleNamespace
import torch
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import (
    MooncakeConnectorMetadata, SendMeta)
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.worker import PullWorker

port, lease, bs, nb, heads, hd, layers = sys.argv[1:8]
bs, nb, heads, hd, layers = int(bs), int(nb), int(heads), int(hd), int(layers)
kvc = SimpleNamespace(kv_port=int(port), is_kv_producer=True, is_kv_consumer=False,
                      kv_connector_extra_config={})
cfg = SimpleNamespace(
    kv_transfer_config=kvc,
    parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0,
                                    pipeline_parallel_size=1),
    cache_config=SimpleNamespace(block_size=bs),
    model_config=SimpleNamespace(model="/models/stall", get_total_num_kv_heads=lambda: heads),
    instance_id="stall-p-1")  # vLLM's start of this engine: P stamps read windows with it
p = PullWorker(cfg, MooncakeP2PConfig.from_dict({"lease_ttl_s": float(lease)}), "P",
               MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
caches = {}
for layer in range(layers):
    t = torch.arange(nb * heads * bs * 2 * hd, dtype=torch.float32).view(nb, heads, bs, 2 * hd)
    caches[f"model.layers.{layer}.self_attn.attn"] = t + layer * 1e7
p.register_kv_caches(caches)
commands = queue.Queue()
threading.Thread(target=lambda: [commands.put(l.split()) for l in sys.stdin],
                 daemon=True).start()
print("ready", p.instance, p.cfg.hold_window_s, flush=True)
while True:
    p.get_finished()  # an engine step: expires lapsed leases
    try:
        cmd = commands.get(timeout=0.01)
    except queue.Empty:
        continue
    if cmd[0] == "hold":
        blocks = [int(b) for b in cmd[2].split(",")]
        p.start_load_kv(MooncakeConnectorMetadata(
            requests_to_send={cmd[1]: SendMeta(cmd[1], blocks)}))
    elif cmd[0] == "held?":
        print("held", len(p.holder.held), p.recorder.total("p2p_expired_leases"), flush=True)
    elif cmd[0] == "quit":
        break
p.shutdown()
"""


def expected(layer: int, block: int) -> torch.Tensor:
    """P's block ``block`` of layer ``layer`` (as P_SCRIPT fills it)."""
    t = torch.arange(NB * HEADS * BS * 2 * HD, dtype=torch.float32).view(NB, HEADS, BS, 2 * HD)
    return t[block] + layer * 1e7


class PProcess:
    """The P worker's process, driven over stdin/stdout."""

    def __init__(self, port: int) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path),
                   MC_TCP_PROGRESS_TIMEOUT_SEC=str(PROGRESS_S), **{LOCAL_READS_ENV: "1"})
        self.proc = subprocess.Popen(
            [sys.executable, "-c", P_SCRIPT, str(port), str(LEASE_S), str(BS), str(NB),
             str(HEADS), str(HD), str(LAYERS)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._lock = threading.Lock()
        ready = self._line().split()
        assert ready[0] == "ready"
        #: P's instance and read window (what its scheduler puts in a request's params)
        self.instance, self.hold_s = ready[1], float(ready[2])
        self._cont: threading.Timer | None = None

    def _line(self) -> str:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"P exited ({self.proc.poll()})")
            if line.startswith(("ready", "held")):
                return line

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def hold(self, rid: str, blocks: list[int]) -> None:
        self.send(f"hold {rid} {','.join(map(str, blocks))}")

    def held(self) -> tuple[int, int]:
        """Requests P holds, and leases that lapsed (answers only while P runs)."""
        with self._lock:
            self.send("held?")
            _, n, expired = self._line().split()
        return int(n), int(float(expired))

    def pause(self, seconds: float) -> None:
        """SIGSTOP now, SIGCONT after ``seconds``."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        self._cont = threading.Timer(seconds, self.resume)
        self._cont.start()

    def resume(self) -> None:
        """SIGCONT now (a pending timed resume is dropped: it would end a later pause)."""
        if self._cont is not None and self._cont is not threading.current_thread():
            self._cont.cancel()
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self._cont is not None:
            self._cont.cancel()
        self.resume()
        try:
            self.send("quit")
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def progress_env() -> Iterator[None]:
    """D's transfer engine drops a transfer without progress after PROGRESS_S (if this
    process has no engine yet; otherwise the tests size their stalls to its bound), and D
    reads over it (same-host reads off, unless a test turns them on)."""
    saved = {k: os.environ.get(k) for k in ("MC_TCP_PROGRESS_TIMEOUT_SEC", LOCAL_READS_ENV)}
    if peek_transfer_engine() is None:
        os.environ["MC_TCP_PROGRESS_TIMEOUT_SEC"] = str(PROGRESS_S)
    os.environ[LOCAL_READS_ENV] = "0"
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="module")
def p(progress_env: None) -> Iterator[Any]:
    port = free_port()
    proc = PProcess(port)
    yield SimpleNamespace(proc=proc, port=port)
    proc.close()


def d_worker(load_timeout_s: float, **extra: Any) -> PullWorker:
    kvc = SimpleNamespace(kv_port=free_port(), is_kv_producer=False, is_kv_consumer=True,
                          kv_connector_extra_config={})
    cfg = SimpleNamespace(
        kv_transfer_config=kvc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0,
                                        pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=BS),
        model_config=SimpleNamespace(model="/models/stall",
                                     get_total_num_kv_heads=lambda: HEADS))
    d = PullWorker(cfg, MooncakeP2PConfig.from_dict({
        "load_timeout_s": load_timeout_s, "handshake_timeout_s": HANDSHAKE_S, **extra}), "D",
        MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    d.register_kv_caches({f"model.layers.{layer}.self_attn.attn":
                          torch.zeros(NB, HEADS, BS, 2 * HD) for layer in range(LAYERS)})
    return d


def pull(d: PullWorker, p: Any, rid: str, remote: list[int], local: list[int], *,
         window: bool = False) -> None:
    """D loads ``remote`` into ``local``; ``window``: with the params of a request held just
    now in P's read window (as P's scheduler stamps them), else without (claimed)."""
    stamp: dict[str, Any] = {}
    if window:
        held_at = time.time()
        stamp = {"instance": p.proc.instance, "held_at": held_at, "hold_s": p.proc.hold_s,
                 "window_tag": window_tag(instance=p.proc.instance, request_id=rid,
                                          block_ids=remote, held_at=held_at,
                                          hold_s=p.proc.hold_s, token="")}
    r = RemotePrefill(engine_id="P", host="127.0.0.1", port=p.port, request_id=rid,
                      block_ids=remote, tp_size=1, pcp_size=1, dcp_size=1, **stamp)
    d.start_load_kv(MooncakeConnectorMetadata(requests={rid: RecvMeta(
        rid, local, r, remote_block_ids=remote)}))


def ends(d: PullWorker, rid: str, timeout: float) -> tuple[int, set[int], float]:
    """Step D (get_finished) until ``rid`` ended and 1 s more: how often it was reported,
    the failed blocks, and when it ended."""
    start = time.monotonic()
    deadline = start + timeout
    seen, failed, took = 0, set(), -1.0
    while time.monotonic() < deadline:
        _s, recving = d.get_finished()
        failed |= d.get_block_ids_with_load_errors()
        if recving and rid in recving:
            seen += 1
            took = time.monotonic() - start
            deadline = min(deadline, time.monotonic() + 1.0)
        time.sleep(0.01)
    return seen, failed, took


def same_bytes(d: PullWorker, local: list[int], remote: list[int]) -> bool:
    assert d.layout is not None
    return all(torch.equal(d.layout.layers[layer].regions[0].tensor[lb], expected(layer, rb))
               for layer in range(LAYERS) for lb, rb in zip(local, remote, strict=True))


def stall_bound() -> float:
    te = peek_transfer_engine()
    return te.stall_bound_s if te is not None else float(PROGRESS_S)


def pause_on_read(d: PullWorker, p: Any, seconds: float) -> threading.Event:
    """D's next read pauses P first (P granted the claim; its process stops)."""
    reader = d.reader
    assert reader is not None
    original = reader._read
    paused = threading.Event()

    def read(*args: Any, **kwargs: Any) -> Any:
        reader._read = original
        p.proc.pause(seconds)
        paused.set()
        return original(*args, **kwargs)

    reader._read = read
    return paused


def warm(d: PullWorker, p: Any, rid: str) -> None:
    """A first request: D's handshake with P is cached, the next read is the one paused."""
    p.proc.hold(rid, [0])
    pull(d, p, rid, [0], [0])
    assert ends(d, rid, 20)[:2] == (1, set())


def pull_while_p_pauses(d: PullWorker, p: Any, rid: str, stop_s: float,
                        timeout: float) -> tuple[int, set[int], float]:
    """P holds ``rid`` (blocks 7, 2, 9, 30); D pulls them into 5, 6, 8, 31 and P stops for
    ``stop_s`` as D's read starts: what :func:`ends` says."""
    p.proc.hold(rid, [7, 2, 9, 30])
    assert wait_for(lambda: p.proc.held()[0] == 1, 5)
    paused = pause_on_read(d, p, stop_s)
    pull(d, p, rid, [7, 2, 9, 30], [5, 6, 8, 31])
    out = ends(d, rid, timeout)
    assert paused.is_set()
    return out


def failures(d: PullWorker) -> dict[str, float]:
    return {k: v for k, v in d.recorder.totals().items() if k.startswith("p2p_failures")}


def test_p_paused_before_the_handshake(p: Any, fault_report: Any) -> None:
    d = d_worker(load_timeout_s=20.0)
    try:
        p.proc.hold("h1", [3, 4])
        assert wait_for(lambda: p.proc.held()[0] == 1, 5)
        # P stays stopped until D's GetMeta has timed out at least once (a fixed pause
        # raced D's thread on a loaded machine: D's first call could start after it)
        p.proc.pause(15.0)
        pull(d, p, "h1", [3, 4], [1, 2])
        timed_out = wait_for(lambda: d.recorder.total(
            "p2p_read_retries", reason="peer_timeout") >= 1, 12)
        p.proc.resume()
        assert timed_out, "D's GetMeta to a stopped P never timed out"
        seen, failed, took = ends(d, "h1", 30)
        assert fault_report.check("deadline", (seen, failed) == (1, set()),
                                  f"reported {seen}x, failed blocks {failed}")
        assert same_bytes(d, [1, 2], [3, 4])
        retries = d.recorder.total("p2p_read_retries", reason="peer_timeout")
        assert retries >= 1 and not failures(d)
        assert fault_report.check("zero", wait_for(lambda: p.proc.held()[0] == 0, 10),
                                  "P still held the request")
        assert fault_report.check("survivor", True)
        fault_report(fault="P paused (SIGSTOP) before D's GetMeta (a P without CPU time)",
                     happened=f"GetMeta timed out; D retried {retries:.0f}x within its "
                              f"deadline and loaded P's bytes ({took:.1f}s)",
                     deadline=f"yes ({took:.1f}s < 20s)", client="the request completes")
    finally:
        d.shutdown()


def test_p_paused_mid_read_is_retried(p: Any, fault_report: Any) -> None:
    bound = stall_bound()
    d = d_worker(load_timeout_s=bound + 20.0)
    try:
        warm(d, p, "w")
        stop_s = bound + 2.0
        seen, failed, took = pull_while_p_pauses(d, p, "x", stop_s, bound + 30)
        assert fault_report.check("deadline", (seen, failed) == (1, set()),
                                  f"reported {seen}x, failed blocks {failed}")
        assert same_bytes(d, [5, 6, 8, 31], [7, 2, 9, 30])
        retries = {k: v for k, v in d.recorder.totals().items()
                   if k.startswith("p2p_read_retries")}
        assert retries.get("p2p_read_retries|reason=transfer", 0) >= 1, retries
        assert not failures(d), failures(d)
        assert d.recorder.total("p2p_requests_loaded") == 2
        assert took >= bound  # the read really stalled until Mooncake dropped it
        held_zero = wait_for(lambda: p.proc.held()[0] == 0, 10)
        assert fault_report.check("zero", held_zero, "P still held the request after Done")
        assert p.proc.held()[1] == 0  # freed by D's Done, not by its lease
        # D and P serve on
        p.proc.hold("z", [11])
        pull(d, p, "z", [11], [12])
        assert fault_report.check("survivor", ends(d, "z", 20)[:2] == (1, set()),
                                  "the next pull")
        assert same_bytes(d, [12], [11])
        fault_report(fault=f"P paused (SIGSTOP, {stop_s:.0f}s) while D reads, after granting "
                           "the claim",
                     happened=f"Mooncake dropped the read after {bound:.0f}s without progress; "
                              f"D retried ({sum(retries.values()):.0f}x) on a fresh session "
                              f"once P ran again and loaded P's bytes ({took:.1f}s); D's Done "
                              "freed P's blocks",
                     deadline=f"yes ({took:.1f}s)", client="the request completes")
    finally:
        d.shutdown()


def test_p_paused_past_the_deadline_fails_once(p: Any, fault_report: Any) -> None:
    bound = stall_bound()
    deadline_s = bound + 3.0
    d = d_worker(load_timeout_s=deadline_s)
    try:
        p.proc.hold("w2", [1])
        pull(d, p, "w2", [1], [1])
        assert ends(d, "w2", 20)[:2] == (1, set())
        p.proc.hold("y", [4, 5])
        assert wait_for(lambda: p.proc.held()[0] == 1, 5)
        _, expired0 = p.proc.held()
        stop_s = deadline_s + 4.0
        pause_on_read(d, p, stop_s)
        pull(d, p, "y", [4, 5], [2, 3])
        seen, failed, took = ends(d, "y", stop_s + 10)
        assert (seen, failed) == (1, {2, 3})
        # the last retry that still fits fails, or the deadline ends the load: either way
        # once, not before the read stalled, and no later than the deadline
        assert fault_report.check("deadline", bound <= took < deadline_s + 1.5,
                                  f"failed after {took:.1f}s")
        assert sum(failures(d).values()) == 1, failures(d)
        assert d.recorder.total("p2p_read_retries", reason="transfer") == 1
        # once P runs again, D's Done(success=False) or P's lease frees the blocks
        freed = wait_for(lambda: p.proc.held()[0] == 0, stop_s + LEASE_S + 5)
        assert fault_report.check("zero", freed, "P still held the request")
        p.proc.hold("z2", [13])
        pull(d, p, "z2", [13], [14])
        assert fault_report.check("survivor", ends(d, "z2", 20)[:2] == (1, set()),
                                  "the next pull")
        how = "its lease" if p.proc.held()[1] > expired0 else "D's Done"
        fault_report(fault=f"P paused (SIGSTOP, {stop_s:.0f}s) while D reads, past D's "
                           f"{deadline_s:.0f}s deadline",
                     happened=f"D retried while its deadline left time, then failed the "
                              f"request once ({took:.1f}s, cause "
                              f"{next(iter(failures(d))).split('=')[-1]}); {how} freed P's "
                              "blocks once P ran again",
                     deadline=f"yes ({took:.1f}s)",
                     client="its blocks reported failed once (vLLM fails or recomputes)")
    finally:
        d.shutdown()


def test_p_paused_while_d_reads_its_memory_costs_nothing(p: Any, fault_report: Any,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(LOCAL_READS_ENV, "1")
    bound = stall_bound()
    d = d_worker(load_timeout_s=bound + 20.0)
    try:
        warm(d, p, "lw")
        assert d.te is not None
        assert [d.te.is_local_peer(m.session) for m in d._remote_meta.values()] == [True]
        before = d.te.stats.local_reads
        stop_s = bound + 2.0
        seen, failed, took = pull_while_p_pauses(d, p, "lx", stop_s, bound + 30)
        assert fault_report.check("deadline", (seen, failed) == (1, set()),
                                  f"reported {seen}x, failed blocks {failed}")
        assert same_bytes(d, [5, 6, 8, 31], [7, 2, 9, 30])
        assert d.te.stats.local_reads > before
        assert not d.recorder.total("p2p_read_retries", reason="transfer")
        assert not failures(d), failures(d)
        assert took < bound  # not held up by P's stop
        # D's Done reaches P once it runs again, and frees its blocks
        held_zero = wait_for(lambda: p.proc.held()[0] == 0, stop_s + 10)
        assert fault_report.check("zero", held_zero, "P still held the request after Done")
        assert fault_report.check("survivor", True)
        fault_report(fault=f"P paused (SIGSTOP, {stop_s:.0f}s) while D reads, after granting "
                           "the claim, D reading P's memory (same host)",
                     happened=f"D copied P's blocks from P's memory while P was stopped "
                              f"({took:.2f}s, no retry); D's Done freed P's blocks once P ran",
                     deadline=f"yes ({took:.2f}s)", client="the request completes")
    finally:
        d.shutdown()


def test_p_paused_mid_inline_read_is_pulled_again_off_vllms_thread(p: Any,
                                                                   fault_report: Any) -> None:
    """``inline_reads``: a window read goes out from vLLM's thread (``start_load_kv``) and
    P stops as it does. vLLM's ``get_finished`` never waits for it: the read drops after
    the progress bound, a pull thread claims the request once P runs again and loads it."""
    bound = stall_bound()
    d = d_worker(load_timeout_s=bound + 20.0, inline_reads=True)
    reader = d.reader
    assert reader is not None and reader.inline is not None
    try:
        warm(d, p, "iw")  # D's first request: P's metadata is fetched on a pull thread
        p.proc.hold("iw2", [1])  # a window read, inline, while P runs
        pull(d, p, "iw2", [1], [1], window=True)
        assert ends(d, "iw2", 20)[:2] == (1, set())
        assert d.recorder.total("p2p_inline_reads") == 1
        p.proc.hold("ix", [7, 2, 9, 30])
        assert wait_for(lambda: p.proc.held()[0] == 1, 5)
        stop_s = bound + 2.0
        inline, original = reader.inline, reader.inline.start

        def start(meta: Any) -> bool:  # P stops as the read goes out
            p.proc.pause(stop_s)
            return original(meta)

        inline.start = start  # type: ignore[method-assign]
        called = time.monotonic()
        pull(d, p, "ix", [7, 2, 9, 30], [5, 6, 8, 31], window=True)
        start_took = time.monotonic() - called
        inline.start = original  # type: ignore[method-assign]
        assert d.recorder.total("p2p_inline_reads") == 2  # it did go out inline
        slowest = 0.0
        finished = d.get_finished

        def timed(**kwargs: Any) -> Any:
            nonlocal slowest
            t0 = time.monotonic()
            try:
                return finished(**kwargs)
            finally:
                slowest = max(slowest, time.monotonic() - t0)

        d.get_finished = timed  # type: ignore[method-assign]
        seen, failed, took = ends(d, "ix", bound + 30)
        assert fault_report.check("deadline", (seen, failed) == (1, set()),
                                  f"reported {seen}x, failed blocks {failed}")
        assert same_bytes(d, [5, 6, 8, 31], [7, 2, 9, 30])
        # vLLM's thread was never held by the stalled read (P stopped for bound + 2 s)
        assert start_took < bound and slowest < bound, (start_took, slowest)
        assert took >= bound  # the read really stalled until Mooncake dropped it
        assert d.recorder.total("p2p_read_retries", reason="transfer") >= 1
        assert not failures(d), failures(d)
        assert d.recorder.total("p2p_requests_loaded") == 3
        held_zero = wait_for(lambda: p.proc.held()[0] == 0, 10)
        assert fault_report.check("zero", held_zero, "P still held the request after Done")
        # D and P serve on, inline again
        p.proc.hold("iz", [11])
        pull(d, p, "iz", [11], [12], window=True)
        assert fault_report.check("survivor", ends(d, "iz", 20)[:2] == (1, set()),
                                  "the next pull")
        assert same_bytes(d, [12], [11])
        fault_report(fault=f"P paused (SIGSTOP, {stop_s:.0f}s) as D's inline read "
                           "(inline_reads, from vLLM's thread) goes out",
                     happened=f"Mooncake dropped the read after {bound:.0f}s without progress; "
                              f"vLLM's thread never waited for it (slowest get_finished "
                              f"{slowest * 1000:.0f} ms); a pull thread claimed and loaded "
                              f"P's bytes once P ran again ({took:.1f}s); D's Done freed "
                              "P's blocks",
                     deadline=f"yes ({took:.1f}s)", client="the request completes")
    finally:
        d.shutdown()
