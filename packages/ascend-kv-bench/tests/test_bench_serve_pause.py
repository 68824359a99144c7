# SPDX-License-Identifier: Apache-2.0
"""bench serve pauses the P/D engines it is not measuring (SIGSTOP; a call continues them)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ascend_kv_testing.procs import group_states
from vllm_ascend.distributed.kv_transfer.bench.benchutil import Steps
from vllm_ascend.distributed.kv_transfer.bench.serve.child import EngineChild
from vllm_ascend.distributed.kv_transfer.bench.serve.scenarios import Run

#: a stand-in engine: a process (and a worker child of it) that counts up while it runs
BUSY = ("import subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import time\\nwhile True: time.sleep(0.01)'])\n"
        "while True: time.sleep(0.01)\n")


def state(pid: int) -> str:
    """The process state letter of ``pid`` (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def fake_engine() -> EngineChild:
    """An EngineChild around a stand-in process (no vLLM): the same pause, resume, kill."""
    eng = object.__new__(EngineChild)
    eng.proc = subprocess.Popen([sys.executable, "-c", BUSY], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, start_new_session=True)
    eng.paused = False
    import selectors

    eng._sel = selectors.DefaultSelector()
    time.sleep(0.3)  # its worker child is up
    return eng


def wait_states(pgid: int, want: set[str], timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        states = group_states(pgid)
        if (states and set(states) <= want) or time.monotonic() > deadline:
            return states
        time.sleep(0.02)


def test_pause_stops_the_engine_and_its_workers_and_resume_continues_them() -> None:
    eng = fake_engine()
    try:
        assert len(group_states(eng.proc.pid)) == 2
        eng.pause()
        assert eng.paused and wait_states(eng.proc.pid, {"T"}) == ["T", "T"]
        eng.pause()  # twice is once
        eng.resume()
        assert not eng.paused and "T" not in wait_states(eng.proc.pid, {"S", "R"})
    finally:
        eng.kill()


def test_a_paused_engine_is_killed_and_a_dead_one_paused_quietly() -> None:
    eng = fake_engine()
    eng.pause()
    eng.kill()  # SIGKILL ends a stopped process
    assert eng.proc.returncode is not None
    eng.paused = False
    eng.pause()  # gone: nothing to signal, no error


def test_kill_ends_the_engines_workers_too() -> None:
    eng = fake_engine()
    eng.kill()
    deadline = time.monotonic() + 5.0
    while set(group_states(eng.proc.pid)) - {"Z"} and time.monotonic() < deadline:
        time.sleep(0.02)
    assert set(group_states(eng.proc.pid)) <= {"Z"}  # no worker left orphaned


def test_kill_after_the_engine_exited_ends_its_workers() -> None:
    eng = fake_engine()
    assert len(group_states(eng.proc.pid)) == 2
    eng.proc.kill()  # the engine alone dies (a crash): its worker runs on
    eng.proc.wait(5)
    assert set(group_states(eng.proc.pid)) - {"Z"}
    eng.kill()
    deadline = time.monotonic() + 5.0
    while set(group_states(eng.proc.pid)) - {"Z"} and time.monotonic() < deadline:
        time.sleep(0.02)
    assert set(group_states(eng.proc.pid)) <= {"Z"}


class _Eng:
    def __init__(self) -> None:
        self.paused = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False


def test_kept_pauses_the_other_pairs_and_the_baseline_for_p_d(tmp_path: Path) -> None:
    run: Any = object.__new__(Run)
    run.live, run.steps = {}, Steps("serve")
    run.base_engine = _Eng()
    ours = run.kept("ours", lambda: [_Eng(), _Eng()], pause_others=True)
    assert run.base_engine.paused and not any(e.paused for e in ours)
    peer = run.kept("peer", lambda: [_Eng(), _Eng()], pause_others=True)
    assert all(e.paused for e in ours) and not any(e.paused for e in peer)
    again = run.kept("ours", list, pause_others=True)  # kept: the same engines, going
    assert again is ours and not any(e.paused for e in ours) and all(e.paused for e in peer)
    run.pause_live()  # before the reference on the engine without a connector
    assert all(e.paused for e in (*ours, *peer))
    # other families keep their neighbours running
    pool = run.kept("pool", lambda: [_Eng()])
    assert not pool[0].paused and all(e.paused for e in peer)


def test_the_engine_child_times_each_request_from_added_to_first_scheduled() -> None:
    """D's wait for the KV, as vLLM's scheduler sees it: added, then scheduled only once
    the KV is in (steps in between schedule nothing new for it)."""
    from types import SimpleNamespace

    from vllm_ascend.distributed.kv_transfer.bench.serve import child as serve_child

    class Scheduler:
        def __init__(self) -> None:
            self.waiting: list[str] = []
            self.ready: set[str] = set()

        def add_request(self, request: Any) -> None:
            self.waiting.append(request.request_id)

        def schedule(self, throttle_prefills: bool = False) -> Any:
            new = [r for r in self.waiting if r in self.ready]
            self.waiting = [r for r in self.waiting if r not in self.ready]
            return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r) for r in new])

    sched = Scheduler()
    engine = SimpleNamespace(engine_core=SimpleNamespace(engine_core=SimpleNamespace(
        scheduler=sched)))
    times = serve_child._track_scheduling(engine)
    assert times is not None
    sched.add_request(SimpleNamespace(request_id="d"))
    sched.add_request(SimpleNamespace(request_id="never"))
    sched.schedule()  # the KV is not in yet: nothing scheduled
    time.sleep(0.05)
    sched.ready.add("d")
    sched.schedule(throttle_prefills=True)
    sched.schedule()
    waits = serve_child._waited(times)
    assert waits is not None and waits[1] is None
    assert waits[0] is not None and 0.05 <= waits[0] < 1.0
    assert serve_child._track_scheduling(SimpleNamespace()) is None
    assert serve_child._waited(None) is None


def test_an_engine_that_outlives_its_kill_does_not_end_the_run(
        monkeypatch: Any, caplog: Any) -> None:
    """A killed engine that has not exited after ``KILL_WAIT_S`` is reported and left: the
    rest of the run (its results, the other engines to stop) goes on. Here the process is not
    the leader of a group, so the group kill misses it and it stays."""
    from vllm_ascend.distributed.kv_transfer.bench.serve import child as serve_child

    monkeypatch.setattr(serve_child, "KILL_WAIT_S", 0.2)
    eng = object.__new__(EngineChild)
    eng.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    eng.paused = False
    eng.log = Path("stand-in.log")
    import selectors

    eng._sel = selectors.DefaultSelector()
    try:
        with caplog.at_level("WARNING", logger=serve_child.__name__):
            eng.kill()  # returns, no TimeoutExpired
        assert eng.proc.poll() is None
        assert "had not exited after" in caplog.text and "stand-in.log" in caplog.text
        assert eng.proc.stdin is not None and eng.proc.stdin.closed
    finally:
        eng.proc.kill()
        eng.proc.wait(10)


class _Closing(_Eng):
    """A kept engine whose close waits until every other one is closing too (a barrier):
    closed one after the other, the first would wait out the barrier's timeout."""

    def __init__(self, barrier: threading.Barrier, closed: list[_Closing]) -> None:
        super().__init__()
        self.barrier, self.closed = barrier, closed

    def close(self) -> None:
        self.barrier.wait()
        self.closed.append(self)


def test_close_live_stops_every_kept_engine_side_by_side() -> None:
    """The family's rounds are done: its kept engines (8 for P/D) stop together, each
    waiting for vLLM's shutdown, instead of one after the other."""
    run: Any = object.__new__(Run)
    run.live, run.steps, run.base_engine = {}, Steps("serve"), None
    closed: list[_Closing] = []
    barrier = threading.Barrier(4, timeout=10)
    pairs = [run.kept(key, lambda: [_Closing(barrier, closed), _Closing(barrier, closed)])
             for key in ("ours", "peer")]
    run.close_live()
    assert run.live == {} and sorted(map(id, closed)) == sorted(id(e) for p in pairs for e in p)
    assert not barrier.broken


class _Starting(_Closing):
    """An engine whose start waits until its pair's other engine is starting too."""

    def __init__(self, barrier: threading.Barrier, closed: list[_Closing], name: str,
                 fail: bool) -> None:
        super().__init__(threading.Barrier(1), closed)
        self.name = name
        barrier.wait()
        if fail:
            raise RuntimeError(f"{name} did not start")


def _pd_run(barrier: threading.Barrier, closed: list[_Closing], started: list[str],
            fail: str = "") -> Any:
    run: Any = object.__new__(Run)
    run.live, run.steps, run.base_engine, run.binding = {}, Steps("serve"), None, "pinned"
    run.cfg = type("Cfg", (), {"pd_threads_bind": None})()

    def engine(name: str, kv: Any, **_kw: Any) -> _Starting:
        started.append(name)
        return _Starting(barrier, closed, name, fail=bool(fail) and name.endswith(fail))

    run.engine = engine
    return run


def test_run_pd_starts_p_and_d_side_by_side() -> None:
    """A pair's first round starts P and D together (each on its own core when pinned):
    one after the other, P's start would wait out the barrier's timeout."""
    from vllm_ascend.distributed.kv_transfer.bench.serve import pd as serve_pd

    barrier, closed, started = threading.Barrier(2, timeout=10), [], []
    run = _pd_run(barrier, closed, started)
    seen: list[tuple[str, str]] = []

    def flow(_run: Any, p: Any, d: Any, *_a: Any, **_kw: Any) -> dict[str, Any]:
        seen.append((p.name, d.name))
        return {"prompts": []}

    import pytest

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serve_pd, "pd_flow", flow)
        assert serve_pd.run_pd(run, "pd/ours", {}, {}, None) == {"prompts": []}
    assert seen == [("pd/ours-pinned-prefill", "pd/ours-pinned-decode")]
    assert sorted(started) == ["pd/ours-pinned-decode", "pd/ours-pinned-prefill"]
    assert not barrier.broken and list(run.live) == ["pd/ours[pinned]"]


def test_run_pd_closes_p_when_d_fails_to_start() -> None:
    """D fails to start while P comes up: P is closed, D's error raised, nothing kept."""
    import pytest

    from vllm_ascend.distributed.kv_transfer.bench.serve import pd as serve_pd

    barrier, closed, started = threading.Barrier(2, timeout=10), [], []
    run = _pd_run(barrier, closed, started, fail="decode")
    with pytest.raises(RuntimeError, match="decode did not start"):
        serve_pd.run_pd(run, "pd/ours", {}, {}, None)
    assert [e.name for e in closed] == ["pd/ours-pinned-prefill"] and run.live == {}
