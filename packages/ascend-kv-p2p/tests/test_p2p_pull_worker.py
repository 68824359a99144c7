# SPDX-License-Identifier: Apache-2.0
"""Worker-side logic of MooncakeConnectorV1, P and D workers in one process.

KV caches are plain CPU tensors in each supported layout; bytes move through the
real Mooncake transfer engine over TCP on loopback. vLLM's parallel state is not
needed: TP ranks are given to the workers directly. Every test runs with D's claims
overlapped with its read and with the claims sent first (the default depends on the
machine's CPUs).
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from p2p_worker_harness import expected_block, layout_caches, pd_vllm_config, set_retry

from vllm_ascend.distributed.kv_transfer.core.channel import RpcServer, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.params import RemotePrefill
from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import CODEC, worker_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull import holder as pull_holder
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull import loads as pull_loads
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull import reader as pull_reader
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import (
    MooncakeConnectorMetadata,
    RecvMeta,
    SendMeta,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.worker import PullWorker


@pytest.fixture(autouse=True, params=["overlapped", "claims_first"])
def claim_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """D workers made in the test overlap their claims with the read, or claim first."""
    monkeypatch.setattr(pull_reader, "OVERLAP_MIN_CPUS",
                        0 if request.param == "overlapped" else 1 << 30)
    return str(request.param)


BS = 16      # tokens per block
NB = 12      # blocks per cache
HEADS = 4    # total KV heads
HD = 8       # head size
LAYERS = 2


def vllm_config(role: str, kv_port: int, tp_size: int, *, block_size: int = BS,
                model: str = "tiny", heads: int = HEADS) -> Any:
    return pd_vllm_config(role, kv_port, block_size=block_size, heads=heads,
                          model=f"/models/{model}", tp_size=tp_size)


def make_caches(layout: str, tp_size: int, tp_rank: int, *, fill: bool,
                dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    return layout_caches(layout, tp_size, tp_rank, fill=fill, layers=LAYERS, blocks=NB,
                         heads=HEADS, block_size=BS, head_size=HD, dtype=dtype)


def expected_d_block(caches_p: list[dict[str, Any]], layout: str, p_tp: int, d_tp: int,
                     d_rank: int, layer: str, p_block: int) -> Any:
    """What D rank ``d_rank``'s block must hold after pulling P's block ``p_block``."""
    return expected_block(caches_p, layout, p_tp, d_tp, d_rank, layer, p_block, heads=HEADS)


def new_worker(role: str, kv_port: int, tp_size: int, tp_rank: int, engine: str,
               cfg: dict[str, Any] | None = None, **kw: Any) -> PullWorker:
    conf = MooncakeP2PConfig.from_dict(cfg or {})
    return PullWorker(vllm_config(role, kv_port, tp_size, **kw), conf, engine,
                      MetricsRecorder(P2P_METRICS), tp_rank=tp_rank, pp_rank=0)


def wait_recv(worker: PullWorker, rid: str, timeout: float = 30.0) -> set[int]:
    """Poll get_finished until ``rid`` ends; returns the failed block ids."""
    deadline = time.monotonic() + timeout
    failed: set[int] = set()
    while time.monotonic() < deadline:
        _s, recving = worker.get_finished()
        failed |= worker.get_block_ids_with_load_errors()
        if recving and rid in recving:
            return failed
        time.sleep(0.01)
    raise AssertionError(f"{rid} did not finish within {timeout}s")


def wait_sent(workers: list[PullWorker], rid: str, timeout: float = 10.0) -> None:
    for w in workers:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sending, _r = w.get_finished()
            if sending and rid in sending:
                break
            time.sleep(0.01)
        else:
            raise AssertionError(f"P rank {w.tp_rank} never released {rid}")


@pytest.mark.parametrize(("layout", "p_tp", "d_tp"), [
    ("cpu", 1, 1), ("cpu", 2, 1), ("cpu", 1, 2), ("cpu", 4, 2),
    ("npu", 1, 1), ("npu", 2, 1), ("npu", 1, 2), ("npu", 4, 2),
    ("mla", 2, 1), ("mla", 1, 2),
])
def test_pull_moves_the_right_bytes(layout: str, p_tp: int, d_tp: int) -> None:
    p_port, d_port = free_port(), free_port()
    p_workers = [new_worker("kv_producer", p_port, p_tp, r, "P") for r in range(p_tp)]
    d_workers = [new_worker("kv_consumer", d_port, d_tp, r, "D") for r in range(d_tp)]
    caches_p = [make_caches(layout, p_tp, r, fill=True) for r in range(p_tp)]
    caches_d = [make_caches(layout, d_tp, r, fill=False) for r in range(d_tp)]
    try:
        for w, c in zip(p_workers, caches_p, strict=True):
            w.register_kv_caches(c)
        for w, c in zip(d_workers, caches_d, strict=True):
            w.register_kv_caches(c)
        p_blocks, d_blocks = [7, 2, 9], [1, 4, 5]
        send = MooncakeConnectorMetadata(requests_to_send={"req-p": SendMeta("req-p", p_blocks)})
        for w in p_workers:
            w.start_load_kv(send)
        remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=p_port, request_id="req-p",
                               block_ids=p_blocks, tp_size=p_tp, pcp_size=1, dcp_size=1)
        for w in d_workers:
            w.start_load_kv(MooncakeConnectorMetadata(requests={"req-d": RecvMeta(
                "req-d", d_blocks, remote, remote_block_ids=p_blocks)}))
        for w in d_workers:
            assert wait_recv(w, "req-d") == set()
        wait_sent(p_workers, "req-p")  # every P rank frees after all its readers' Done
        for d_rank, cache in enumerate(caches_d):
            for layer, value in cache.items():
                for lb, pb in zip(d_blocks, p_blocks, strict=True):
                    want = expected_d_block(caches_p, layout, p_tp, d_tp, d_rank, layer, pb)
                    if layout == "cpu":
                        torch.testing.assert_close(value[lb], want, rtol=0, atol=0)
                    else:
                        torch.testing.assert_close(value[0][lb], want[0], rtol=0, atol=0)
                        torch.testing.assert_close(value[1][lb], want[1], rtol=0, atol=0)
                # blocks not pulled stay untouched
                untouched = value if layout == "cpu" else value[0]
                assert untouched[0].abs().sum() == 0
        for w in d_workers:
            assert w.recorder.total("p2p_requests_loaded") == 1
            assert w.recorder.total("p2p_transfer_bytes") > 0
        assert sum(w.recorder.total("p2p_requests_served") for w in p_workers) == p_tp
    finally:
        for w in p_workers + d_workers:
            w.shutdown()


@pytest.fixture
def pd(monkeypatch: pytest.MonkeyPatch) -> Any:
    p_port, d_port = free_port(), free_port()
    p = new_worker("kv_producer", p_port, 1, 0, "P", {"lease_ttl_s": 1.0})
    d = new_worker("kv_consumer", d_port, 1, 0, "D", {"load_timeout_s": 5.0,
                                                         "handshake_timeout_s": 2.0,
                                                         "claim_retry": {"deadline_s": 0.5}})
    p.register_kv_caches(make_caches("cpu", 1, 0, fill=True))
    d.register_kv_caches(make_caches("cpu", 1, 0, fill=False))
    yield SimpleNamespace(p=p, d=d, p_port=p_port)
    p.shutdown()
    d.shutdown()


def recv(pd: Any, rid: str, remote_rid: str, remote_blocks: list[int], local: list[int],
         port: int | None = None) -> RecvMeta:
    remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=port or pd.p_port,
                           request_id=remote_rid, block_ids=remote_blocks, tp_size=1, pcp_size=1,
                           dcp_size=1)
    meta = RecvMeta(rid, local, remote, remote_block_ids=remote_blocks)
    pd.d.start_load_kv(MooncakeConnectorMetadata(requests={rid: meta}))
    return meta


def test_unknown_request_fails_and_reports_blocks(pd: Any) -> None:
    recv(pd, "d1", "never-had", [1, 2], [3, 4])
    assert wait_recv(pd.d, "d1") == {3, 4}
    assert pd.d.recorder.total("p2p_failures", cause="unknown_request") == 1


def test_blocks_p_does_not_hold_for_that_request_are_refused(pd: Any) -> None:
    pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"r": SendMeta("r", [1, 2])}))
    recv(pd, "d2", "r", [1, 3], [5, 6])  # block 3 belongs to someone else
    assert wait_recv(pd.d, "d2") == {5, 6}
    assert pd.d.recorder.total("p2p_failures", cause="bad_blocks") == 1
    # P still holds the request for a correct reader; then frees it after that read
    recv(pd, "d3", "r", [1, 2], [5, 6])
    assert wait_recv(pd.d, "d3") == set()
    wait_sent([pd.p], "r")


@pytest.mark.parametrize(("asked", "why"), [
    ([2, 1, 3], "its own blocks reordered"),
    ([1, 1, 3], "a block repeated"),
    ([1, 2], "a middle slice, not the suffix after D's prefix"),
    ([3, 2], "the suffix reversed"),
])
def test_the_request_own_blocks_in_the_wrong_order_are_refused(pd: Any, asked: list[int],
                                                                why: str) -> None:
    """Well-formed params naming only blocks P holds for the request, but not as the suffix
    of its list in order, would land KV at the wrong token positions: refused, never read."""
    pd.p.start_load_kv(MooncakeConnectorMetadata(
        requests_to_send={"r": SendMeta("r", [1, 2, 3])}))
    local = [5, 6, 7][: len(asked)]
    recv(pd, "bad", "r", asked, local)
    assert wait_recv(pd.d, "bad") == set(local), why
    assert pd.d.recorder.total("p2p_failures", cause="bad_blocks") == 1
    # the suffix after a 1-block prefix hit on D is what a correct reader asks for
    recv(pd, "good", "r", [2, 3], [6, 7])
    assert wait_recv(pd.d, "good") == set()
    for layer in range(LAYERS):
        name = f"model.layers.{layer}.self_attn.attn"
        torch.testing.assert_close(pd.d.layout.layers[layer].regions[0].tensor[6:8],
                                   pd.p.layout.layers[layer].regions[0].tensor[2:4],
                                   rtol=0, atol=0, msg=name)
    wait_sent([pd.p], "r")


def test_released_request_cannot_be_read_twice(pd: Any) -> None:
    pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"r": SendMeta("r", [4])}))
    recv(pd, "a", "r", [4], [1])
    assert wait_recv(pd.d, "a") == set()
    # D reports "a" done when its read returned; P frees "r" when D's Done arrives
    wait_sent([pd.p], "r")
    recv(pd, "b", "r", [4], [2])
    assert wait_recv(pd.d, "b") == {2}
    assert pd.d.recorder.total("p2p_failures", cause="released") == 1


def test_lapsed_lease_frees_exactly_once(pd: Any) -> None:
    pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"r": SendMeta("r", [1])}))
    time.sleep(1.2)
    seen = []
    for _ in range(5):
        sending, _r = pd.p.get_finished()
        seen += list(sending or ())
    assert seen == ["r"]
    assert pd.p.recorder.total("p2p_expired_leases") == 1
    recv(pd, "late", "r", [1], [2])  # D comes too late: a clean failure, not stale data
    assert wait_recv(pd.d, "late") == {2}


def test_renewals_keep_a_lease_alive(pd: Any) -> None:
    from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient
    from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import Renew, RenewReply

    pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"r": SendMeta("r", [1])}))
    client = RpcClient(tcp_endpoint("127.0.0.1", worker_port(pd.p_port, tp_rank=0, tp_size=1)),
                       CODEC)
    for _ in range(4):
        time.sleep(0.4)
        reply = client.call(Renew(request_ids=["r", "other"]))
        assert isinstance(reply, RenewReply) and reply.held == ["r"]
        assert not pd.p.get_finished()[0]
    client.close()


def _hold_up_side_channel(pd: Any) -> tuple[threading.Event, Any]:
    """Blocks P's side channel thread (as when P is starved of CPU, or another thread holds
    the GIL) from the first ``GetMeta`` until the returned event is set; and a client."""
    from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient
    from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import GetMeta

    holder = pd.p.holder
    stalled, release = threading.Event(), threading.Event()
    handle = holder.handle

    def held_up(msg: Any) -> Any:
        if isinstance(msg, GetMeta) and not stalled.is_set():
            stalled.set()
            release.wait(10)
        return handle(msg)

    holder.server.handler = held_up
    endpoint = tcp_endpoint("127.0.0.1", worker_port(pd.p_port, tp_rank=0, tp_size=1))
    blocker = RpcClient(endpoint, CODEC, timeout_s=15)
    threading.Thread(target=lambda: blocker.call(GetMeta()), daemon=True).start()
    assert stalled.wait(5)
    return release, RpcClient(endpoint, CODEC, timeout_s=15)


def test_a_renewal_sent_while_p_was_held_up_keeps_the_lease(
        pd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fleet under load: P's side channel did not run for seconds, and P let leases
    lapse that D and the proxy had renewed meanwhile (their Renew still in the socket).
    Now a lease lapses only once the side channel has run steadily and answered them."""
    from vllm_ascend.distributed.kv_transfer.core import channel
    from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import Renew, RenewReply

    monkeypatch.setattr(channel, "STALL_S", 0.3)
    # held up first: the whole lease runs during the stall, however long the set-up took
    release, client = _hold_up_side_channel(pd)
    pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"r": SendMeta("r", [1])}))
    replies: list[Any] = []
    renewal = threading.Thread(target=lambda: replies.append(client.call(Renew(request_ids=["r"]))))
    renewal.start()
    end = time.monotonic() + 1.4  # past the 1 s lease, within a lease of its deadline
    while time.monotonic() < end:
        assert not pd.p.get_finished()[0], "lapsed while the side channel was held up"
        time.sleep(0.05)
    release.set()
    renewal.join(10)
    assert replies and isinstance(replies[0], RenewReply) and replies[0].held == ["r"]
    end = time.monotonic() + 0.7  # the renewal runs a whole lease from when it was answered
    while time.monotonic() < end:
        assert not pd.p.get_finished()[0]
        time.sleep(0.05)
    seen: list[str] = []
    end = time.monotonic() + 3.0  # no renewal since: the lease lapses, once
    while time.monotonic() < end and not seen:
        seen += list(pd.p.get_finished()[0] or ())
        time.sleep(0.05)
    assert seen == ["r"]
    assert pd.p.recorder.total("p2p_expired_leases") == 1
    client.close()


def test_a_side_channel_held_up_for_good_still_frees_the_blocks(
        pd: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease overdue by a whole lease lapses even while the side channel is held up:
    late, never leaked."""
    from vllm_ascend.distributed.kv_transfer.core import channel

    monkeypatch.setattr(channel, "STALL_S", 0.3)
    # held up first: a stall that began only after the lease's deadline (a slow set-up on a
    # busy machine) would let the lease lapse on time, as it should
    release, client = _hold_up_side_channel(pd)
    pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"r": SendMeta("r", [1])}))
    start = time.monotonic()
    seen: list[str] = []
    while time.monotonic() < start + 5 and not seen:
        seen += list(pd.p.get_finished()[0] or ())
        time.sleep(0.05)
    held_for = time.monotonic() - start
    release.set()
    client.close()
    assert seen == ["r"]
    assert 1.9 <= held_for < 3.5  # the deadline (1 s) plus a whole lease, not sooner


def test_dead_p_fails_fast(pd: Any) -> None:
    start = time.monotonic()
    recv(pd, "x", "r", [1], [2], port=free_port())  # nothing listens there
    assert wait_recv(pd.d, "x") == {2}
    assert time.monotonic() - start < 4.0
    assert pd.d.recorder.total("p2p_failures", cause="peer_timeout") == 1


def test_deadline_ends_a_stuck_load_exactly_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A P that never answers: D fails the request at its deadline; the late end is ignored."""
    port = free_port()

    def slow(msg: Any) -> Any:
        time.sleep(2.0)
        raise RuntimeError("too late")

    server = RpcServer(tcp_endpoint("127.0.0.1", port), CODEC, slow, name="slow-p").start()
    d = new_worker("kv_consumer", free_port(), 1, 0, "D", {"load_timeout_s": 0.5,
                                                           "handshake_timeout_s": 5.0})
    d.register_kv_caches(make_caches("cpu", 1, 0, fill=False))
    try:
        remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=port, request_id="r",
                               block_ids=[1], tp_size=1, pcp_size=1, dcp_size=1)
        d.start_load_kv(MooncakeConnectorMetadata(requests={"s": RecvMeta(
            "s", [3], remote, remote_block_ids=[1])}))
        start = time.monotonic()
        assert wait_recv(d, "s") == {3}
        assert 0.4 < time.monotonic() - start < 1.5
        assert d.recorder.total("p2p_load_deadlines") == 1
        time.sleep(2.5)  # the pull thread ends now; nothing more is reported
        assert d.get_finished() == (None, None) and d.get_block_ids_with_load_errors() == set()
    finally:
        server.stop()
        d.shutdown()


@pytest.mark.parametrize(("change", "needle"), [
    ({"block_size": 32}, "block size: D has 32, P has 16"),
    ({"model": "other"}, "model: D has 'other', P has 'tiny'"),
    ({"heads": 8}, "total KV heads: D has 8, P has 4"),
])
def test_handshake_mismatch_is_a_clear_error(pd: Any, change: dict[str, Any],
                                             needle: str) -> None:
    d = new_worker("kv_consumer", free_port(), 1, 0, "D2", {"load_timeout_s": 5.0}, **change)
    bs = change.get("block_size", BS)
    caches = {n: torch.zeros(NB, HEADS, bs, 2 * HD) for n in make_caches("cpu", 1, 0, fill=False)}
    d.register_kv_caches(caches)
    try:
        pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"r": SendMeta("r", [1])}))
        remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=pd.p_port, request_id="r",
                               block_ids=[1], tp_size=1, pcp_size=1, dcp_size=1)
        d.start_load_kv(MooncakeConnectorMetadata(requests={"m": RecvMeta(
            "m", [2], remote, remote_block_ids=[1])}))
        assert wait_recv(d, "m") == {2}
        assert d.recorder.total("p2p_failures", cause="handshake_mismatch") == 1
        problem = next(iter(d._mismatch.values()))
        assert needle in problem and "P engine P" in problem
    finally:
        d.shutdown()


def test_bad_params_fail_at_once_without_contacting_p(pd: Any) -> None:
    meta = RecvMeta("bad", [7, 8], None, error="'remote_port' must be an integer, got 'x'")
    pd.d.start_load_kv(MooncakeConnectorMetadata(requests={"bad": meta}))
    _s, recving = pd.d.get_finished()
    assert recving == {"bad"}
    assert pd.d.get_block_ids_with_load_errors() == {7, 8}


def test_garbage_on_the_side_channel_does_not_stop_p(pd: Any) -> None:
    import socket

    port = worker_port(pd.p_port, tp_rank=0, tp_size=1)
    for junk in (b"\x00" * 100, b"GET / HTTP/1.0\r\n\r\n", bytes(range(256))):
        with socket.create_connection(("127.0.0.1", port), timeout=2) as s:
            s.sendall(junk)
    pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"r": SendMeta("r", [3])}))
    recv(pd, "ok", "r", [3], [4])
    assert wait_recv(pd.d, "ok") == set()


def test_a_read_in_flight_at_the_deadline_keeps_the_blocks_until_it_returns(pd: Any) -> None:
    """The transfer engine cannot cancel a read, and a stalled one can complete late (a
    network that comes back): the blocks go back to vLLM only once the read returned,
    failed at the deadline; a pull still queued at its deadline never reads at all."""
    d = new_worker("kv_consumer", free_port(), 1, 0, "D-slow", {
        "load_timeout_s": 0.5, "handshake_timeout_s": 2.0, "num_recv_workers": 1})
    d.register_kv_caches(make_caches("cpu", 1, 0, fill=False))
    original = d.reader._read
    release = threading.Event()
    reads: list[str] = []

    def stalled(meta: RecvMeta, *args: Any) -> int:
        reads.append(meta.request_id)
        release.wait(10)
        return int(original(meta, *args))

    def load(rid: str, remote_rid: str, remote_block: int, local_block: int) -> None:
        remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=pd.p_port,
                               request_id=remote_rid, block_ids=[remote_block], tp_size=1,
                               pcp_size=1, dcp_size=1)
        d.start_load_kv(MooncakeConnectorMetadata(requests={rid: RecvMeta(
            rid, [local_block], remote, remote_block_ids=[remote_block])}))

    d.reader._read = stalled
    try:
        pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"r": SendMeta("r", [1])}))
        load("slow", "r", 1, 2)
        assert wait_recv_none(d, 1.5)  # deadline passed, read in flight: nothing handed back
        assert reads == ["slow"] and d.recorder.total("p2p_load_deadlines") == 1
        release.set()
        assert wait_recv(d, "slow") == {2}  # failed, once the read returned
        assert d.recorder.total("p2p_failures", cause="deadline") == 1
        wait_sent([pd.p], "r")  # D's Done gave P its blocks back
        # a load whose deadline passed while its pull waited for a thread never reads
        release.clear()
        d.reader._pool.submit(time.sleep, 1.0)  # the only pull thread is busy past the deadline
        pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"q": SendMeta("q", [3])}))
        load("queued", "q", 3, 4)
        assert wait_recv(d, "queued") == {4}
        time.sleep(1.5)  # the thread is free (1 s) and the late pull has run
        assert reads == ["slow"]
        wait_sent([pd.p], "q")  # the late pull released P's blocks without reading
    finally:
        release.set()
        d.shutdown()


def wait_recv_none(worker: PullWorker, seconds: float) -> bool:
    """True when nothing ends on ``worker`` for ``seconds``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        _s, recving = worker.get_finished()
        if recving or worker.get_block_ids_with_load_errors():
            return False
        time.sleep(0.02)
    return True


def test_wait_loads_returns_once_the_load_ended(pd: Any, claim_mode: str) -> None:
    assert pd.d.overlap_claims is (claim_mode == "overlapped")
    pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"r": SendMeta("r", [5])}))
    recv(pd, "w", "r", [5], [6])
    assert pd.d.wait_loads(["w"], timeout=30)
    _s, recving = pd.d.get_finished()
    assert recving == {"w"} and pd.d.get_block_ids_with_load_errors() == set()
    assert pd.d.wait_loads(["w", "never-started"], timeout=0)  # nothing pending: at once
    pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"s": SendMeta("s", [6])}))
    d = pd.d
    reads: list[str] = []
    original = d.reader._read
    release = threading.Event()

    def stalled(meta: RecvMeta, *args: Any) -> int:
        reads.append(meta.request_id)
        release.wait(10)
        return int(original(meta, *args))

    d.reader._read = stalled
    try:
        recv(pd, "held", "s", [6], [7])
        assert not d.wait_loads(["held"], timeout=0.3)  # the read is still in flight
    finally:
        release.set()
    assert d.wait_loads(["held"], timeout=30) and reads == ["held"]
    assert wait_recv(d, "held") == set()


def test_a_read_is_trusted_only_under_a_claim_accepted_at_first_try(
        pd: Any, claim_mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """P answers the first claim "unknown request" (its metadata is late) and accepts a retry.
    With the claims overlapped the read that ran meanwhile is not proof of anything: D must read
    again after the claim was accepted, never report the first read's bytes. Here P's block
    changes between the two (as if it had held another request's KV at the first read)."""

    monkeypatch.setattr(pull_holder, "CLAIM_WAIT_S", 0.0)  # P answers "unknown" at once
    p, d = pd.p, pd.d
    set_retry(d, "claim_retry", deadline_s=5.0)
    refused = threading.Event()
    on_claim = p.holder._on_claim

    def counting(msg: Any) -> Any:
        reply = on_claim(msg)
        if getattr(reply, "code", None) == "unknown_request":
            refused.set()
        return reply

    p.holder._on_claim = counting
    first_read = threading.Event()
    reads: list[str] = []
    original = d.reader._read

    def read(meta: RecvMeta, *args: Any) -> int:
        n = int(original(meta, *args))
        reads.append(meta.request_id)
        first_read.set()
        return n

    d.reader._read = read
    recv(pd, "late", "r", [9], [3])
    assert refused.wait(10)
    if claim_mode == "overlapped":
        assert first_read.wait(10)  # the read ran before any claim was accepted
    else:
        assert not first_read.wait(0.2)  # claims first: no read before the claim is accepted
    new_value = 123.0
    for t in cache_of(p).values():
        t[9] = new_value  # what P holds for the request once it accepts the claim
    p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"r": SendMeta("r", [9])}))
    assert wait_recv(d, "late") == set()
    for t in cache_of(d).values():
        assert bool((t[3] == new_value).all()), "D reported bytes read before the claim"
    assert reads == (["late", "late"] if claim_mode == "overlapped" else ["late"])
    wait_sent([p], "r")


def test_a_first_try_claim_reads_once(pd: Any) -> None:
    reads: list[str] = []
    original = pd.d.reader._read

    def read(meta: RecvMeta, *args: Any) -> int:
        reads.append(meta.request_id)
        return int(original(meta, *args))

    pd.d.reader._read = read
    pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"r": SendMeta("r", [2])}))
    recv(pd, "once", "r", [2], [8])
    assert wait_recv(pd.d, "once") == set()
    assert reads == ["once"]
    wait_sent([pd.p], "r")


def test_a_refused_claim_fails_the_load_and_gives_back_the_claimed_ranks(
        claim_mode: str) -> None:
    """P rank 1 refuses the claim (it does not hold the blocks); rank 0 accepted: the load
    fails whatever the read did, and rank 0 gets its blocks back at once (Done, not lease)."""
    p_port, d_port = free_port(), free_port()
    ps = [new_worker("kv_producer", p_port, 2, r, "P", {"lease_ttl_s": 30.0}) for r in range(2)]
    d = new_worker("kv_consumer", d_port, 1, 0, "D", {"load_timeout_s": 10.0})
    try:
        for r, w in enumerate(ps):
            w.register_kv_caches(make_caches("cpu", 2, r, fill=True))
        d.register_kv_caches(make_caches("cpu", 1, 0, fill=False))
        ps[0].start_load_kv(MooncakeConnectorMetadata(requests_to_send={"r": SendMeta("r", [4])}))
        ps[1].start_load_kv(MooncakeConnectorMetadata(requests_to_send={"r": SendMeta("r", [5])}))
        remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=p_port, request_id="r",
                               block_ids=[4], tp_size=2, pcp_size=1, dcp_size=1)
        d.start_load_kv(MooncakeConnectorMetadata(requests={"x": RecvMeta(
            "x", [6], remote, remote_block_ids=[4])}))
        assert wait_recv(d, "x") == {6}
        assert d.recorder.total("p2p_failures", cause="bad_blocks") == 1
        wait_sent([ps[0]], "r", timeout=5.0)  # well within the 30 s lease
    finally:
        for w in [*ps, d]:
            w.shutdown()


def cache_of(worker: PullWorker) -> dict[str, Any]:
    assert worker.layout is not None
    return {f"r{i}": r.tensor for i, r in enumerate(worker.layout.regions)}


def test_an_idle_step_waits_for_a_load_to_end_and_only_then(pd: Any) -> None:
    """A step that runs no token (vLLM steps again at once) waits on D's loads instead of
    spinning: woken as the load ends, and not at all when no load is in flight."""
    d = pd.d
    waits: list[float] = []
    original = d.loads.wait_any

    def counted(timeout: float) -> bool:
        waits.append(timeout)
        return bool(original(timeout))

    d.loads.wait_any = counted
    assert d.get_finished(idle=True) == (None, None) and waits == []  # nothing in flight
    release = threading.Event()
    original_read = d.reader._read

    def stalled(meta: RecvMeta, *args: Any) -> int:
        release.wait(10)
        return int(original_read(meta, *args))

    d.reader._read = stalled
    pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"r": SendMeta("r", [5])}))
    recv(pd, "idle", "r", [5], [6])
    assert d.get_finished(idle=False) == (None, None) and waits == []  # a busy step
    assert d.get_finished(idle=True) == (None, None)  # waited, timed out: still loading
    assert waits == [d.cfg.idle_wait_s]
    ended: list[Any] = []
    waiter = threading.Thread(target=lambda: ended.append(d.loads.wait_any(30)))
    waiter.start()
    release.set()
    waiter.join(30)
    assert ended == [True]  # woken by the end of the load, not by its timeout
    assert d.get_finished(idle=True) == (None, {"idle"})


def test_the_tracker_wait_ends_at_once_without_loads_and_times_out_with_one() -> None:
    loads = pull_loads.LoadTracker(MetricsRecorder(P2P_METRICS), load_timeout_s=5.0)
    assert loads.wait_any(30) is True  # nothing pending
    remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=1, request_id="x",
                           block_ids=[1], tp_size=1, pcp_size=1, dcp_size=1)
    meta = RecvMeta("x", [2], remote, remote_block_ids=[1])
    loads.add(meta, time.monotonic())
    assert loads.wait_any(0.05) is False
    loads.finish(meta, ok=True)
    assert loads.wait_any(30) is True and loads.collect_finished() == {"x"}


def done_within(p: PullWorker, rid: str, seconds: float) -> bool:
    """True when P got D's Done for ``rid`` (it no longer holds a lease on it) within
    ``seconds``, well before its lease of 1 s could lapse."""
    assert p.holder is not None
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if p.holder.held.get(rid) is None:
            return p.recorder.total("p2p_expired_leases") == 0
        time.sleep(0.01)
    return False


def test_p_gets_the_done_of_a_loaded_request_once_d_collected_the_load(pd: Any) -> None:
    """The Done goes out once vLLM collected the load (D's get_finished), not from the
    pull thread at the load's end, where it held the GIL while vLLM's thread woke."""
    pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"r": SendMeta("r", [5])}))
    recv(pd, "w", "r", [5], [6])
    assert pd.d.wait_loads(["w"], timeout=30)
    assert not done_within(pd.p, "r", 0.3)  # loaded, not collected: no Done yet
    _s, recving = pd.d.get_finished()
    assert recving == {"w"}
    assert done_within(pd.p, "r", 0.5)


def test_a_d_shut_down_before_collecting_a_load_still_sends_its_done(pd: Any) -> None:
    d = new_worker("kv_consumer", free_port(), 1, 0, "D2")
    d.register_kv_caches(make_caches("cpu", 1, 0, fill=False))
    pd.p.start_load_kv(MooncakeConnectorMetadata(requests_to_send={"r": SendMeta("r", [5])}))
    remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=pd.p_port, request_id="r",
                           block_ids=[5], tp_size=1, pcp_size=1, dcp_size=1)
    d.start_load_kv(MooncakeConnectorMetadata(requests={"w": RecvMeta(
        "w", [6], remote, remote_block_ids=[5])}))
    try:
        assert d.wait_loads(["w"], timeout=30)
    finally:
        d.shutdown()
    assert done_within(pd.p, "r", 0.5)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)])
def test_pull_of_two_kv_cache_groups_sharing_tensors(p_tp: int, d_tp: int) -> None:
    """vLLM's hybrid KV cache manager gives a layer of each KV cache group one tensor (here
    layers 0 and 2 share one, 1 and 3 another); a block id belongs to one group at a time, so
    D's pairs of both groups' blocks, one list after the other, move every layer's bytes
    once, split by heads as for one group (heterogeneous TP)."""
    def caches(tp: int, rank: int, fill: bool) -> dict[str, Any]:
        c = make_caches("cpu", tp, rank, fill=fill)
        names = sorted(c)
        c.update({f"model.layers.{i + LAYERS}.self_attn.attn": c[n]
                  for i, n in enumerate(names)})
        return c

    p_port, d_port = free_port(), free_port()
    p_workers = [new_worker("kv_producer", p_port, p_tp, r, "P") for r in range(p_tp)]
    d_workers = [new_worker("kv_consumer", d_port, d_tp, r, "D") for r in range(d_tp)]
    caches_p = [caches(p_tp, r, True) for r in range(p_tp)]
    caches_d = [caches(d_tp, r, False) for r in range(d_tp)]
    try:
        for w, c in zip(p_workers + d_workers, caches_p + caches_d, strict=True):
            w.register_kv_caches(c)
        for w in p_workers + d_workers:
            assert w.layout is not None and w.layout.num_layers == LAYERS
            assert sorted(w.layout.aliases) == [f"model.layers.{i}.self_attn.attn"
                                                for i in range(LAYERS, 2 * LAYERS)]
        # P's blocks of the window group (7, 2) then of the full group (9, 3, 11), and D's
        p_blocks, d_blocks = [7, 2, 9, 3, 11], [1, 4, 5, 6, 10]
        send = MooncakeConnectorMetadata(requests_to_send={
            "req-p": SendMeta("req-p", p_blocks, in_order=True)})
        for w in p_workers:
            w.start_load_kv(send)
        remote = RemotePrefill(engine_id="P", host="127.0.0.1", port=p_port, request_id="req-p",
                               block_ids=p_blocks, tp_size=p_tp, pcp_size=1, dcp_size=1,
                               block_groups=((1, 2), (0, 3)))
        for w in d_workers:
            w.start_load_kv(MooncakeConnectorMetadata(requests={"req-d": RecvMeta(
                "req-d", d_blocks, remote, remote_block_ids=p_blocks)}))
        for w in d_workers:
            assert wait_recv(w, "req-d") == set()
        wait_sent(p_workers, "req-p")
        for d_rank, cache in enumerate(caches_d):
            for layer, value in cache.items():
                for lb, pb in zip(d_blocks, p_blocks, strict=True):
                    want = expected_d_block(caches_p, "cpu", p_tp, d_tp, d_rank, layer, pb)
                    torch.testing.assert_close(value[lb], want, rtol=0, atol=0)
        # each pair moved once a shared tensor: bytes = pairs x the tensors' block bytes
        for w in d_workers:
            assert w.layout is not None
            assert w.recorder.total("p2p_transfer_bytes") == len(p_blocks) * w.layout.block_bytes
    finally:
        for w in p_workers + d_workers:
            w.shutdown()
