# SPDX-License-Identifier: Apache-2.0
"""D side of ``MooncakeConnectorV1``: the loads in flight and how each one ends.

Every request D pulls ends exactly once, as loaded or as failed; a failed
request's blocks go to ``get_block_ids_with_load_errors`` so vLLM recomputes or
fails it per ``kv_load_failure_policy``. A request still loading at its deadline
is failed at the deadline, except that its blocks go back to vLLM only once no
read into them is in flight (the transfer engine cannot cancel a read, and a late
one would overwrite blocks vLLM gave to another request).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder

from .contract import RecvMeta

logger = logging.getLogger(__name__)


@dataclass
class Pending:
    """A D request being loaded."""

    meta: RecvMeta
    deadline: float
    #: a transfer-engine read into the request's blocks is in flight
    reading: bool = False
    #: the deadline passed during a read: the load fails once the read has returned
    expired: bool = False


class LoadTracker:
    """D's loads in flight: deadlines, reads in flight, and the one end of each.

    Args:
        recorder: where the load metrics go.
        load_timeout_s: how long a load may take from :meth:`add`.
    """

    def __init__(self, recorder: MetricsRecorder, load_timeout_s: float) -> None:
        self.recorder = recorder
        self.load_timeout_s = load_timeout_s
        self._pending: dict[str, Pending] = {}
        self._ended: set[str] = set()
        self._failed: set[str] = set()
        self._failed_blocks: set[int] = set()
        self._lock = threading.Lock()
        # notified (under _lock) whenever a load ends: see wait
        self._cv = threading.Condition(self._lock)

    def __len__(self) -> int:
        with self._lock:
            return len(self._pending)

    def add(self, meta: RecvMeta, now: float) -> None:
        """Start the clock of a load."""
        with self._lock:
            self._pending[meta.request_id] = Pending(meta, now + self.load_timeout_s)

    def deadline(self, meta: RecvMeta) -> float:
        """When the load fails (0 once it ended)."""
        with self._lock:
            pending = self._pending.get(meta.request_id)
        return pending.deadline if pending else 0.0

    # ------------------------------------------------------------ ends
    def _end_locked(self, meta: RecvMeta, *, ok: bool) -> bool:
        """Hand the request back to vLLM (caller holds ``_lock``); False if it already
        ended."""
        if self._pending.pop(meta.request_id, None) is None:
            return False  # already ended (deadline passed, or a duplicate): ignore
        self._ended.add(meta.request_id)
        if not ok:
            self._failed.add(meta.request_id)
            self._failed_blocks.update(meta.local_block_ids)
        self._cv.notify_all()
        return True

    def finish(self, meta: RecvMeta, *, ok: bool, reason: str = "", cause: str = "") -> None:
        """End a load exactly once (success or failure); later calls are ignored."""
        with self._lock:
            if not self._end_locked(meta, ok=ok):
                return
        self._report_end(meta, ok=ok, reason=reason, cause=cause)

    def fail(self, meta: RecvMeta, reason: str, *, cause: str) -> None:
        """End a load as failed (``cause`` labels the failure metric)."""
        self.finish(meta, ok=False, reason=reason, cause=cause)

    def _report_end(self, meta: RecvMeta, *, ok: bool, reason: str, cause: str) -> None:
        if ok:
            self.recorder.inc("p2p_requests_loaded")
        else:
            self.recorder.inc("p2p_failures", cause=cause or "error")
            logger.error("request %s: KV load from P failed (%s): %s; its %d blocks are "
                         "reported for recompute/failure", meta.request_id, cause, reason,
                         len(meta.local_block_ids))

    def wait(self, request_ids: Iterable[str], timeout: float | None = None) -> bool:
        """Block until none of ``request_ids`` is still loading; False on timeout."""
        ids = list(request_ids)
        with self._cv:
            return self._cv.wait_for(lambda: not any(r in self._pending for r in ids), timeout)

    def loading(self, request_ids: Iterable[str]) -> bool:
        """Whether one of ``request_ids`` is still loading (no lock: a glance for a caller
        that polls; :meth:`wait` to block)."""
        pending = self._pending
        return any(r in pending for r in request_ids)

    def wait_any(self, timeout: float) -> bool:
        """Block until some load ended since the last :meth:`collect_finished` (or none
        is pending), at most ``timeout`` seconds; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: bool(self._ended) or not self._pending, timeout)

    # ------------------------------------------------------------ reads in flight
    def begin_read(self, meta: RecvMeta) -> bool:
        """Mark a read into the request's blocks as in flight; False when the load already
        ended (its blocks may belong to another request by now: never read into them)."""
        with self._lock:
            pending = self._pending.get(meta.request_id)
            if pending is None or pending.expired:
                return False
            pending.reading = True
            return True

    def end_read(self, meta: RecvMeta) -> bool:
        """The read returned; True when the load is still wanted. A load whose deadline
        passed during the read ends now, as failed at its deadline."""
        with self._lock:
            pending = self._pending.get(meta.request_id)
            if pending is None:
                return False
            pending.reading = False
            if not pending.expired:
                return True
            self._end_locked(meta, ok=False)
        self._report_end(meta, ok=False, cause="deadline",
                         reason=f"no KV within the {self.load_timeout_s:.1f}s deadline "
                                "(released once the read in flight at the deadline returned)")
        return False

    # ------------------------------------------------------------ vLLM hooks
    def collect_finished(self) -> set[str]:
        """Fail the loads past their deadline; the requests that ended since the last call."""
        return self.collect_results()[0]

    def collect_results(self) -> tuple[set[str], set[str]]:
        """Fail the loads past their deadline; the requests that ended since the last call,
        and those of them that failed (vLLM's ``failed_recving``)."""
        now = time.monotonic()
        ended: list[Pending] = []
        reading: list[Pending] = []
        with self._lock:
            for p in list(self._pending.values()):
                if p.deadline > now or p.expired:
                    continue
                if p.reading:
                    # The transfer engine cannot cancel a read, and a stalled one can still
                    # complete (a network that comes back): the blocks stay with the request
                    # until the read returns, then it fails (end_read). Mooncake bounds the
                    # stall by MC_TCP_PROGRESS_TIMEOUT_SEC.
                    p.expired = True
                    reading.append(p)
                elif self._end_locked(p.meta, ok=False):
                    # a pull that has not started reading never will (begin_read)
                    ended.append(p)
        if ended or reading:
            self.recorder.inc("p2p_load_deadlines", len(ended) + len(reading))
        for p in ended:
            self._report_end(p.meta, ok=False, cause="deadline",
                             reason=f"no KV within the {self.load_timeout_s:.1f}s deadline")
        for p in reading:
            logger.warning("request %s: no KV within the %.1fs deadline; a read is still in "
                           "flight, the request fails once it returned", p.meta.request_id,
                           self.load_timeout_s)
        with self._lock:
            out, self._ended = self._ended, set()
            failed, self._failed = self._failed & out, self._failed - out
            self.recorder.set("p2p_pending_loads", len(self._pending))
        return out, failed

    def take_load_errors(self) -> set[int]:
        """Blocks of failed loads since the last call."""
        with self._lock:
            out, self._failed_blocks = self._failed_blocks, set()
        return out
