# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import threading

import pytest

from vllm_ascend.distributed.kv_transfer.core.retry import RetryGuard


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_failure_trips_the_guard_for_the_interval_then_it_reopens() -> None:
    clock = Clock()
    guard = RetryGuard(10.0, clock=clock)
    assert guard.available() and guard.remaining_s() == 0.0 and guard.trips == 0
    assert guard.trip() is True  # the first failure of an outage
    assert not guard.available()
    assert guard.remaining_s() == pytest.approx(10.0)
    clock.now += 9.9
    assert not guard.available()
    clock.now += 0.1
    assert guard.available()
    assert guard.trips == 1


def test_only_the_first_failure_of_an_outage_says_so_and_each_one_extends_it() -> None:
    clock = Clock()
    guard = RetryGuard(5.0, clock=clock)
    assert guard.trip() is True
    clock.now += 3.0
    assert guard.trip() is False  # still tripped: not a new outage
    clock.now += 4.0  # 7s after the first failure, 4s after the second
    assert not guard.available()
    clock.now += 1.0
    assert guard.available()
    assert guard.trip() is True  # a new outage
    assert guard.trips == 3


def test_reset_reopens_at_once() -> None:
    clock = Clock()
    guard = RetryGuard(60.0, clock=clock)
    guard.trip()
    guard.reset()
    assert guard.available() and guard.trips == 1


def test_zero_interval_never_skips_but_counts() -> None:
    guard = RetryGuard(0.0)
    assert guard.trip() is True
    assert guard.available()
    assert guard.trip() is True
    assert guard.trips == 2


def test_negative_interval_is_an_error_naming_the_value() -> None:
    with pytest.raises(ValueError, match=r"retry_after_s must be >= 0, got -1"):
        RetryGuard(-1)


def test_concurrent_trips_are_all_counted_and_one_is_first() -> None:
    guard = RetryGuard(60.0)
    firsts: list[bool] = []
    lock = threading.Lock()

    def fail() -> None:
        for _ in range(200):
            first = guard.trip()
            with lock:
                firsts.append(first)

    threads = [threading.Thread(target=fail) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert guard.trips == 800
    assert firsts.count(True) == 1
    assert not guard.available()
