# SPDX-License-Identifier: Apache-2.0
"""Mooncake transfers polled without blocking: every range an engine batch of its own.

Mooncake's non-blocking status call (``transfer_check_status``) looks at a batch's first
task only, and its status call for a whole batch (``get_batch_transfer_status``, as its
synchronous calls) waits for the end in a loop that never yields. A transfer whose ranges
are each a batch can be polled range by range: :func:`wait_yielding` does so with
``sched_yield`` between polls (the transfer engine's ``yield`` wait,
:data:`~.transfer_engine.WAIT_ENV`), :class:`PendingTransfer` for a caller that polls
on its own (:meth:`~.transfer_engine.MooncakeTransferEngine.submit_read`).

Why not one batch of all ranges, polled (issue 50 asked; Mooncake 0.3.13's Python binding,
``transfer_engine_py.cpp``): ``transfer_check_status`` reads the status of task 0 of a
batch only and frees the whole batch once that task ended, while the batch's other ranges
may still be in flight (the TCP transport moves each slice on its own connection, in no
set order); the only call that looks at every task, ``get_batch_transfer_status``, waits
in a loop that never yields (the ``spin`` wait). So a batch of several ranges can be
waited for by Mooncake only, and a read polled from Python goes out a range a batch. Both
are measured by ``vllm-ascend-kv bench p2p``: its raw read is one synchronous batch of all
ranges, the connector's read a batch per range polled with ``yield`` (2026-12-06, 2 CPUs
shared with other work, 8 and 64 layers: at 16 and 128 blocks the whole connector load took
0.60-0.65 of the one batch's time). At one block Mooncake's own calls took 26-28 us for 8
batches of a range against 17-20 us for one batch of the 8 (2026-12-05 trace).

This module sits below :mod:`.transfer_engine` and never imports it: a
:class:`PendingTransfer` needs only what :class:`PolledEngine` names of the wrapper.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any, Protocol

from .errors import TransferError


class ReadCounters(Protocol):
    """The counters a finished read adds to (those of
    :class:`~.transfer_engine.TransferStats`)."""

    reads: int
    bytes_read: int
    failures: int
    seconds: float


class PolledEngine(Protocol):
    """What a :class:`PendingTransfer` uses of the engine wrapper
    (:class:`~.transfer_engine.MooncakeTransferEngine`): Mooncake's engine, whose batches
    it polls, and the counters it adds the read to."""

    @property
    def raw(self) -> Any: ...

    @property
    def stats(self) -> ReadCounters: ...


def can_poll(engine: Any, op: str) -> bool:
    """Whether Mooncake's ``engine`` has the calls a transfer polled this way needs."""
    return (hasattr(engine, f"batch_transfer_async_{op}")
            and hasattr(engine, "transfer_check_status"))


def submit_each(engine: Any, op: str, peer: str, loc: Sequence[int], rem: Sequence[int],
                lens: Sequence[int]) -> tuple[list[int], int]:
    """Each range as a batch of its own: the batches in flight, and a negative code if the
    engine refused one (the later ranges are not submitted)."""
    submit = getattr(engine, f"batch_transfer_async_{op}")
    batches: list[int] = []
    for a, b, n in zip(loc, rem, lens, strict=True):
        batch = int(submit(peer, [a], [b], [n]))
        if batch <= 0 or batch >= 1 << 63:
            return batches, batch if batch < 0 else -1
        batches.append(batch)
    return batches, 0


def poll_in_order(engine: Any, batches: Sequence[int]) -> tuple[int, int]:
    """Polls ``batches`` in order up to the first still in flight: how many ended, and the
    code of the first that failed (0: none). A batch that ended is freed by the engine and
    must not be asked for again."""
    check = engine.transfer_check_status
    failed = 0
    for i, batch in enumerate(batches):
        # 1: done, -1: failed (both freed by the engine); 0: in flight, -2: a slice overdue
        # (still in flight: Mooncake's TCP transport fails a stalled one)
        rc = int(check(batch))
        if rc in (0, -2):
            return i, failed
        if rc < 0 and not failed:
            failed = rc
    return len(batches), failed


def wait_yielding(engine: Any, op: str, peer: str, loc: Sequence[int], rem: Sequence[int],
                  lens: Sequence[int]) -> int:
    """One batch of ranges, waited for with ``sched_yield`` between polls; Mooncake's
    return code (every range submitted has ended either way)."""
    batches, failed = submit_each(engine, op, peer, loc, rem, lens)
    while batches:
        os.sched_yield()
        ended, rc = poll_in_order(engine, batches)
        failed = failed or rc
        del batches[:ended]
    return failed


class PendingTransfer:
    """A read in flight (:meth:`~.transfer_engine.MooncakeTransferEngine.submit_read`): one
    engine batch per range, polled without blocking. The transfer engine cannot cancel a
    read: memory it reads into must stay reserved until :meth:`poll` says the read ended,
    either way."""

    def __init__(self, engine: PolledEngine, peer: str, nbytes: int) -> None:
        self._engine = engine
        self.peer = peer
        #: bytes the read moves
        self.nbytes = nbytes
        #: the engine batches still in flight
        self.batches: list[int] = []
        #: why the read failed (set once a range failed; raised once none is in flight)
        self.error = ""
        self._start = time.perf_counter()
        self._reported = False

    @property
    def done(self) -> bool:
        """No range is in flight any more (it ended, loaded or failed)."""
        return not self.batches

    def poll(self) -> int | None:
        """The bytes read once every range is in; ``None`` while one is in flight.

        Raises:
            TransferError: a range failed (raised once no other range is in flight).
        """
        if self.batches:
            ended, rc = poll_in_order(self._engine.raw, self.batches)
            del self.batches[:ended]
            if rc and not self.error:
                self.error = (f"read of {self.nbytes} bytes from {self.peer} failed: "
                              f"rc={rc} (peer dead, unreachable, or the remote memory "
                              "is not registered)")
            if self.batches:
                return None
        stats = self._engine.stats
        if self.error:
            if not self._reported:
                self._reported = True
                stats.failures += 1
            raise TransferError(self.error, op="read", peer=self.peer, rc=-1)
        if not self._reported:
            self._reported = True
            stats.reads += 1
            stats.bytes_read += self.nbytes
            stats.seconds += time.perf_counter() - self._start
        return self.nbytes
