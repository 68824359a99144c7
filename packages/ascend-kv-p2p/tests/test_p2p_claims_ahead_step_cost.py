# SPDX-License-Identifier: Apache-2.0
"""D's scheduler step looks only at the claims answered since the last step, not at every
request handed over while its claim is still out (``bench control``: with 8,192 of them
unanswered, ``build_connector_meta`` took 17 ms a step)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.params import RemotePrefill
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.scheduler import ClaimAhead


def test_a_step_costs_the_answers_that_came_not_the_claims_still_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    ahead = ClaimAhead(lambda p_tp: {0: 1}, 0.2, reader="x")
    gate = threading.Event()
    # the claim thread waits (a P slow to answer): every claim stays out
    monkeypatch.setattr(ahead, "_claim_all", lambda *a: (gate.wait(10), {})[1])
    try:
        remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=free_port(),
                               request_id="p", block_ids=[1], tp_size=1, pcp_size=1,
                               dcp_size=1)
        ids = [f"r{i}" for i in range(300)]
        for rid in ids:
            assert ahead.start(rid, remote, [1])
            assert ahead.hand_over(rid, [1]) == (True, None)  # owed its answers
        looked = []
        done = Future.done

        def counted(fut: Future[Any]) -> bool:
            looked.append(fut)
            return done(fut)

        monkeypatch.setattr(Future, "done", counted)
        assert ahead.take_answers() == {}
        assert looked == []  # no claim answered: nothing looked at
        monkeypatch.setattr(Future, "done", done)
        gate.set()
        got: dict[str, Any] = {}
        deadline = time.monotonic() + 10
        while len(got) < len(ids) and time.monotonic() < deadline:
            got.update(ahead.take_answers())
            time.sleep(0.01)
        assert sorted(got) == sorted(ids)  # each answer once, once it came
        assert ahead.take_answers() == {}
    finally:
        gate.set()
        ahead.stop()
