# SPDX-License-Identifier: Apache-2.0
"""D keeps a failed push's blocks until no write of it can land (layerwise.fence).

A raw TCP connection into D's transfer-engine ports stands for the connection a late write
of P would arrive on: the fence must shut it down (it reads the end of the stream) before D
reports the request, and leave it alone when P acknowledged that its writes are settled.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from p2p_worker_harness import layout_caches, pd_vllm_config

from vllm_ascend.distributed.kv_transfer.core import own_sockets
from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient, tcp_endpoint
from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
from vllm_ascend.distributed.kv_transfer.core.net import free_port
from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeLayerwiseConfig
from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.contract import (
    MooncakeLayerwiseConnectorMetadata,
    RecvReq,
)
from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.fence import WriteFence
from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.worker import LayerwiseWorker
from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import (
    LAYERWISE_CODEC,
    PushBegin,
    PushDone,
    PushDoneAck,
    PushGrant,
)

pytestmark = pytest.mark.skipif(not own_sockets.available(),
                                reason="no /proc/net/tcp: the fence finds sockets there (Linux)")


@pytest.fixture
def d() -> Iterator[LayerwiseWorker]:
    port = free_port()
    worker = LayerwiseWorker(
        pd_vllm_config("kv_consumer", port, block_size=16, heads=4, model="/models/tiny",
                       tp_size=1),
        MooncakeLayerwiseConfig.from_dict({"lease_ttl_s": 1.0, "load_timeout_s": 10.0}),
        "D", MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)
    worker.register_kv_caches(layout_caches("cpu", 1, 0, fill=False, layers=2, blocks=8,
                                            heads=4, block_size=16, head_size=8))
    try:
        yield worker
    finally:
        worker.shutdown()


def lanes(worker: LayerwiseWorker) -> list[socket.socket]:
    """A connection into each of the transfer engine's ports, as P's transfer engine has."""
    assert worker.te is not None and worker.te.listen_ports  # its RPC and data ports
    out = [socket.create_connection(("127.0.0.1", port)) for port in worker.te.listen_ports]
    time.sleep(0.1)  # accepted by the engine
    return out


def shut(lane: socket.socket, timeout: float = 2.0) -> bool:
    """Whether D shut ``lane`` down (its end of the stream, or a reset, arrives)."""
    lane.settimeout(timeout)
    try:
        return lane.recv(16) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def begin(worker: LayerwiseWorker, rid: str, *, te_host: str) -> RpcClient[Any]:
    worker.start_load_kv(MooncakeLayerwiseConnectorMetadata(requests={rid: RecvReq(rid, [1, 2])}))
    client: RpcClient[Any] = RpcClient(tcp_endpoint("127.0.0.1", worker.port), LAYERWISE_CODEC)
    grant = client.call(PushBegin(request_id=rid, sender="P/tp0", p_rank=0, p_tp_size=1,
                                  block_ids=[1, 2],
                                  block_lens=[r.block_len for r in worker.layout.regions],
                                  te_host=te_host))
    assert isinstance(grant, PushGrant)
    return client


def wait_failed(worker: LayerwiseWorker, rid: str, timeout: float = 10.0) -> float:
    """Seconds until ``rid`` is reported, failed with its blocks."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        _s, recving = worker.get_finished(set())
        if recving and rid in recving:
            assert worker.get_block_ids_with_load_errors() == {1, 2}
            return time.monotonic() - start
        time.sleep(0.01)
    raise AssertionError(f"{rid} was not reported within {timeout}s")


def fences(worker: LayerwiseWorker) -> float:
    return worker.recorder.total("p2p_write_fences", outcome="drained")


def test_a_write_failed_at_p_is_fenced_before_the_blocks_go_back(d: LayerwiseWorker) -> None:
    open_lanes = lanes(d)
    client = begin(d, "r", te_host="127.0.0.1")
    # P's write failed in the transfer engine: its bytes may still be on the way
    ack = client.call(PushDone(request_id="r", sender="P/tp0", success=False,
                               reason="transfer failed", settled=False))
    assert isinstance(ack, PushDoneAck) and ack.accepted
    assert wait_failed(d, "r") < 2.0
    assert all(shut(lane) for lane in open_lanes)
    assert fences(d) == 1
    assert d.recorder.total("p2p_fenced_connections") >= len(open_lanes)
    client.close()
    for lane in open_lanes:
        lane.close()


def test_a_settled_failure_keeps_every_connection(d: LayerwiseWorker) -> None:
    open_lanes = lanes(d)
    client = begin(d, "r", te_host="127.0.0.1")
    client.call(PushDone(request_id="r", sender="P/tp0", success=False, reason="revoked",
                         settled=True))
    wait_failed(d, "r")
    assert not any(shut(lane, timeout=0.3) for lane in open_lanes)
    assert fences(d) == 0 and d.recorder.total("p2p_fenced_connections") == 0
    client.close()
    for lane in open_lanes:
        lane.close()


def test_a_silent_p_that_named_no_host_is_fenced_from_every_peer(d: LayerwiseWorker) -> None:
    open_lanes = lanes(d)
    client = begin(d, "r", te_host="")  # an older P: D cannot tell its connections apart
    took = wait_failed(d, "r")  # its lease (1 s) lapses unrenewed
    assert 0.8 < took < 4.0
    assert d.recorder.total("p2p_failures", cause="peer_lost") == 1
    assert all(shut(lane) for lane in open_lanes)
    assert fences(d) == 1
    client.close()


def test_only_the_named_hosts_connections_are_fenced() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port))
    conn, _ = srv.accept()
    try:
        assert WriteFence({port}, {"10.255.0.9"}, limit_s=1.0).poll()  # nothing from there
        assert not shut(cli, timeout=0.2)
        fence = WriteFence({port}, {"127.0.0.1"}, limit_s=1.0)
        later = socket.create_connection(("127.0.0.1", port))  # opened after the fence began
        conn2, _ = srv.accept()
        while not fence.poll():
            time.sleep(0.01)
        assert fence.closed == 1 and not fence.timed_out
        assert shut(cli)
        assert not shut(later, timeout=0.2)
        conn2.close()
        later.close()
    finally:
        conn.close()
        cli.close()
        srv.close()


def test_a_connection_in_the_accept_queue_is_waited_for_then_shut() -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    cli = socket.create_connection(("127.0.0.1", port))
    try:
        time.sleep(0.05)
        fence = WriteFence({port}, None, limit_s=5.0)
        time.sleep(0.05)
        assert not fence.poll()  # not accepted yet: the engine would read what it queued
        conn, _ = srv.accept()
        while not fence.poll():
            time.sleep(0.01)
        assert fence.closed == 1 and shut(cli)
        conn.close()
        # one never taken ends the fence at its limit, counted as such
        cli2 = socket.create_connection(("127.0.0.1", port))
        time.sleep(0.05)
        fence = WriteFence({port}, None, limit_s=0.2)
        start = time.monotonic()
        while not fence.poll():
            time.sleep(0.01)
        assert fence.timed_out and 0.15 < time.monotonic() - start < 2.0
        cli2.close()
    finally:
        cli.close()
        srv.close()
