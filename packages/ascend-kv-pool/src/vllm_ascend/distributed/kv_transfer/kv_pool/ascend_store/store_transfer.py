# SPDX-License-Identifier: Apache-2.0
"""Save and load threads of the pool worker, and the store guard.

A :class:`TransferThread` runs queued tasks in order on a daemon thread; its
queue is bounded, so a store slower than the engine drops saves (counted)
instead of holding blocks forever. A :class:`SaveTask` waits for the device
event recorded after the forward pass, skips the blocks the store already
holds and puts the rest; a :class:`LoadTask` gets blocks and reports the ones
that failed. Tasks queued together (the saves of one step's requests, the
synchronous loads of one step) are merged into one task first
(:func:`merge_saves`, :func:`merge_loads`), so a step costs the store one
``exists`` and one ``put`` (or one ``get``) round trip, not one per request. The :class:`StoreGuard` (core's retry guard) is a circuit
breaker: once the store is unreachable, saves are dropped and lookups miss at
once until the retry interval passed, so a dead store never slows the engine
down.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.retry import RetryGuard

from .backend.base import Backend
from .errors import BackendUnavailableError

logger = logging.getLogger(__name__)


class StoreGuard(RetryGuard):
    """The store's :class:`~vllm_ascend.distributed.kv_transfer.core.retry.RetryGuard`.

    Warns once per outage that lookups miss and saves are dropped.

    Args:
        retry_interval_s: how long to stay tripped after a failure.
        clock: monotonic time source (tests).
    """

    def __init__(self, retry_interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(retry_interval_s, clock)

    @property
    def retry_interval_s(self) -> float:
        """How long a failure keeps the store unused (the config's name for it)."""
        return self.retry_after_s

    def trip(self, exc: BaseException | None = None) -> bool:
        """The store failed: stop using it for ``retry_interval_s``."""
        first = super().trip()
        if first:
            logger.warning("KV pool store unavailable (%s): lookups miss and saves are dropped "
                           "for %.1fs", exc, self.retry_interval_s)
        return first


class PendingSaves:
    """Save jobs in flight per request, and who is waiting for them."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: Counter[str] = Counter()

    def add(self, req_id: str) -> None:
        with self._cond:
            self._pending[req_id] += 1

    def done(self, req_id: str) -> None:
        with self._cond:
            self._pending[req_id] -= 1
            if self._pending[req_id] <= 0:
                del self._pending[req_id]
            self._cond.notify_all()

    def has(self, req_id: str) -> bool:
        with self._cond:
            return self._pending[req_id] > 0 if req_id in self._pending else False

    def total(self) -> int:
        with self._cond:
            return sum(self._pending.values())

    def wait(self, req_ids: set[str], timeout: float) -> bool:
        """Wait until none of ``req_ids`` has a pending save; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(r in self._pending for r in req_ids):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True


@dataclass
class SaveTask:
    """Put ``keys`` (each an object of ``addrs``/``sizes`` ranges) unless already stored."""

    req_id: str
    keys: list[str]
    addrs: list[list[int]]
    sizes: list[list[int]]
    event: Any = None
    #: vLLM blocks of the keys (used when copying through a host staging buffer)
    block_ids: list[int] = field(default_factory=list)
    #: layer of layerwise keys, ``None`` for whole blocks
    layer: int | None = None
    #: called once the save ran with, per key, whether it was written now and whether the
    #: store holds it now (KV cache events); not called when the store could not be used
    on_done: Callable[[list[bool], list[bool]], None] | None = None


@dataclass
class LoadTask:
    """Get ``keys`` into their ranges; ``block_ids[i]`` are the vLLM blocks key ``i`` fills."""

    req_id: str
    keys: list[str]
    addrs: list[list[int]]
    sizes: list[list[int]]
    block_ids: list[list[int]]
    #: called with the set of failed vLLM block ids once the task ran
    on_done: Callable[[set[int]], None] | None = None
    layer: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def run_save(task: SaveTask, backend: Backend, guard: StoreGuard,
             recorder: MetricsRecorder) -> int:
    """Run one save; returns the number of blocks written."""
    n = len(task.keys)
    if task.event is not None:
        task.event.synchronize()
    if not guard.available():
        recorder.inc("pool_dropped_save_blocks", n, cause="store_unavailable")
        return 0
    start = time.perf_counter()
    try:
        present = backend.exists(task.keys)
        todo = [i for i, p in enumerate(present) if p != 1]
        if len(todo) < n:
            recorder.inc("pool_skipped_save_blocks", n - len(todo))
        if not todo:
            _report_save(task, [False] * n, [p == 1 for p in present])
            return 0
        rcs = backend.put([task.keys[i] for i in todo], [task.addrs[i] for i in todo],
                          [task.sizes[i] for i in todo])
    except BackendUnavailableError as exc:
        guard.trip(exc)
        recorder.inc("pool_store_errors", 1, op="put")
        recorder.inc("pool_dropped_save_blocks", n, cause="store_unavailable")
        return 0
    except Exception as exc:  # a bad save must never take the engine down
        logger.warning("KV pool save of %d blocks for %s failed: %s", n, task.req_id, exc,
                       exc_info=True)
        recorder.inc("pool_store_errors", 1, op="put")
        recorder.inc("pool_dropped_save_blocks", n, cause="error")
        return 0
    written = 0
    nbytes = 0
    now_written = [False] * n
    for i, rc in zip(todo, rcs, strict=True):
        if rc == 0:
            written += 1
            nbytes += sum(task.sizes[i])
            now_written[i] = True
        else:
            recorder.inc("pool_dropped_save_blocks", 1, cause="store_error")
    if written < len(todo):
        logger.debug("KV pool: %d of %d puts for %s failed (first rc %s)", len(todo) - written,
                     len(todo), task.req_id, backend.describe_rc(
                         next(rc for rc in rcs if rc != 0)))
    recorder.inc("pool_saved_blocks", written)
    recorder.inc("pool_save_bytes", nbytes)
    recorder.observe("pool_save_seconds", time.perf_counter() - start)
    recorder.observe("pool_save_batch_bytes", nbytes)
    _report_save(task, now_written, [w or p == 1 for w, p in zip(now_written, present,
                                                                    strict=True)])
    return written


def _report_save(task: SaveTask, written: list[bool], present: list[bool]) -> None:
    if task.on_done is None:
        return
    try:
        task.on_done(written, present)
    except Exception:  # event bookkeeping must never fail a save
        logger.warning("KV pool: save report of %s failed", task.req_id, exc_info=True)


def merge_saves(tasks: list[SaveTask]) -> SaveTask:
    """One task saving the keys of all ``tasks`` (their events awaited, their reports split).

    The merged task's ``on_done`` hands each task its own slice of the results.
    """
    if len(tasks) == 1:
        return tasks[0]
    events = [t.event for t in tasks if t.event is not None]
    keys: list[str] = []
    addrs: list[list[int]] = []
    sizes: list[list[int]] = []
    block_ids: list[int] = []
    spans: list[tuple[SaveTask, int, int]] = []
    for t in tasks:
        spans.append((t, len(keys), len(keys) + len(t.keys)))
        keys += t.keys
        addrs += t.addrs
        sizes += t.sizes
        block_ids += t.block_ids
    merged = SaveTask(",".join(dict.fromkeys(t.req_id for t in tasks)), keys, addrs, sizes,
                      event=_AllEvents(events) if events else None, block_ids=block_ids)
    if any(t.on_done is not None for t in tasks):
        def on_done(written: list[bool], present: list[bool]) -> None:
            for t, start, end in spans:
                _report_save(t, written[start:end], present[start:end])

        merged.on_done = on_done
    return merged


class _AllEvents:
    """Several device events awaited as one."""

    def __init__(self, events: list[Any]) -> None:
        self.events = events

    def synchronize(self) -> None:
        for event in self.events:
            event.synchronize()


def merge_loads(tasks: list[LoadTask]) -> LoadTask:
    """One task getting the keys of all ``tasks`` (whole-block loads of one step)."""
    if len(tasks) == 1:
        return tasks[0]
    merged = LoadTask(",".join(dict.fromkeys(t.req_id for t in tasks)), [], [], [], [],
                      layer=tasks[0].layer)
    for t in tasks:
        merged.keys += t.keys
        merged.addrs += t.addrs
        merged.sizes += t.sizes
        merged.block_ids += t.block_ids
    return merged


def run_load(task: LoadTask, backend: Backend, guard: StoreGuard,
             recorder: MetricsRecorder) -> set[int]:
    """Run one load; returns the vLLM block ids that did not load."""
    failed: set[int] = set()
    start = time.perf_counter()
    try:
        if not guard.available():
            raise BackendUnavailableError("the store is marked unavailable")
        rcs = backend.get(task.keys, task.addrs, task.sizes)
    except BackendUnavailableError as exc:
        guard.trip(exc)
        recorder.inc("pool_store_errors", 1, op="get")
        rcs = [-1] * len(task.keys)
    except Exception as exc:  # reported to vLLM as failed blocks, never raised into it
        logger.warning("KV pool load of %d blocks for %s failed: %s", len(task.keys),
                       task.req_id, exc, exc_info=True)
        recorder.inc("pool_store_errors", 1, op="get")
        rcs = [-1] * len(task.keys)
    nbytes = 0
    for i, rc in enumerate(rcs):
        if rc == 0:
            nbytes += sum(task.sizes[i])
        else:
            failed.update(task.block_ids[i])
    ok = len(rcs) - sum(1 for rc in rcs if rc != 0)
    if ok < len(rcs):
        logger.warning("KV pool: %d of %d blocks of %s failed to load (first: %s); vLLM "
                       "recomputes or fails the request per kv_load_failure_policy",
                       len(rcs) - ok, len(rcs), task.req_id,
                       backend.describe_rc(next(rc for rc in rcs if rc != 0)))
    recorder.inc("pool_loaded_blocks", ok)
    recorder.inc("pool_failed_load_blocks", len(rcs) - ok)
    recorder.inc("pool_load_bytes", nbytes)
    recorder.observe("pool_load_seconds", time.perf_counter() - start)
    recorder.observe("pool_load_batch_bytes", nbytes)
    if task.on_done is not None:
        task.on_done(failed)
    return failed


class TransferThread:
    """A daemon thread running tasks from a bounded queue in order.

    Args:
        name: thread name.
        run: called with each task.
        maxsize: queue bound (``submit`` returns False when full).
    """

    _STOP = object()

    def __init__(self, name: str, run: Callable[[Any], Any], *, maxsize: int = 1024,
                 on_start: Callable[[], None] | None = None) -> None:
        self.name = name
        self._run = run
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=maxsize)
        self._on_start = on_start
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, task: Any) -> bool:
        """Queue ``task``; False (and nothing queued) when the queue is full."""
        try:
            self._queue.put_nowait(task)
            return True
        except queue.Full:
            return False

    def _loop(self) -> None:
        if self._on_start is not None:
            try:
                self._on_start()
            except Exception:  # e.g. set_device on a fake device
                logger.debug("%s: on_start failed", self.name, exc_info=True)
        while not self._stopping:
            task = self._queue.get()
            if task is self._STOP:
                return
            try:
                self._run(task)
            except Exception:  # keep serving later tasks
                logger.exception("%s: task failed", self.name)

    def drain(self, limit: int) -> list[Any]:
        """Up to ``limit`` tasks queued behind the running one (taken off the queue, not run).

        For the task being run to take its successors along; a stop request met
        here ends the thread once that task is done.
        """
        out: list[Any] = []
        while len(out) < limit and not self._stopping:
            try:
                task = self._queue.get_nowait()
            except queue.Empty:
                break
            if task is self._STOP:
                self._stopping = True
                break
            out.append(task)
        return out

    def stop(self, timeout: float = 5.0) -> None:
        """Finish queued tasks (up to ``timeout``) and stop."""
        try:
            self._queue.put(self._STOP, timeout=timeout)
        except queue.Full:
            logger.warning("%s: queue full at shutdown; %d tasks dropped", self.name,
                           self._queue.qsize())
            return
        self._thread.join(timeout)

    @property
    def depth(self) -> int:
        """Tasks waiting."""
        return self._queue.qsize()
