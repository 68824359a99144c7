# SPDX-License-Identifier: Apache-2.0
"""Worker-side logic of MooncakeLayerwiseConnector, P and D workers in one process.

KV caches are plain CPU tensors in each supported layout; P pushes through the real
Mooncake transfer engine over TCP on loopback. A "step" is what the model runner does:
``save_kv_layer`` for each layer, then ``wait_for_save`` and ``get_finished``.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import p2p_worker_harness as harness
import pytest
import torch
from p2p_worker_harness import layer_name, layout_caches, pd_vllm_config

from vllm_ascend.distributed.kernels.heads import plan_head_slices
from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.errors import RemoteError
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeLayerwiseConfig
from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.contract import (
    MooncakeLayerwiseConnectorMetadata,
    PushReq,
    RecvReq,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.worker import LayerwiseWorker
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.params import PushTarget
from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import (
    LAYERWISE_CODEC,
    PushBegin,
    PushDone,
    PushDoneAck,
    PushGrant,
    PushRenew,
    PushRenewReply,
    worker_port,
)

#: the transfer-engine host of the P ranks these tests play by hand: no connection of this
#: process's engine comes from there, so D's fence of their failed pushes (layerwise.fence)
#: shuts down none of the connections the real P worker of the next test writes over
NOWHERE = "192.0.2.1"
BS = 16      # tokens per block
NB = 12      # blocks per cache
HEADS = 4    # total KV heads
HD = 8       # head size
LAYERS = 3


def vllm_config(role: str, kv_port: int, tp_size: int, *, block_size: int = BS,
                model: str = "tiny", heads: int = HEADS) -> Any:
    return pd_vllm_config(role, kv_port, block_size=block_size, heads=heads,
                          model=f"/models/{model}", tp_size=tp_size)


def make_caches(layout: str, tp_size: int, tp_rank: int, *, fill: bool,
                block_size: int = BS) -> dict[str, Any]:
    return layout_caches(layout, tp_size, tp_rank, fill=fill, layers=LAYERS, blocks=NB,
                         heads=HEADS, block_size=block_size, head_size=HD)


def expected_block(caches_p: list[dict[str, Any]], layout: str, p_tp: int, d_tp: int,
                   d_rank: int, layer: str, p_block: int) -> Any:
    """What D rank ``d_rank``'s block must hold after P's block ``p_block`` was pushed."""
    return harness.expected_block(caches_p, layout, p_tp, d_tp, d_rank, layer, p_block,
                                  heads=HEADS)


def new_worker(role: str, kv_port: int, tp_size: int, tp_rank: int, engine: str,
               cfg: dict[str, Any] | None = None, **kw: Any) -> LayerwiseWorker:
    conf = MooncakeLayerwiseConfig.from_dict(cfg or {})
    return LayerwiseWorker(vllm_config(role, kv_port, tp_size, **kw), conf, engine,
                           MetricsRecorder(P2P_METRICS), tp_rank=tp_rank, pp_rank=0)


def p_step(workers: list[LayerwiseWorker], caches: list[dict[str, Any]],
           pushes: dict[str, PushReq], *, hook_layers: bool = True,
           finished: set[str] | None = None) -> list[set[str]]:
    """One P engine step on every rank; returns each rank's finished_sending."""
    meta = MooncakeLayerwiseConnectorMetadata(pushes=pushes)
    sent = []
    for w, c in zip(workers, caches, strict=True):
        if hook_layers:
            for name, kv in c.items():
                w.save_kv_layer(meta, name, kv if isinstance(kv, torch.Tensor) else kv[0])
        w.wait_for_save(meta)
        sending, _r = w.get_finished(finished or set())
        sent.append(sending or set())
        w.start_load_kv(meta)  # runs after the forward in vLLM: must be harmless
    return sent


def wait_recv(worker: LayerwiseWorker, rid: str, timeout: float = 30.0) -> set[int]:
    """Poll get_finished until ``rid`` ends; returns the failed block ids."""
    deadline = time.monotonic() + timeout
    failed: set[int] = set()
    while time.monotonic() < deadline:
        _s, recving = worker.get_finished(set())
        failed |= worker.get_block_ids_with_load_errors()
        if recving and rid in recving:
            return failed
        time.sleep(0.01)
    raise AssertionError(f"{rid} did not finish within {timeout}s")


def target(d_port: int, d_rid: str, d_blocks: list[int], *, cached: int = 0,
           d_tp: int = 1) -> PushTarget:
    return PushTarget(engine_id="D", host="127.0.0.1", port=d_port, request_id=d_rid,
                      block_ids=d_blocks, cached_tokens=cached, tp_size=d_tp)


def d_expect(d: LayerwiseWorker, rid: str, blocks: list[int], cached: int = 0,
             **kw: Any) -> None:
    d.start_load_kv(MooncakeLayerwiseConnectorMetadata(
        requests={rid: RecvReq(rid, blocks, cached, **kw)}))


@pytest.mark.parametrize(("layout", "p_tp", "d_tp"), [
    ("cpu", 1, 1), ("cpu", 2, 1), ("cpu", 1, 2), ("cpu", 4, 2),
    ("npu", 1, 1), ("npu", 2, 1), ("npu", 1, 2), ("npu", 4, 2), ("npu", 2, 4),
    ("mla", 2, 1), ("mla", 1, 2),
])
def test_chunked_push_moves_the_right_bytes(layout: str, p_tp: int, d_tp: int) -> None:
    p_port, d_port = free_port(), free_port()
    p_workers = [new_worker("kv_producer", p_port, p_tp, r, "P") for r in range(p_tp)]
    d_workers = [new_worker("kv_consumer", d_port, d_tp, r, "D") for r in range(d_tp)]
    caches_p = [make_caches(layout, p_tp, r, fill=True) for r in range(p_tp)]
    caches_d = [make_caches(layout, d_tp, r, fill=False) for r in range(d_tp)]
    try:
        for w, c in zip(p_workers + d_workers, caches_p + caches_d, strict=True):
            w.register_kv_caches(c)
        p_blocks, d_blocks = [7, 2, 9, 4], [1, 5, 6, 3]   # a 60-token prompt, 4 blocks
        for w in d_workers:
            d_expect(w, "req-d", d_blocks)
        tgt = target(d_port, "req-d", d_blocks, d_tp=d_tp)
        # chunk 1 computes tokens [0, 40): blocks 0..2 (block 2 partly); chunk 2 the rest
        sent = p_step(p_workers, caches_p, {"req-p": PushReq("req-p", tgt, [0, 1, 2],
                                                             p_blocks[:3])})
        assert sent == [set()] * p_tp
        for w in d_workers:  # not complete before the last chunk
            _s, recving = w.get_finished(set())
            assert not recving
        p_step(p_workers, caches_p, {"req-p": PushReq("req-p", tgt, [2, 3], p_blocks[2:],
                                                      last=True)})
        for w in d_workers:
            assert wait_recv(w, "req-d") == set()
        for d_rank, cache in enumerate(caches_d):
            for name, value in cache.items():
                for lb, pb in zip(d_blocks, p_blocks, strict=True):
                    want = expected_block(caches_p, layout, p_tp, d_tp, d_rank, name, pb)
                    if layout == "cpu":
                        torch.testing.assert_close(value[lb], want, rtol=0, atol=0)
                    else:
                        torch.testing.assert_close(value[0][lb], want[0], rtol=0, atol=0)
                        torch.testing.assert_close(value[1][lb], want[1], rtol=0, atol=0)
                untouched = value if layout == "cpu" else value[0]
                assert untouched[0].abs().sum() == 0  # blocks not pushed stay untouched
        # P frees the request's blocks once vLLM finished it and no push reads them
        assert p_step(p_workers, caches_p, {}, finished={"req-p"}) == [{"req-p"}] * p_tp
        assert p_step(p_workers, caches_p, {}, finished=set()) == [set()] * p_tp
        for w in d_workers:
            assert w.recorder.total("p2p_requests_loaded") == 1
            assert w.recorder.take()["histograms"]["p2p_transfer_request_bytes"][0] > 0
        assert sum(w.recorder.total("p2p_transfer_bytes") for w in p_workers) > 0
        # every (P rank, D rank) pair of the head plan sent exactly one Done
        pairs = sum(len({s.remote_rank for s in plan_head_slices(HEADS, p_tp, d_tp, d,
                                                                  is_mla=layout == "mla")})
                    for d in range(d_tp))
        assert sum(w.recorder.total("p2p_requests_served") for w in p_workers) == pairs
    finally:
        for w in p_workers + d_workers:
            w.shutdown()


@pytest.fixture
def pd(monkeypatch: pytest.MonkeyPatch) -> Any:
    p_port, d_port = free_port(), free_port()
    p = new_worker("kv_producer", p_port, 1, 0, "P", {"lease_ttl_s": 2.5,
                                                       "handshake_timeout_s": 2.0,
                                                       "push_retry": {"deadline_s": 0.5}})
    d = new_worker("kv_consumer", d_port, 1, 0, "D", {"load_timeout_s": 5.0, "lease_ttl_s": 2.5})
    cp = make_caches("cpu", 1, 0, fill=True)
    p.register_kv_caches(cp)
    d.register_kv_caches(make_caches("cpu", 1, 0, fill=False))
    yield SimpleNamespace(p=p, d=d, cp=cp, d_port=d_port)
    p.shutdown()
    d.shutdown()


def test_d_prefix_hit_is_not_overwritten_and_save_hook_is_optional(pd: Any) -> None:
    """D already holds block 0 (cached_tokens=16): P pushes from block 1 on; a step whose
    save_kv_layer hook never ran still pushes every layer from wait_for_save."""
    cd = pd.d.layout.layers[0].regions[0].tensor
    cd[4].fill_(-7.0)
    d_expect(pd.d, "r", [4, 5, 6], cached=BS)
    tgt = target(pd.d_port, "r", [4, 5, 6], cached=BS)
    p_step([pd.p], [pd.cp], {"r": PushReq("r", tgt, [1, 2], [8, 9], last=True)},
           hook_layers=False)
    assert wait_recv(pd.d, "r") == set()
    assert bool((cd[4] == -7.0).all())
    for i in range(LAYERS):
        torch.testing.assert_close(pd.d.layout.layers[i].regions[0].tensor[5],
                                   pd.cp[layer_name(i)][8], rtol=0, atol=0)
    assert len(pd.p.recorder.take()["histograms"]["p2p_layer_transfer_seconds"]) == LAYERS
    assert (pd.p.hooked_layer_pushes, pd.p.fallback_layer_pushes) == (0, LAYERS)


def test_virtual_requests_finish_at_once_beside_ordinary_ones(pd: Any) -> None:
    meta = MooncakeLayerwiseConnectorMetadata()
    v = meta.add_new_req("v", [1, 2], {"do_remote_prefill": True, "do_virtual": True})
    o = meta.add_new_req("o", [3], {"do_remote_prefill": True, "do_virtual": False})
    n = meta.add_new_req("n", [7], None)          # None params: an ordinary request
    m = meta.add_new_req("m", [8], {})            # no do_virtual: ordinary
    assert (v.do_virtual, o.do_virtual, n.do_virtual, m.do_virtual) == (True, False, False, False)
    assert v.error is o.error is n.error is m.error is None
    pd.d.start_load_kv(meta)
    assert pd.d.virtual_request == {"v"}
    _s, recving = pd.d.get_finished(set())
    assert recving == {"v"} and pd.d.virtual_request == set()
    assert pd.d.get_finished(set()) == (None, None)  # reported once; others still wait
    assert pd.d.recorder.total("p2p_virtual_requests") == 1
    assert pd.d.recorder.total("p2p_transfer_bytes") == 0
    assert set(pd.d.receiver.incoming) == {"o", "n", "m"}
    bad = MooncakeLayerwiseConnectorMetadata().add_new_req("b", [1], {"do_virtual": "yes"})
    assert bad.do_virtual is False and "'do_virtual' must be true or false" in (bad.error or "")


def test_completion_counts_every_sender(monkeypatch: pytest.MonkeyPatch) -> None:
    """D rank of TP 1 fed by two P ranks: done only after both P ranks said so."""
    d_port, p_port = free_port(), free_port()
    d = new_worker("kv_consumer", d_port, 1, 0, "D", {"load_timeout_s": 10.0})
    ps = [new_worker("kv_producer", p_port, 2, r, "P") for r in range(2)]
    caches = [make_caches("cpu", 2, r, fill=True) for r in range(2)]
    try:
        d.register_kv_caches(make_caches("cpu", 1, 0, fill=False))
        for w, c in zip(ps, caches, strict=True):
            w.register_kv_caches(c)
        d_expect(d, "r", [2, 3])
        tgt = target(d_port, "r", [2, 3])
        push = {"r": PushReq("r", tgt, [0, 1], [5, 6], last=True)}
        p_step(ps[:1], caches[:1], push)
        time.sleep(0.2)
        assert d.get_finished(set()) == (None, None)  # 1 of 2 senders
        assert d.receiver.incoming["r"].expected == {0, 1}
        p_step(ps[1:], caches[1:], push)
        assert wait_recv(d, "r") == set()
    finally:
        for w in [d, *ps]:
            w.shutdown()


def test_p_failure_ends_the_wait_at_once(pd: Any) -> None:
    """A sender that reports a failure (the count can never be reached) ends D's wait now."""
    d_expect(pd.d, "r", [1, 2])
    client = RpcClient(tcp_endpoint("127.0.0.1", worker_port(pd.d_port, tp_rank=0, tp_size=1)),
                       LAYERWISE_CODEC)
    start = time.monotonic()
    ack = client.call(PushDone(request_id="r", sender="P/tp0", success=False,
                               reason="metaserver post failed"))
    assert isinstance(ack, PushDoneAck) and ack.accepted
    assert wait_recv(pd.d, "r") == {1, 2}
    assert time.monotonic() - start < 1.0
    assert pd.d.recorder.total("p2p_failures", cause="p_failed") == 1
    ack = client.call(PushDone(request_id="r", sender="P/tp0", success=True))
    assert isinstance(ack, PushDoneAck) and not ack.accepted  # late: ignored
    client.close()


def test_scheduler_abort_notice_fails_d(pd: Any) -> None:
    d_expect(pd.d, "r", [1, 2])
    tgt = target(pd.d_port, "r", [1, 2])
    p_step([pd.p], [pd.cp], {"r": PushReq("r", tgt, abort="ended on P before any push")})
    assert wait_recv(pd.d, "r") == {1, 2}
    assert pd.p.sender.sessions == {}  # an abort notice is not a held request


def test_request_finished_early_on_p_tells_d(pd: Any) -> None:
    """P finished the request before its last chunk (aborted): D must not wait for it."""
    d_expect(pd.d, "r", [1, 2, 3])
    tgt = target(pd.d_port, "r", [1, 2, 3])
    p_step([pd.p], [pd.cp], {"r": PushReq("r", tgt, [0], [4])})
    assert p_step([pd.p], [pd.cp], {}, finished={"r"}) == [{"r"}]
    assert wait_recv(pd.d, "r") == {1, 2, 3}


def test_d_refuses_blocks_it_does_not_hold_for_that_request(pd: Any) -> None:
    d_expect(pd.d, "r", [1, 2])
    client = RpcClient(tcp_endpoint("127.0.0.1", worker_port(pd.d_port, tp_rank=0, tp_size=1)),
                       LAYERWISE_CODEC)
    begin = PushBegin(request_id="r", sender="x/tp0", p_rank=0, p_tp_size=1, block_ids=[1, 9],
                      block_lens=[r.block_len for r in pd.d.layout.regions])
    with pytest.raises(RemoteError) as err:
        client.call(begin)
    assert err.value.code == "bad_blocks"
    with pytest.raises(RemoteError) as err:
        client.call(PushBegin(request_id="nope", sender="x/tp0", p_rank=0, p_tp_size=1,
                              block_ids=[1], block_lens=begin.block_lens))
    assert err.value.code == "unknown_request"
    with pytest.raises(RemoteError) as err:
        # 8 P ranks for 4 heads: ranks 2k and 2k+1 hold the same head, D reads the even ones
        client.call(PushBegin(request_id="r", sender="x/tp3", p_rank=3, p_tp_size=8,
                              block_ids=[1, 2], block_lens=begin.block_lens))
    assert err.value.code == "not_a_sender"
    client.close()


def test_p_that_dies_after_beginning_fails_d_before_the_deadline(pd: Any) -> None:
    d_expect(pd.d, "r", [1, 2])
    client = RpcClient(tcp_endpoint("127.0.0.1", worker_port(pd.d_port, tp_rank=0, tp_size=1)),
                       LAYERWISE_CODEC)
    grant = client.call(PushBegin(request_id="r", sender="ghost/tp0", p_rank=0, p_tp_size=1,
                                  te_host=NOWHERE,
                                  block_ids=[1, 2],
                                  block_lens=[r.block_len for r in pd.d.layout.regions]))
    assert isinstance(grant, PushGrant) and grant.lease_s == 2.5 and grant.num_senders == 1
    start = time.monotonic()
    # the ghost renews once, then dies
    assert client.call(PushRenew(request_ids=["r", "x"], sender="ghost/tp0")) == PushRenewReply(
        granted=["r"])
    assert wait_recv(pd.d, "r") == {1, 2}
    assert 2.3 < time.monotonic() - start < 4.5  # lease (2.5 s), before the 5 s deadline
    assert pd.d.recorder.total("p2p_failures", cause="peer_lost") == 1
    client.close()


def test_deadline_waits_for_active_writers_and_revokes_their_lease(pd: Any) -> None:
    """At the deadline a writer still holds a lease: D stops renewing it and reports the
    failure only when that writer can no longer write (Done or lease lapse)."""
    d = new_worker("kv_consumer", free_port(), 1, 0, "D2", {"load_timeout_s": 0.3,
                                                           "lease_ttl_s": 5.0})
    d.register_kv_caches(make_caches("cpu", 1, 0, fill=False))
    try:
        d_expect(d, "r", [1])
        client = RpcClient(tcp_endpoint("127.0.0.1", d.port), LAYERWISE_CODEC)
        grant = client.call(PushBegin(request_id="r", sender="slow/tp0", p_rank=0, p_tp_size=1,
                                      te_host=NOWHERE, block_ids=[1],
                                      block_lens=[r.block_len for r in d.layout.regions]))
        assert isinstance(grant, PushGrant)
        time.sleep(0.5)
        assert d.get_finished(set()) == (None, None)  # past the deadline, but a lease is held
        assert d.recorder.total("p2p_load_deadlines") == 1
        reply = client.call(PushRenew(request_ids=["r"], sender="slow/tp0"))
        assert reply == PushRenewReply(granted=[])  # revoked
        client.call(PushDone(request_id="r", sender="slow/tp0", success=False,
                             reason="revoked"))
        assert wait_recv(d, "r", timeout=2.0) == {1}
        assert d.recorder.total("p2p_failures", cause="deadline") == 1
        client.close()
    finally:
        d.shutdown()


def test_deadline_without_any_p_fails_exactly_once(pd: Any) -> None:
    d = new_worker("kv_consumer", free_port(), 1, 0, "D3", {"load_timeout_s": 0.4})
    d.register_kv_caches(make_caches("cpu", 1, 0, fill=False))
    try:
        d_expect(d, "r", [3, 4])
        start = time.monotonic()
        assert wait_recv(d, "r") == {3, 4}
        assert 0.35 < time.monotonic() - start < 1.5
        time.sleep(0.2)
        assert d.get_finished(set()) == (None, None)
        assert d.get_block_ids_with_load_errors() == set()
    finally:
        d.shutdown()


def test_aborted_d_request_ends_without_waiting_for_the_deadline(pd: Any) -> None:
    d_expect(pd.d, "r", [1])
    _s, recving = pd.d.get_finished({"r"})  # vLLM finished (aborted) it while waiting
    assert recving == {"r"}
    assert pd.d.get_block_ids_with_load_errors() == set()  # nothing left to recompute
    assert pd.d.recorder.total("p2p_failures", cause="aborted") == 1


def test_push_to_a_dead_d_stops_and_frees(pd: Any) -> None:
    dead = free_port()  # nothing listens there
    tgt = target(dead, "r", [1, 2])
    start = time.monotonic()
    p_step([pd.p], [pd.cp], {"r": PushReq("r", tgt, [0, 1], [3, 4], last=True)})
    assert time.monotonic() - start < 5.0  # one handshake timeout, not one per layer
    assert pd.p.recorder.total("p2p_failures", cause="peer_timeout") == 1
    assert pd.p.recorder.gauge("p2p_held_requests") == 1  # vLLM has not finished it yet
    assert p_step([pd.p], [pd.cp], {}, finished={"r"}) == [{"r"}]
    assert pd.p.sender.sessions == {}
    assert pd.p.recorder.gauge("p2p_held_requests") == 0


def test_p_retries_until_d_knows_the_request(pd: Any) -> None:
    """P can begin before D's worker got the step that registers the request."""
    tgt = target(pd.d_port, "late", [5, 6])
    meta = MooncakeLayerwiseConnectorMetadata(pushes={"p": PushReq("p", tgt, [0, 1], [1, 2],
                                                                   last=True)})
    import threading

    t = threading.Thread(target=lambda: (time.sleep(0.25), d_expect(pd.d, "late", [5, 6])))
    t.start()
    for name, kv in pd.cp.items():
        pd.p.save_kv_layer(meta, name, kv)
    pd.p.wait_for_save(meta)
    t.join()
    assert wait_recv(pd.d, "late") == set()
    torch.testing.assert_close(pd.d.layout.layers[1].regions[0].tensor[6],
                               pd.cp[layer_name(1)][2], rtol=0, atol=0)


@pytest.mark.parametrize(("change", "needle"), [
    ({"block_size": 32}, "block size: P has 16, D has 32"),
    ({"model": "other"}, "model: P has 'tiny', D has 'other'"),
])
def test_handshake_mismatch_is_a_clear_error_on_both_sides(pd: Any, change: dict[str, Any],
                                                           needle: str) -> None:
    port = free_port()
    d = new_worker("kv_consumer", port, 1, 0, "D4", {"load_timeout_s": 5.0}, **change)
    bs = change.get("block_size", BS)
    d.register_kv_caches(make_caches("cpu", 1, 0, fill=False, block_size=bs))
    try:
        d_expect(d, "m", [2])
        p_step([pd.p], [pd.cp], {"m": PushReq("m", target(port, "m", [2]), [0], [1],
                                              last=True)})
        assert wait_recv(d, "m") == {2}  # P told D at once
        assert pd.p.recorder.total("p2p_failures", cause="handshake_mismatch") == 1
        problem = next(iter(pd.p._mismatch.values()))
        assert needle in problem and "D engine D4" in problem
    finally:
        d.shutdown()


def test_garbage_on_the_side_channel_does_not_stop_d(pd: Any) -> None:
    import socket

    for junk in (b"\x00" * 100, b"GET / HTTP/1.0\r\n\r\n", bytes(range(256))):
        with socket.create_connection(("127.0.0.1", pd.d.port), timeout=2) as s:
            s.sendall(junk)
    d_expect(pd.d, "ok", [3])
    p_step([pd.p], [pd.cp], {"ok": PushReq("ok", target(pd.d_port, "ok", [3]), [0], [5],
                                           last=True)})
    assert wait_recv(pd.d, "ok") == set()


def test_shutdown_releases_registered_memory(pd: Any) -> None:
    te = pd.p.te
    before = te.registered_bytes
    w = new_worker("kv_consumer", free_port(), 1, 0, "D5")
    w.register_kv_caches(make_caches("cpu", 1, 0, fill=False))
    assert te.registered_bytes > before
    w.shutdown()
    assert te.registered_bytes == before


def test_failed_metaserver_post_fails_the_request_at_once(pd: Any) -> None:
    d_expect(pd.d, "r", [2, 3])
    pd.d.start_load_kv(MooncakeLayerwiseConnectorMetadata(
        failed_posts={"r": "POST http://proxy/v1/metaserver failed: HTTP 404"}))
    _s, recving = pd.d.get_finished(set())
    assert recving == {"r"} and pd.d.get_block_ids_with_load_errors() == {2, 3}
    assert pd.d.recorder.total("p2p_failed_posts") == 1
    assert pd.d.recorder.total("p2p_failures", cause="metaserver") == 1


def test_layers_queued_behind_a_write_go_out_in_one_batch(pd: Any) -> None:
    """Layers computed faster than the link moves them are merged into one write per D rank
    (one transfer-engine round instead of one per layer), with every byte in place and the
    per-layer metrics still one sample per layer."""
    import threading

    gate = threading.Event()
    calls: list[int] = []
    real_write = pd.p.te.write

    def write(session: str, src: list[int], dst: list[int], lengths: list[int]) -> int:
        calls.append(len(lengths))
        gate.wait(10)  # the first layer's write stalls until every layer is queued
        return real_write(session, src, dst, lengths)

    pd.p.te.write = write
    try:
        d_expect(pd.d, "m", [4, 5])
        tgt = target(pd.d_port, "m", [4, 5])
        meta = MooncakeLayerwiseConnectorMetadata(pushes={"m": PushReq("m", tgt, [0, 1], [8, 9],
                                                                       last=True)})
        for name, kv in pd.cp.items():
            pd.p.save_kv_layer(meta, name, kv)
        gate.set()
        pd.p.wait_for_save(meta)
    finally:
        pd.p.te.write = real_write
    assert wait_recv(pd.d, "m") == set()
    # every layer's 2 blocks went out, in fewer writes than layers (the layers queued while
    # the sender opened the link or wrote the first one were merged)
    assert sum(calls) == 2 * LAYERS and len(calls) < LAYERS, calls
    for i in range(LAYERS):
        for pb, db in ((8, 4), (9, 5)):
            torch.testing.assert_close(pd.d.layout.layers[i].regions[0].tensor[db],
                                       pd.cp[layer_name(i)][pb], rtol=0, atol=0)
    assert len(pd.p.recorder.take()["histograms"]["p2p_layer_transfer_seconds"]) == LAYERS


def test_a_renewal_sent_while_d_was_held_up_keeps_the_sender(
        pd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """D's side channel did not run for longer than the write lease (D starved of CPU)
    while P's renewal waited in its socket: D does not count P as gone (``peer_lost``);
    the renewal is answered once D runs, and the request ends at its deadline instead."""
    from vllm_ascend.distributed.kv_transfer.core import channel

    monkeypatch.setattr(channel, "STALL_S", 0.3)
    d_expect(pd.d, "r", [1, 2])
    endpoint = tcp_endpoint("127.0.0.1", worker_port(pd.d_port, tp_rank=0, tp_size=1))
    client = RpcClient(endpoint, LAYERWISE_CODEC, timeout_s=15)
    grant = client.call(PushBegin(request_id="r", sender="slow/tp0", p_rank=0, p_tp_size=1,
                                  te_host=NOWHERE,
                                  block_ids=[1, 2],
                                  block_lens=[r.block_len for r in pd.d.layout.regions]))
    assert isinstance(grant, PushGrant) and grant.lease_s == 2.5
    start = time.monotonic()
    server = pd.d.receiver.server
    handle, stalled, release = server.handler, threading.Event(), threading.Event()

    def held_up(msg: Any) -> Any:
        if isinstance(msg, PushRenew) and not stalled.is_set():
            stalled.set()
            release.wait(10)
        return handle(msg)

    server.handler = held_up
    replies: list[Any] = []
    renewal = threading.Thread(target=lambda: replies.append(
        client.call(PushRenew(request_ids=["r"], sender="slow/tp0"))))
    renewal.start()
    assert stalled.wait(5)
    while time.monotonic() < start + 3.2:  # past the 2.5 s lease, before the 5 s deadline
        assert not pd.d.get_finished(set())[1], "P counted as gone while D was held up"
        time.sleep(0.05)
    release.set()
    renewal.join(10)
    assert replies == [PushRenewReply(granted=["r"])]
    assert wait_recv(pd.d, "r") == {1, 2}
    assert time.monotonic() - start > 4.5  # ended by the deadline, not by a lapsed lease
    assert pd.d.recorder.total("p2p_failures", cause="peer_lost") == 0
    assert pd.d.recorder.total("p2p_load_deadlines") == 1
    client.close()


def test_an_idle_step_waits_for_the_push_to_end_and_only_then(pd: Any) -> None:
    """On a step that runs no token D waits for a request to end instead of spinning:
    woken by P's Done; at once when no request waits."""
    d = pd.d
    assert d.receiver.wait_any(30) is True  # no request waits: at once
    d_expect(d, "r", [1, 2])
    assert d.receiver.wait_any(0.05) is False  # nothing came
    woken: list[bool] = []
    waiter = threading.Thread(target=lambda: woken.append(d.receiver.wait_any(30)))
    waiter.start()
    client = RpcClient(tcp_endpoint("127.0.0.1", worker_port(pd.d_port, tp_rank=0, tp_size=1)),
                       LAYERWISE_CODEC)
    try:
        ack = client.call(PushDone(request_id="r", sender="P/tp0", success=False,
                                   reason="gave up"))
        assert isinstance(ack, PushDoneAck) and ack.accepted
        waiter.join(30)
        assert woken == [True]  # by the Done, not by the timeout
        assert d.get_finished(set(), idle=True) == (None, {"r"})
        assert d.get_block_ids_with_load_errors() == {1, 2}
    finally:
        client.close()
