# SPDX-License-Identifier: Apache-2.0
"""The retry guard: after a failure, stop calling a peer for a while.

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
import threading
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)

__all__ = ["RetryGuard"]


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
