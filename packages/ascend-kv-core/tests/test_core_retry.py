# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import threading

import pytest

from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
from vllm_ascend.distributed.kv_transfer.core.retry import RetryGuard, RetryPolicy


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


def test_retry_policy_waits_grow_by_the_factor_up_to_the_cap() -> None:
    policy = RetryPolicy(attempts=9, delay_s=0.25, max_delay_s=4.0)
    assert [policy.delay(n) for n in range(7)] == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert RetryPolicy(attempts=3, delay_s=0.2, backoff=1.0).delay(5) == 0.2
    assert policy.delay(10_000) == 4.0  # no overflow
    assert policy.retries == 8 and RetryPolicy(deadline_s=1.0).retries is None


def test_retry_policy_stops_after_its_attempts() -> None:
    policy = RetryPolicy(attempts=3, delay_s=0.1, max_delay_s=1.0)
    got = [policy.next_delay(n, started=0.0, now=0.0) for n in range(4)]
    assert got == [0.1, 0.2, None, None]  # three tries in all: two retries
    assert RetryPolicy(attempts=1).next_delay(0, started=0.0, now=0.0) is None


def test_retry_policy_stops_at_its_deadline_and_at_the_callers() -> None:
    policy = RetryPolicy(delay_s=0.01, max_delay_s=0.5, deadline_s=10.0)
    assert policy.next_delay(50, started=0.0, now=9.99) == 0.5  # no count, before the end
    assert policy.next_delay(50, started=0.0, now=10.0) is None
    assert policy.next_delay(0, started=0.0, now=2.0, until=2.5) == 0.01
    assert policy.next_delay(0, started=0.0, now=2.5, until=2.5) is None  # the caller's


def test_a_retry_that_must_fit_needs_its_wait_and_delay_s_left() -> None:
    """``fit``: a retry starts only if, after its wait, ``delay_s`` of the deadline is left
    (the rule of D's read retries: a retry that cannot end in time is not made)."""
    policy = RetryPolicy(attempts=9, delay_s=0.25, max_delay_s=4.0)
    assert policy.next_delay(1, started=0.0, now=0.0, until=0.76, fit=True) == 0.5
    assert policy.next_delay(1, started=0.0, now=0.0, until=0.75, fit=True) is None
    assert policy.next_delay(1, started=0.0, now=0.0, until=0.75) == 0.5  # without fit


@pytest.mark.parametrize(("data", "needle"), [
    ({"attempts": 0}, "attempts: must be >= 1"),
    ({"delay_s": -1}, "delay_s: must be >= 0"),
    ({"backoff": 0.5}, "backoff: must be >= 1"),
    ({"delay_s": 2.0, "max_delay_s": 1.0}, "max_delay_s (1.0) is below delay_s (2.0)"),
    ({"attempts": None, "deadline_s": None}, "set attempts or deadline_s"),
    ({"deadline_s": "soon"}, "deadline_s: expected a number"),
])
def test_retry_policy_config_errors_name_the_key(data: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        RetryPolicy.from_dict({"attempts": 2, **data}, source="claim_retry")
    assert needle in str(info.value) and "claim_retry" in str(info.value)


def test_retry_policy_parses_from_config() -> None:
    policy = RetryPolicy.from_dict({"attempts": "4", "delay_s": 0.05, "max_delay_s": 1})
    assert policy == RetryPolicy(attempts=4, delay_s=0.05, max_delay_s=1.0)
    assert [policy.next_delay(n, started=0.0, now=0.0) for n in range(4)] == [
        0.05, 0.1, 0.2, None]


class _Refused(Exception):
    def __init__(self, retryable: bool) -> None:
        super().__init__("retryable" if retryable else "final")
        self.retryable = retryable


def _calls(outcomes: list[object]) -> tuple[list[float], object]:
    """A call that raises or returns the next of ``outcomes``; the times it was made."""
    made: list[float] = []

    def fn() -> object:
        import time

        made.append(time.monotonic())
        out = outcomes.pop(0)
        if isinstance(out, Exception):
            raise out
        return out

    return made, fn


def test_retry_policy_call_retries_what_it_is_told_then_returns_the_result() -> None:
    policy = RetryPolicy(attempts=5, delay_s=0.001, backoff=1.0, max_delay_s=0.001)
    made, fn = _calls([_Refused(True), _Refused(True), "ok"])
    got = policy.call(fn, retry_if=lambda e: getattr(e, "retryable", False))  # type: ignore[arg-type]
    assert (got.result, got.retries, len(made)) == ("ok", 2, 3)
    assert made[-2] < got.sent_at <= made[-1]  # taken as the try that answered began


def test_retry_policy_call_raises_at_once_what_it_must_not_retry() -> None:
    policy = RetryPolicy(attempts=5, delay_s=0.001, backoff=1.0, max_delay_s=0.001)
    made, fn = _calls([_Refused(True), _Refused(False), "never"])
    with pytest.raises(_Refused, match="final"):
        policy.call(fn, retry_if=lambda e: getattr(e, "retryable", False))  # type: ignore[arg-type]
    assert len(made) == 2


def test_retry_policy_call_raises_the_last_error_when_attempts_run_out() -> None:
    policy = RetryPolicy(attempts=3, delay_s=0.001, backoff=1.0, max_delay_s=0.001)
    made, fn = _calls([_Refused(True)] * 4)
    with pytest.raises(_Refused, match="retryable"):
        policy.call(fn, retry_if=lambda e: True)  # type: ignore[arg-type]
    assert len(made) == 3
