# SPDX-License-Identifier: Apache-2.0
"""The CPU offload metadata server when a process holding host blocks is killed.

A real process (``victim``) registers as the instance's rank and, as its scheduler, saves a
chain so that it is cached, pins a prefix of it and starts a save it never confirms
(blocks ``PENDING``); then it is SIGKILLed. Nothing tells the server: no ``RankGone``, no
unpin, no ``SaveDone``. The pin and the save job carry leases owned by the dead process;
they must lapse within their TTL, the pinned blocks become evictable again, the pending
blocks go back to the free heap, each exactly once, and a new process must pin, save and
look up on the same server as before.

(The same with threads and a fake clock, per message, is
``packages/ascend-cpu-offload/tests/test_offload_metadata_server.py``.)
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager import (
    MetadataClient,
    MetadataServer,
)

PIN_TTL_S = 2.0
SAVE_TTL_S = 3.0
#: a lapsed lease is released on the server's next request: poll interval, a busy machine
MARGIN_S = 1.5
CALL_TIMEOUT_S = 2.0
LAYERS, LAYER_BYTES = 2, 256
BUDGET = 16 << 10
CACHED, PINNED, PENDING = 6, 4, 3


def chain(name: str, n: int) -> list[bytes]:
    """``n`` chained 32-byte block hashes (each covers its prefix)."""
    out, prev = [], hashlib.sha256(name.encode()).digest()
    for i in range(n):
        prev = hashlib.sha256(prev + bytes([i])).digest()
        out.append(prev)
    return out


#: Run with ``python -c``: argv ``role endpoint``; one JSON line on stdout per step.
CHILD = inspect.getsource(chain) + f'''
import hashlib, json, os, sys, time
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager import (
    MetadataClient)
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager.protocol import (
    RegisterRank, SaveRequest)

role, endpoint = sys.argv[1:3]
name = f"{{role}}-{{os.getpid()}}"
reg = RegisterRank(rank=0, world_size=1, layer_names=[f"model.layers.{{i}}.attn"
                   for i in range({LAYERS})], layer_block_bytes=[{LAYER_BYTES}] * {LAYERS})
client = MetadataClient(endpoint, timeout_s={CALL_TIMEOUT_S})

def say(**kw):
    print(json.dumps(kw), flush=True)

if role == "victim":
    info = client.register(reg, timeout_s=30)
    a = chain("a", {CACHED})
    (job,) = client.plan_step([SaveRequest(key="a", hashes=a)], [], owner=name).saves
    client.save_done(0, [job.job_id])
    cached = client.lookup(a)
    t_pin = time.monotonic()
    pinned = client.pin(f"{{name}}-load", a[:{PINNED}], owner=name)
    t_save = time.monotonic()
    (pending,) = client.plan_step([SaveRequest(key="b", hashes=chain("b", {PENDING}))], [],
                                  owner=name).saves
    say(state="holding", owner=name, num_blocks=info.num_blocks, cached=cached,
        cached_ids=job.block_ids, pinned=pinned, pending=pending.block_ids, t_pin=t_pin,
        t_save=t_save)
    time.sleep(600)  # never unpins, never confirms: SIGKILLed here
else:
    say(state="ready")
    total = json.loads(sys.stdin.readline())["total"]
    slowest = 0.0

    def timed(fn, *args, **kw):
        global slowest
        t = time.monotonic()
        out = fn(*args, **kw)
        slowest = max(slowest, time.monotonic() - t)
        return out

    # the rank comes back to the same server (an identical layout is accepted again)
    info = timed(client.register, reg, timeout_s=10)
    a, b = chain("a", {CACHED}), chain("b", {PENDING})
    c = chain("c", total - {CACHED} - {PENDING})
    hit_a = timed(client.lookup, a)
    pinned = timed(client.pin, f"{{name}}-load", a, owner=name)
    plan = timed(client.plan_step, [SaveRequest(key="b", hashes=b),
                                    SaveRequest(key="c", hashes=c)], [], owner=name)
    timed(client.save_done, 0, [s.job_id for s in plan.saves])
    full = timed(client.stats)
    timed(client.plan_step, [], [f"{{name}}-load"], owner=name)
    after = timed(client.stats)
    say(state="done", ready=info.ready, num_blocks=info.num_blocks, hit_a=hit_a, pinned=pinned,
        saves=[dict(key=s.key, positions=s.positions, block_ids=s.block_ids)
               for s in plan.saves],
        evictions=plan.evictions, hit_b=timed(client.lookup, b), hit_c=timed(client.lookup, c),
        full_free=full.free_blocks, full_pinned=full.pinned_blocks,
        pinned_after=after.pinned_blocks, slowest=slowest)
    client.close()
'''


def start_child(role: str, endpoint: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as err:
        return subprocess.Popen([sys.executable, "-c", CHILD, role, endpoint],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                                start_new_session=True)


def read_json(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> dict[str, Any]:
    """The child's next JSON line; fails with its stderr if it exits or stays silent."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            pytest.fail(f"no line from {proc.args[3]} after {timeout_s}s:\n"
                        f"{log.read_text()[-3000:]}")
    line = proc.stdout.readline()
    if not line:
        proc.wait(5)
        pytest.fail(f"{proc.args[3]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
    return json.loads(line)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[MetadataServer]:
    seg_dir = tmp_path / "segments"
    seg_dir.mkdir()
    srv = MetadataServer(f"ipc://{tmp_path}/meta.ipc", world_size=1, budget_bytes=BUDGET,
                         save_ttl=SAVE_TTL_S, pin_ttl=PIN_TTL_S, segment_dir=str(seg_dir)).start()
    yield srv
    srv.stop()
    assert not list(seg_dir.iterdir()), "host segments left behind"


def test_offload_client_killed_holding_a_pin_and_a_pending_save(
        server: MetadataServer, tmp_path: Path, fault_report: Any) -> None:
    logs = {role: tmp_path / f"{role}.log" for role in ("victim", "newcomer")}
    # the newcomer imports while the victim works; it waits for its turn on stdin
    procs = {role: start_child(role, server.endpoint, log) for role, log in logs.items()}
    victim, newcomer = procs["victim"], procs["newcomer"]
    sched = MetadataClient(server.endpoint, timeout_s=CALL_TIMEOUT_S)
    slowest = 0.0

    def stats() -> Any:
        nonlocal slowest
        t = time.monotonic()
        s = sched.stats()  # ServerUnavailable (the test fails) past the call timeout
        slowest = max(slowest, time.monotonic() - t)
        return s

    try:
        held = read_json(victim, logs["victim"], 60)
        total = held["num_blocks"]
        assert held["state"] == "holding" and held["cached"] == CACHED and total >= 12
        assert held["pinned"] == held["cached_ids"][:PINNED]
        assert len(held["pending"]) == PENDING

        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(10)
        t_kill = time.monotonic()
        s = stats()
        # nothing told the server: the dead owner's pin and save job are still held
        assert (s.cached_blocks, s.pinned_blocks, s.pending_blocks) == (CACHED, PINNED, PENDING)
        assert s.free_blocks == total - CACHED - PENDING

        pin_gone = save_gone = None
        deadline = held["t_save"] + SAVE_TTL_S + MARGIN_S
        while (pin_gone is None or save_gone is None) and time.monotonic() < deadline:
            s = stats()
            now = time.monotonic()
            assert s.free_blocks + s.cached_blocks + s.pending_blocks == total, s
            if pin_gone is None and s.pinned_blocks == 0:
                pin_gone = now
            if save_gone is None and s.pending_blocks == 0:
                save_gone = now
            time.sleep(0.05)
        assert pin_gone is not None, f"the dead client's pin was still held: {s}"
        assert save_gone is not None, f"the dead client's save was still pending: {s}"
        # not before the lease (nothing else releases a SIGKILLed owner), not much after
        assert fault_report.check(
            "deadline", held["t_pin"] + PIN_TTL_S <= pin_gone <= held["t_pin"] + PIN_TTL_S
            + MARGIN_S, f"the pin lapsed {pin_gone - held['t_pin']:.1f}s after it was taken")
        assert fault_report.check(
            "deadline", held["t_save"] + SAVE_TTL_S <= save_gone <= held["t_save"] + SAVE_TTL_S
            + MARGIN_S, f"the save lapsed {save_gone - held['t_save']:.1f}s after it began")

        # each lease lapsed once: blocks back where they belong, counted once
        s = stats()
        assert (s.cached_blocks, s.pinned_blocks, s.pending_blocks) == (CACHED, 0, 0)
        assert s.free_blocks == total - CACHED
        assert (s.expired_pins, s.expired_jobs, s.aborted_blocks) == (1, 1, PENDING)
        assert (s.committed_blocks, s.evictions) == (CACHED, 0)
        with server._lock:  # the server's own lock: no request is handled meanwhile
            m = server.manager
            assert m is not None
            m.check()
            assert fault_report.check("zero", m.pin_keys() == [] and m.pending_jobs() == [],
                                      f"pins {m.pin_keys()}, jobs {m.pending_jobs()}")
            assert m.num_evictable == CACHED
        # what the dead client saved before it died stays a valid hit; its unfinished save never
        assert sched.lookup(chain("a", CACHED)) == CACHED
        assert sched.lookup(chain("b", PENDING)) == 0
        time.sleep(0.2)
        again = stats()
        assert (again.expired_pins, again.expired_jobs, again.aborted_blocks,
                again.free_blocks) == (1, 1, PENDING, total - CACHED), "released twice"

        # a new process on the same server: pins the dead client's blocks, saves into every
        # free block (the aborted ones included) without an eviction, looks up
        assert newcomer.stdin is not None
        newcomer.stdin.write(json.dumps({"total": total}).encode() + b"\n")
        newcomer.stdin.flush()
        assert read_json(newcomer, logs["newcomer"], 60)["state"] == "ready"
        got = read_json(newcomer, logs["newcomer"], 30)
        assert newcomer.wait(10) == 0, logs["newcomer"].read_text()[-3000:]
        assert fault_report.check("survivor", got["ready"] and got["num_blocks"] == total,
                                  f"the new process: {got}")
        assert fault_report.check("survivor", got["hit_a"] == CACHED
                                  and got["pinned"] == held["cached_ids"],
                                  "the new process's hits and pins")
        saves = {sv["key"]: sv for sv in got["saves"]}
        n_c = total - CACHED - PENDING
        assert saves["b"]["positions"] == list(range(PENDING)), "the aborted hashes were freed"
        assert saves["c"]["positions"] == list(range(n_c))
        assert sorted(saves["b"]["block_ids"] + saves["c"]["block_ids"]) == sorted(
            set(range(total)) - set(held["cached_ids"]))
        assert set(held["pending"]) <= set(saves["b"]["block_ids"] + saves["c"]["block_ids"])
        assert got["evictions"] == 0
        assert (got["hit_b"], got["hit_c"]) == (PENDING, n_c)
        assert (got["full_free"], got["full_pinned"], got["pinned_after"]) == (0, CACHED, 0)
        assert fault_report.check("deadline", got["slowest"] < CALL_TIMEOUT_S,
                                  f"the new process's slowest call took {got['slowest']:.2f}s")

        # and back to zero
        assert sched.reset() == total
        s = stats()
        assert fault_report.check("zero", (s.free_blocks, s.cached_blocks, s.pinned_blocks,
                                           s.pending_blocks) == (total, 0, 0, 0), f"{s}")
        with server._lock:
            server.manager.check()  # type: ignore[union-attr]
        assert server.rpc_stats["handler_errors"] == 0
        assert server.rpc_stats["bad_messages"] == 0
    finally:
        sched.close()
        for proc in procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()

    fault_report(
        fault="offload: the client holding host blocks (the instance's rank and scheduler, a "
              f"process of its own) killed (SIGKILL) with a pin of {PINNED} cached blocks and "
              f"an unconfirmed save of {PENDING}",
        happened=f"nothing told the metadata server; the pin lapsed {pin_gone - t_kill:.1f}s "
                 f"after the kill (lease {PIN_TTL_S:.0f}s; a lapsed lease is released at the "
                 "server's next request, here a poll every 50 ms) and its blocks were evictable "
                 f"again; the save lapsed {save_gone - t_kill:.1f}s after (lease "
                 f"{SAVE_TTL_S:.0f}s) and its blocks went back to the free heap; each released "
                 "once (`check()`); the blocks it had saved stayed hits; a new process pinned "
                 f"them and saved into all {total - CACHED} free blocks without an eviction",
        deadline=f"yes (every call answered, slowest {max(slowest, got['slowest']):.2f}s; "
                 f"call timeout {CALL_TIMEOUT_S:.0f}s)",
        client="the new process: hits, pins and saves as before; the killed one: none (dead)")
