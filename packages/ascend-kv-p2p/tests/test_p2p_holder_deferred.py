# SPDX-License-Identifier: Apache-2.0
"""P's blocks released within their read window wait for it, in the order the windows end."""
from __future__ import annotations

import types
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull import holder as pull_holder
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.holder import LeaseHolder


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def holder(monkeypatch: pytest.MonkeyPatch) -> tuple[LeaseHolder, Clock]:
    clock = Clock()
    monkeypatch.setattr(pull_holder.time, "monotonic", clock)
    shared: Any = types.SimpleNamespace(
        cfg=types.SimpleNamespace(lease_ttl_s=1000.0, hold_window_s=0.0),
        recorder=MetricsRecorder())
    return LeaseHolder(shared), clock


def test_released_blocks_wait_for_their_own_window_in_any_release_order(
        holder: tuple[LeaseHolder, Clock]) -> None:
    h, clock = holder
    # released out of the order their windows end, one of them past its window already
    for rid, until in (("c", 103.0), ("a", 101.0), ("now", 99.0), ("b", 102.0)):
        h._release(rid, keep_until=until)
    assert h.collect_finished() == {"now"}
    assert h.shared.recorder.gauge("p2p_held_requests") == 3  # the three still waiting
    clock.now = 101.5
    assert h.collect_finished() == {"a"}
    assert h.collect_finished() == set()  # each once
    clock.now = 103.0
    assert h.collect_finished() == {"b", "c"}
    assert h.shared.recorder.gauge("p2p_held_requests") == 0
    assert h._deferred == {} and h._deferred_order == []


def test_a_request_id_released_again_is_given_back_once_at_its_last_window(
        holder: tuple[LeaseHolder, Clock]) -> None:
    h, clock = holder
    h._release("r", keep_until=101.0)
    h._release("r", keep_until=104.0)  # held again under the same id, released again
    clock.now = 102.0
    assert h.collect_finished() == set()
    clock.now = 104.0
    assert h.collect_finished() == {"r"}
    clock.now = 200.0
    assert h.collect_finished() == set()
