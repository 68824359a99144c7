# SPDX-License-Identifier: Apache-2.0
"""A step's saves, and a step's loads, cost the store one round trip, not one a request.

The worker queues one item of saves a step and the send thread merges what is
queued into one ``exists`` and one ``put``; the synchronous loads of a step
go out as one ``get``. Every request's blocks are still reported (finished,
failed, KV events) as if saved or loaded alone.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
from pool_test_harness import BLOCK, Blocks, FakeRequest, PoolHarness, scheduler_output

from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend import LocalBackend
from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.store_transfer import (
    LoadTask,
    SaveTask,
    TransferThread,
    merge_loads,
    merge_saves,
)


class CountingBackend(LocalBackend):
    """The ``local`` backend, recording the keys of every call."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.calls: list[tuple[str, int]] = []

    def exists(self, keys: list[str]) -> list[int]:
        self.calls.append(("exists", len(keys)))
        return super().exists(keys)

    def put(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        self.calls.append(("put", len(keys)))
        return super().put(keys, addrs, sizes)

    def get(self, keys: list[str], addrs: list[list[int]], sizes: list[list[int]]) -> list[int]:
        self.calls.append(("get", len(keys)))
        return super().get(keys, addrs, sizes)


def req(rid: str, n: int, seed: int) -> FakeRequest:
    return FakeRequest(rid, [(seed * 7919 + i * 31) % 997 + 3 for i in range(n)])


def test_saves_and_loads_of_one_step_are_one_store_call_each() -> None:
    backend = CountingBackend(capacity=64 << 20)
    a, b = PoolHarness(backend), PoolHarness(backend)
    n = 2 * BLOCK + 1
    r1, r2 = req("r1", n, 1), req("r2", n, 2)
    blocks = {}
    for r in (r1, r2):
        assert a.scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
        blocks[r.request_id] = a.alloc(3)
        a.scheduler.update_state_after_alloc(r, Blocks(blocks[r.request_id]), 0)
    gate = threading.Event()
    original = a.worker._run_save
    a.worker._send._run = lambda item: (gate.wait(5), original(item))
    out = scheduler_output(new=[(r.request_id, blocks[r.request_id], 0, n) for r in (r1, r2)])
    meta, _s, _r, _e = a.step(out, forward=[(r, blocks[r.request_id], 0, n) for r in (r1, r2)])
    assert len(meta.saves) == 2
    # a later step's save queued behind it goes along too
    r3 = req("r3", BLOCK, 3)
    a.scheduler.get_num_new_matched_tokens(r3, 0)
    blocks["r3"] = a.alloc(1)
    a.scheduler.update_state_after_alloc(r3, Blocks(blocks["r3"]), 0)
    backend.calls.clear()  # (the lookups); the send thread still waits at the gate
    a.step(scheduler_output(new=[("r3", blocks["r3"], 0, BLOCK)]),
           forward=[(r3, blocks["r3"], 0, BLOCK)])
    gate.set()
    assert a.worker.wait_idle()
    assert backend.calls == [("exists", 5), ("put", 5)]
    assert a.worker.recorder.total("pool_saved_blocks") == 5
    for r in (r1, r2, r3):  # each request's blocks are released once its saves are done
        assert a.scheduler.request_finished(r, blocks[r.request_id])[0] is True
    _m, sending, _r, _e = a.step(scheduler_output(finished={"r1", "r2", "r3"}))
    assert sending == {"r1", "r2", "r3"}

    backend.calls.clear()
    b_blocks = {}
    for r in (r1, r2):
        ext, is_async = b.scheduler.get_num_new_matched_tokens(r, 0)
        assert (ext, is_async) == (2 * BLOCK, False)
        b_blocks[r.request_id] = b.alloc(3)
        b.scheduler.update_state_after_alloc(r, Blocks(b_blocks[r.request_id]), ext)
    lookups = len(backend.calls)
    out = scheduler_output(new=[(r.request_id, b_blocks[r.request_id], 2 * BLOCK, 1)
                                for r in (r1, r2)])
    meta, _s, _r, errors = b.step(out)
    assert len(meta.loads) == 2 and errors == set()
    assert backend.calls[lookups:] == [("get", 4)]
    for r in (r1, r2):
        for i in range(2):
            for layer in range(len(b.layers)):
                torch.testing.assert_close(b.kv[b.layers[layer]][b_blocks[r.request_id][i]],
                                           b.expected(r, i, layer), rtol=0, atol=0)


def test_merged_save_reports_each_task_its_own_keys() -> None:
    reports: dict[str, tuple[list[bool], list[bool]]] = {}
    synced: list[str] = []

    class Event:
        def __init__(self, name: str) -> None:
            self.name = name

        def synchronize(self) -> None:
            synced.append(self.name)

    def task(rid: str, n: int) -> SaveTask:
        t = SaveTask(rid, [f"{rid}-{i}" for i in range(n)], [[i] for i in range(n)],
                     [[1] for _ in range(n)], Event(rid))
        t.on_done = lambda w, p: reports.__setitem__(rid, (w, p))
        return t

    merged = merge_saves([task("a", 2), task("b", 3)])
    assert merged.keys == ["a-0", "a-1", "b-0", "b-1", "b-2"]
    merged.event.synchronize()
    assert synced == ["a", "b"]
    assert merged.on_done is not None
    merged.on_done([True, False, True, True, False], [True, True, True, True, True])
    assert reports == {"a": ([True, False], [True, True]),
                       "b": ([True, True, False], [True, True, True])}
    single = task("c", 1)
    assert merge_saves([single]) is single


def test_merged_load_keeps_each_keys_blocks() -> None:
    a = LoadTask("a", ["k1"], [[1]], [[8]], [[10]])
    b = LoadTask("b", ["k2", "k3"], [[2], [3]], [[8], [8]], [[11], [12]])
    m = merge_loads([a, b])
    assert (m.keys, m.block_ids, m.addrs) == (["k1", "k2", "k3"], [[10], [11], [12]],
                                              [[1], [2], [3]])
    assert merge_loads([a]) is a


def test_drain_stops_at_a_stop_request() -> None:
    ran: list[list[int]] = []
    gate = threading.Event()
    thread: TransferThread

    def run(item: int) -> None:
        gate.wait(5)
        ran.append([item, *thread.drain(10)])

    thread = TransferThread("test-drain", run)
    assert thread.submit(1)
    deadline = time.monotonic() + 5
    while thread.depth and time.monotonic() < deadline:
        time.sleep(0.005)  # the thread took item 1 and waits at the gate
    assert thread.submit(2) and thread.submit(3)
    stopper = threading.Thread(target=thread.stop, kwargs={"timeout": 5})
    stopper.start()
    while thread.depth < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    gate.set()
    stopper.join(6)
    assert ran == [[1, 2, 3]]
    assert not thread._thread.is_alive()
