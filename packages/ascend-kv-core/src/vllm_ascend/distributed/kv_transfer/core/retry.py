# SPDX-License-Identifier: Apache-2.0
"""Retries: how a failed call is tried again, and when to stop calling a failed peer.

How a failed call is tried again is :class:`RetryPolicy`; the guard that stops calling a
peer for a while after a failure is :class:`RetryGuard`.

:class:`RetryPolicy` is the one description of a retry loop: how many tries, how long
apart (a back-off that grows by a factor up to a cap) and until when. It is a config
section: a connector declares one per call it retries, with that call's defaults
(``option(default_factory=lambda: RetryPolicy(...))``), and users override any of its
keys in ``kv_connector_extra_config``. The policy only does the arithmetic; the caller
decides which failures are worth a retry, sleeps, and counts.

A connector must never make the engine wait on a dead peer step after step
(a pool store that went away, a lookup socket nobody answers, the offload
metadata server). :class:`RetryGuard` is the one circuit breaker they share:
a failure *trips* it for ``retry_after_s``; while tripped, callers skip the
peer at once (a miss, a dropped save, a fast error); once the interval passed
the next call tries the peer again, and a success closes the guard.

The guard only keeps time and counts; each caller decides what "skip" means
and what to log.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from .config.base import ConfigSection, option
from .errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["Attempted", "RetryGuard", "RetryPolicy"]

T = TypeVar("T")


@dataclass(frozen=True)
class Attempted(Generic[T]):
    """What :meth:`RetryPolicy.call` got: the call's result, the ``time.monotonic()`` at
    which the try that gave it started, and the retries made before it."""

    result: T
    sent_at: float
    retries: int


@dataclass(frozen=True)
class RetryPolicy(ConfigSection):
    """How a failed call is tried again: tries, back-off, deadline.

    The wait before retry ``n`` (0: the first retry) is
    ``min(delay_s * backoff ** n, max_delay_s)``. No retry is made once ``attempts``
    tries were made in all, nor once ``deadline_s`` passed since the first try, nor once
    a deadline of the caller's own passed (a load's: see :meth:`next_delay`).

    Raises:
        ConfigError: (from :meth:`from_dict`) a value out of range, a cap below the first
            wait, or neither ``attempts`` nor ``deadline_s`` set (retries without end).
    """

    attempts: int | None = option(
        None, minimum=1,
        doc="Tries in all, the first one included (1: no retry); null: no count, the "
            "deadline ends the retries.")
    delay_s: float = option(0.1, minimum=0.0, doc="Wait before the first retry, in seconds.")
    backoff: float = option(2.0, minimum=1.0,
                            doc="Factor each next wait is multiplied by (1: a fixed wait).")
    max_delay_s: float = option(1.0, minimum=0.0,
                                doc="Longest wait between two tries, in seconds.")
    deadline_s: float | None = option(
        None, minimum=0.0,
        doc="No retry starts later than this many seconds after the first try; null: none "
            "(attempts, or the deadline of what the call is for, end the retries).")

    def validate(self, source: str) -> None:
        if self.max_delay_s < self.delay_s:
            raise ConfigError(
                f"{source}: max_delay_s ({self.max_delay_s}) is below delay_s "
                f"({self.delay_s})", key=f"{source}.max_delay_s", value=self.max_delay_s,
                source=source)
        if self.attempts is None and self.deadline_s is None:
            raise ConfigError(
                f"{source}: set attempts or deadline_s (with neither, a call that keeps "
                "failing is retried without end)", key=f"{source}.attempts", value=None,
                source=source)

    @property
    def retries(self) -> int | None:
        """Retries at most after the first try (``None``: no count)."""
        return None if self.attempts is None else self.attempts - 1

    def delay(self, retry: int) -> float:
        """The wait before retry ``retry`` (0: the first retry), in seconds."""
        try:
            return min(self.delay_s * self.backoff ** retry, self.max_delay_s)
        except OverflowError:
            return self.max_delay_s

    def next_delay(self, retries: int, *, started: float, now: float | None = None,
                   until: float = math.inf, fit: bool = False) -> float | None:
        """The wait before the next try, after ``retries`` retries of a call first tried at
        ``started``; ``None`` when no retry is made.

        Args:
            retries: retries made so far (0 after the first try failed).
            started: ``time.monotonic()`` of the first try (``deadline_s`` counts from it).
            now: ``time.monotonic()`` now (default: read the clock).
            until: the caller's own deadline (``time.monotonic()``), e.g. a load's.
            fit: the retry must also end in time: none is made unless, after the wait, at
                least ``delay_s`` of the deadline is left (the retry of a read, which
                takes time itself); without it one is made while the deadline has not
                passed (the retry of a short call).
        """
        if self.attempts is not None and retries + 1 >= self.attempts:
            return None
        now = time.monotonic() if now is None else now
        end = until if self.deadline_s is None else min(until, started + self.deadline_s)
        delay = self.delay(retries)
        if fit:
            return None if end - now <= delay + self.delay_s else delay
        return None if now >= end else delay


    def call(self, fn: Callable[[], T], *, retry_if: Callable[[Exception], bool],
             until: float = math.inf) -> Attempted[T]:
        """``fn()``, tried again after an exception ``retry_if`` accepts, as
        :meth:`next_delay` says (``until``: the caller's deadline); the last exception is
        raised when no retry is made, any other at once."""
        started = time.monotonic()
        retries = 0
        while True:
            sent_at = time.monotonic()
            try:
                return Attempted(fn(), sent_at, retries)
            except Exception as exc:
                delay = (self.next_delay(retries, started=started, until=until)
                         if retry_if(exc) else None)
                if delay is None:
                    raise
            time.sleep(delay)
            retries += 1

class RetryGuard:
    """Open (the peer may be called) or tripped until a deadline.

    Thread-safe: save threads, load threads and the scheduler may share one.

    Args:
        retry_after_s: how long a failure keeps the guard tripped (0: never skip).
        clock: monotonic time source (tests inject a fake one).

    Raises:
        ValueError: a negative ``retry_after_s``.
    """

    def __init__(self, retry_after_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {retry_after_s}")
        self.retry_after_s = float(retry_after_s)
        self._clock = clock
        self._down_until = 0.0
        self._lock = threading.Lock()
        #: failures recorded by :meth:`trip` since creation
        self.trips = 0

    def available(self) -> bool:
        """True when the peer may be called now."""
        with self._lock:
            return self._clock() >= self._down_until

    def remaining_s(self) -> float:
        """Seconds left until the peer may be called again (0 when available)."""
        with self._lock:
            return max(0.0, self._down_until - self._clock())

    def trip(self) -> bool:
        """The peer failed: skip it for ``retry_after_s`` from now.

        Returns:
            True when the guard was available before this failure (the first
            failure of an outage: the one worth a warning), False when it was
            already tripped.
        """
        with self._lock:
            now = self._clock()
            first = now >= self._down_until
            self._down_until = now + self.retry_after_s
            self.trips += 1
        return first

    def reset(self) -> None:
        """The peer answered: call it again at once."""
        with self._lock:
            self._down_until = 0.0
