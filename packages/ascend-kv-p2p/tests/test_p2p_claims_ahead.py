# SPDX-License-Identifier: Apache-2.0
"""Claims sent ahead: D's scheduler claims a request on P when it first sees it.

Real P and D pull workers (side channels, the real transfer engine on loopback) and D's
real ``PullScheduler`` with stand-in requests: the claim goes out from
``get_num_new_matched_tokens``, once; the worker reads without claiming when the answer
says P holds the blocks, claims itself when the answer is a refusal or is late (never
hangs), and a request aborted before allocation drops its claim and releases P.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from p2p_worker_harness import numbered_caches, pd_vllm_config

from ascend_kv_testing.keys import set_deployment_key
from vllm_ascend.distributed.kv_transfer.core import auth
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.params import RemotePrefill
from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import Claim
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import (
    CLOCK_SKEW_S,
    EarlyClaim,
    MooncakeConnectorMetadata,
    RecvMeta,
    SendMeta,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.peers import (
    accepted_ahead,
    claim_sent_at,
    refused_ahead,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.scheduler import ClaimAhead, PullScheduler
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.worker import PullWorker
from vllm_ascend.distributed.kv_transfer.kv_p2p.signed_params import sign

BS, NB, HEADS, HD, LAYERS = 16, 8, 2, 8, 2
KEY = "deployment-key-for-the-claims-ahead-tests-01"




@pytest.fixture(params=["unkeyed", "keyed"])
def pd(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A P and a D pull worker, and D's scheduler-side claimer (same engine id as D)."""
    set_deployment_key(monkeypatch, KEY if request.param == "keyed" else None)
    p_port, d_port = free_port(), free_port()
    p = PullWorker(pd_vllm_config("kv_producer", p_port, block_size=BS, heads=HEADS),
                   MooncakeP2PConfig.from_dict({"lease_ttl_s": 30.0}), "P",
                   MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    d = PullWorker(pd_vllm_config("kv_consumer", d_port, block_size=BS, heads=HEADS),
                   MooncakeP2PConfig.from_dict({"load_timeout_s": 10.0}), "D",
                   MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    cp = numbered_caches(True, layers=LAYERS, blocks=NB, heads=HEADS, block_size=BS,
                         head_size=HD)
    cd = numbered_caches(False, layers=LAYERS, blocks=NB, heads=HEADS, block_size=BS,
                         head_size=HD)
    p.register_kv_caches(cp)
    d.register_kv_caches(cd)
    # P's side channel: every Claim it answers, by request id
    claims: list[str] = []
    handle = p.holder.handle

    def spy(msg: Any) -> Any:
        if isinstance(msg, Claim):
            claims.append(msg.request_id)
        return handle(msg)

    p.holder.server.handler = spy
    # the worker's own claims
    own: list[str] = []
    original = d.reader.peers.claim

    def own_claim(meta: Any, p_rank: int, n: int) -> Any:
        own.append(meta.request_id)
        return original(meta, p_rank, n)

    d.reader.peers.claim = own_claim  # type: ignore[method-assign]
    ahead = ClaimAhead(lambda p_tp: {0: 1}, 5.0, reader="D/scheduler", engine_id="D")
    try:
        yield SimpleNamespace(p=p, d=d, cp=cp, cd=cd, p_port=p_port, ahead=ahead,
                              claims=claims, own=own, keyed=request.param == "keyed")
    finally:
        ahead.stop()
        p.shutdown()
        d.shutdown()
        monkeypatch.setattr(auth, "_cached", None)


def hold(pd: Any, rid: str, src: list[int], token: str | None = None) -> RemotePrefill:
    """P holds ``src`` for ``rid``; the params D gets."""
    token = auth.capability_token() if token is None else token
    pd.p.start_load_kv(MooncakeConnectorMetadata(
        requests_to_send={rid: SendMeta(rid, src, token)}))
    return RemotePrefill(engine_id="P", host="127.0.0.1", port=pd.p_port, request_id=rid,
                         block_ids=src, tp_size=1, pcp_size=1, dcp_size=1, token=token)


def answers_of(pd: Any, rid: str, blocks: list[int]) -> dict[int, EarlyClaim]:
    """Wait for the claim sent ahead to be answered; hand the request over with it."""
    fut = pd.ahead._sent[rid][1]
    fut.result(timeout=10)
    ok, answers = pd.ahead.hand_over(rid, blocks)
    assert ok and answers is not None
    return answers


def load(pd: Any, meta: RecvMeta, *, steps: Any = None, ok: bool = True) -> None:
    """Start the load, run engine steps (``steps()`` gives each step's metadata) until it
    ends; check how it ended (and the bytes)."""
    pd.d.start_load_kv(MooncakeConnectorMetadata(requests={meta.request_id: meta}))
    deadline = time.monotonic() + 20
    while not pd.d.wait_loads([meta.request_id], timeout=0.01):
        assert time.monotonic() < deadline, "the load did not end"
        if steps is not None:
            pd.d.start_load_kv(steps())
    _s, recving = pd.d.get_finished()
    assert recving == {meta.request_id}
    errors = pd.d.get_block_ids_with_load_errors()
    if not ok:
        assert errors == set(meta.local_block_ids)
        return
    assert errors == set()
    for name, value in pd.cd.items():
        torch.testing.assert_close(value[meta.local_block_ids],
                                   pd.cp[name][meta.remote_block_ids], rtol=0, atol=0)


def p_released(pd: Any, rid: str) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        sending, _r = pd.p.get_finished()
        if sending and rid in sending:
            return True
        time.sleep(0.01)
    return False


def test_the_claim_sent_ahead_replaces_the_workers(pd: Any) -> None:
    remote = hold(pd, "a", [3, 5])
    assert pd.ahead.start("a", remote, [3, 5])
    assert pd.ahead.start("a", remote, [3, 5])  # vLLM asks again: no second claim
    answers = answers_of(pd, "a", [3, 5])
    assert answers[0].ok and answers[0].first_try
    assert (answers[0].block_addrs is not None) is pd.keyed  # a keyed P's grant
    if pd.keyed:  # it names the claimed blocks, and D reads there without a claim of its own
        m = pd.p.meta
        assert np.frombuffer(answers[0].block_addrs, dtype="<u8").tolist() == [
            base + b * stride for base, stride in zip(m.region_addrs, m.region_strides,
                                                      strict=True) for b in (3, 5)]
    load(pd, RecvMeta("a", [1, 2], remote, remote_block_ids=[3, 5], claimed_ahead=True,
                      early_claims=answers))
    assert pd.claims == ["a"] and pd.own == []  # one claim, the scheduler's
    assert p_released(pd, "a")  # the worker's Done freed P's blocks
    # the pull forgets its answers when its thread ends, which may be just after the Done
    # reached P (CI saw the inbox still at 1 here once)
    deadline = time.monotonic() + 5.0
    while len(pd.d.reader.inbox) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(pd.d.reader.inbox) == 0


def test_an_answer_after_allocation_reaches_the_worker(pd: Any) -> None:
    remote = hold(pd, "b", [6])
    gate = threading.Event()
    claim_all = pd.ahead._claim_all
    pd.ahead._claim_all = lambda *a: (gate.wait(10), claim_all(*a))[1]
    pd.ahead.engine_id = ""  # no worker in this process: answers go with the metadata
    pd.ahead.start("b", remote, [6])
    assert pd.ahead.hand_over("b", [6]) == (True, None)  # not answered yet
    answered: list[Any] = []

    def step() -> MooncakeConnectorMetadata:
        gate.set()
        answers = pd.ahead.take_answers()
        answered.extend(answers)
        return MooncakeConnectorMetadata(claim_answers=answers)

    # the worker reads at once where the regions are known (unkeyed P); a keyed P's first
    # read needs the grant: it waits a little for the answer, then claims itself
    load(pd, RecvMeta("b", [4], remote, remote_block_ids=[6], claimed_ahead=True),
         steps=step)
    assert pd.claims.count("b") in (1, 2) and pd.own.count("b") <= 1
    assert p_released(pd, "b")


def test_no_answer_the_worker_claims_after_its_read(pd: Any) -> None:
    remote = hold(pd, "c", [2])
    # claimed ahead by a scheduler whose answer never comes (lost with its process)
    load(pd, RecvMeta("c", [7], remote, remote_block_ids=[2], claimed_ahead=True))
    assert pd.own == ["c"] and pd.claims == ["c"]
    assert p_released(pd, "c")


def test_a_refused_claim_ahead_falls_back_to_the_workers_claim(pd: Any) -> None:
    remote = hold(pd, "d", [4])
    stolen = dataclasses.replace(remote, token=auth.capability_token())
    pd.ahead.start("d", stolen, [4])
    answers = answers_of(pd, "d", [4])
    assert not answers[0].ok and answers[0].error == "bad_token"
    # the worker claims itself with the same (wrong) token: refused, the load fails
    load(pd, RecvMeta("d", [3], stolen, remote_block_ids=[4], claimed_ahead=True,
                      early_claims=answers), ok=False)
    assert pd.own == ["d"]
    # the right token still works: P's blocks were never touched
    load(pd, RecvMeta("d2", [3], remote, remote_block_ids=[4]))


def test_a_claim_before_p_registered_the_request_falls_back(pd: Any,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull import holder as pull_holder

    monkeypatch.setattr(pull_holder, "CLAIM_WAIT_S", 0.0)
    token = auth.capability_token()
    remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=pd.p_port, request_id="e",
                           block_ids=[1], tp_size=1, pcp_size=1, dcp_size=1, token=token)
    pd.ahead.start("e", remote, [1])  # P has not registered "e" yet
    answers = answers_of(pd, "e", [1])
    assert not answers[0].ok and answers[0].error == "unknown_request"
    hold(pd, "e", [1], token)
    load(pd, RecvMeta("e", [0], remote, remote_block_ids=[1], claimed_ahead=True,
                      early_claims=answers))
    assert pd.own == ["e"]


def test_a_changed_prefix_hit_is_not_handed_over() -> None:
    ahead = ClaimAhead(lambda p_tp: {0: 1}, 0.2, reader="x")
    try:
        remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=free_port(),
                               request_id="f", block_ids=[1, 2, 3], tp_size=1, pcp_size=1,
                               dcp_size=1)
        ahead.start("f", remote, [1, 2, 3])
        assert ahead.hand_over("f", [2, 3]) == (False, None)  # the workers claim [2, 3]
        assert ahead.hand_over("f", [2, 3]) == (False, None)
        assert ahead.take_answers() == {}
    finally:
        ahead.stop()


def test_stop_drops_every_claim_not_sent_to_a_p_that_does_not_answer() -> None:
    """Claims to a P that never answers, one per request, most of them no longer waited for
    (their prefix hit changed): after stop the claim thread ends after the one in flight,
    it does not work through the queue (a process exiting waited for all of them)."""
    import threading
    import time

    timeout_s = 1.0
    ahead = ClaimAhead(lambda p_tp: {0: 1}, timeout_s, reader="x")
    port = free_port()  # nothing listens: every call waits out its timeout
    for i in range(40):
        remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=port,
                               request_id=f"r{i}", block_ids=[1, 2], tp_size=1, pcp_size=1,
                               dcp_size=1)
        assert ahead.start(f"r{i}", remote, [1, 2])
        if i % 2:
            assert ahead.hand_over(f"r{i}", [2]) == (False, None)
    ahead.stop()
    deadline = time.monotonic() + 4 * timeout_s + 3.0
    while any(t.name.startswith("p2p-claim-ahead") for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the claim thread still works through its queue"
        time.sleep(0.05)


# ------------------------------------------------------------ D's scheduler


def _scheduler(p_port: int) -> PullScheduler:
    cfg = MooncakeP2PConfig.from_dict({"handshake_timeout_s": 2.0})
    vc = pd_vllm_config("kv_consumer", free_port(), block_size=BS, heads=HEADS)
    return PullScheduler(vc, cfg, "D-sched")


def _request(rid: str, remote: RemotePrefill) -> Any:
    params = {"do_remote_prefill": True, "remote_block_ids": remote.block_ids,
              "remote_engine_id": "P", "remote_host": remote.host,
              "remote_port": remote.port, "remote_request_id": remote.request_id,
              "remote_tp_size": 1, "remote_claim_token": remote.token}
    # as P returns them: MACed with the deployment key when there is one (D checks it)
    sign(params, ttl_s=60)
    return SimpleNamespace(request_id=rid, kv_transfer_params=params,
                           prompt_token_ids=list(range(len(remote.block_ids) * BS)),
                           status=None)


def test_the_scheduler_claims_when_it_first_sees_the_request(pd: Any) -> None:
    remote = hold(pd, "g", [2, 3])
    sched = _scheduler(pd.p_port)
    try:
        req = _request("g", remote)
        assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
        assert sched.get_num_new_matched_tokens(req, 0) == (2 * BS, True)  # asked again
        assert sched.claims is not None
        sched.claims._sent["g"][1].result(timeout=10)
        assert pd.claims == ["g"]  # one claim, before any allocation
        blocks = SimpleNamespace(get_unhashed_block_ids=lambda: [5, 6])
        sched.update_state_after_alloc(req, blocks, 2 * BS)  # type: ignore[arg-type]
        meta = sched.build_connector_meta(None)  # type: ignore[arg-type]
        assert meta.idle is False  # a scheduler output that does not say: a busy step
        recv = meta.requests["g"]
        assert recv.claimed_ahead and recv.early_claims and recv.early_claims[0].ok
        load(pd, recv)
        assert pd.claims == ["g"] and pd.own == []
    finally:
        sched.shutdown()


def test_abort_before_allocation_drops_the_claim_and_releases_p(pd: Any) -> None:
    remote = hold(pd, "h", [4])
    sched = _scheduler(pd.p_port)
    try:
        req = _request("h", remote)
        sched.get_num_new_matched_tokens(req, 0)
        assert sched.claims is not None
        sched.claims._sent["h"][1].result(timeout=10)
        sched.request_finished(req, [])  # type: ignore[arg-type]  # aborted while waiting
        assert "h" not in sched.claims._sent and sched.claims.take_answers() == {}
        meta = sched.build_connector_meta(None)  # type: ignore[arg-type]
        assert meta.requests["h"].release_only
        pd.d.start_load_kv(meta)  # the worker's Done(success=False)
        assert p_released(pd, "h")
    finally:
        sched.shutdown()


# ------------------------------------------------------------ answers and clocks


def test_an_answer_is_trusted_from_when_its_claim_was_sent() -> None:
    a = EarlyClaim(ok=True, first_try=True, sent_wall=1000.0)
    sent = claim_sent_at(a, now_mono=50.0, now_wall=1002.0)
    assert sent == pytest.approx(50.0 - 2.0 - CLOCK_SKEW_S)
    # a scheduler clock far ahead of ours: never trusted (the worker asks P after its read)
    assert claim_sent_at(a, now_mono=50.0, now_wall=999.0) == -math.inf


def test_refusals_and_acceptances() -> None:
    ok = EarlyClaim(ok=True, first_try=True, sent_wall=time.time(),
                    block_addrs=bytes(range(16)), num_regions=2)
    no = EarlyClaim(ok=False, error="released")
    assert not refused_ahead(None) and not refused_ahead({0: ok}) and refused_ahead({0: no, 1: ok})
    assert accepted_ahead(None, [0]) is None
    got = accepted_ahead({0: ok, 1: no}, [0, 1, 2])
    assert got is not None and list(got) == [0]
    claimed = got[0].result()
    assert claimed.first_try and claimed.grant is not None
    assert claimed.grant.block_addrs == bytes(range(16)) and claimed.grant.num_regions == 2


def test_a_step_that_runs_no_token_is_idle_for_the_worker() -> None:
    sched = _scheduler(free_port())
    try:
        idle = sched.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=0))
        busy = sched.build_connector_meta(SimpleNamespace(total_num_scheduled_tokens=7))
        assert idle.idle is True and busy.idle is False  # type: ignore[arg-type]
    finally:
        sched.shutdown()


@pytest.mark.parametrize("layerwise", [False, True])
def test_the_connector_hands_the_bound_steps_idle_mark_to_its_worker(layerwise: bool) -> None:
    """vLLM binds the step's metadata around get_finished: the worker learns from it whether
    the step ran a token (and waits for a load only when it did not)."""
    from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.connector import (
        MooncakeLayerwiseConnector,
        MooncakeLayerwiseConnectorMetadata,
    )
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.connector import MooncakeConnector

    asked: list[bool] = []

    class Worker:
        def get_finished(self, *args: Any, idle: bool = False) -> tuple[None, None]:
            asked.append(idle)
            return None, None

    cls: Any = MooncakeLayerwiseConnector if layerwise else MooncakeConnector
    meta_cls: Any = MooncakeLayerwiseConnectorMetadata if layerwise else MooncakeConnectorMetadata
    conn = object.__new__(cls)  # the worker side alone, with a stand-in worker
    conn.connector_worker = Worker()
    conn._connector_metadata = None
    conn.get_finished(set())  # outside a step (nothing bound): a busy step
    conn.bind_connector_metadata(meta_cls(idle=True))
    conn.get_finished(set())
    conn.bind_connector_metadata(meta_cls())
    conn.get_finished(set())
    conn.clear_connector_metadata()
    assert asked == [False, True, False]
