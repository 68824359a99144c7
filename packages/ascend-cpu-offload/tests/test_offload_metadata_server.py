# SPDX-License-Identifier: Apache-2.0
"""The metadata server: the protocol, several ranks, dead ranks, hostile input."""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from vllm_ascend.distributed.kv_transfer.core.errors import RemoteError
from vllm_ascend.distributed.kv_transfer.core.wire import HEADER, ErrorReply
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager import (
    HostSegment,
    MetadataClient,
    MetadataServer,
    ServerUnavailable,
    default_endpoint,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.cpu_offload_manager.protocol import (
    Lookup,
    LookupReply,
    RegisterRank,
    SaveRequest,
    make_codec,
)
from vllm_ascend.distributed.kv_transfer.kv_pool.cpu_offload.errors import PoolNotReadyError


def chain(name: str, n: int) -> list[bytes]:
    out, prev = [], hashlib.sha256(name.encode()).digest()
    for i in range(n):
        prev = hashlib.sha256(prev + bytes([i])).digest()
        out.append(prev)
    return out


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def reg(rank: int, world: int = 1, *, tp: int | None = None, layers: int = 2, nbytes: int = 256,
        mla: bool = False) -> RegisterRank:
    tp_size = world if tp is None else tp
    return RegisterRank(rank=rank, world_size=world, tp_rank=rank % tp_size, tp_size=tp_size,
                        pp_rank=rank // tp_size, pp_size=world // tp_size, is_mla=mla,
                        layer_names=[f"model.layers.{i}.attn" for i in range(layers)],
                        layer_block_bytes=[nbytes] * layers)


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/meta.ipc"


@pytest.fixture
def seg_dir(tmp_path: Path) -> str:
    d = tmp_path / "segments"
    d.mkdir()
    return str(d)


def make_server(endpoint: str, seg_dir: str, world: int = 1, budget: int = 64 << 10,
                **kw: object) -> MetadataServer:
    return MetadataServer(endpoint, world_size=world, budget_bytes=budget, segment_dir=seg_dir,
                          **kw).start()  # type: ignore[arg-type]


@pytest.fixture
def server(endpoint: str, seg_dir: str) -> Iterator[MetadataServer]:
    srv = make_server(endpoint, seg_dir)
    yield srv
    srv.stop()


def raw_request(endpoint: str, payload: bytes) -> bytes:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    try:
        sock.send(payload)
        assert sock.poll(5000), "the server did not answer"
        return sock.recv()
    finally:
        sock.close(0)


def test_single_rank_full_cycle(server: MetadataServer, endpoint: str, seg_dir: str) -> None:
    client = MetadataClient(endpoint)
    info = client.register(reg(0), timeout_s=5)
    assert info.ready and info.num_blocks > 0 and not info.shared
    assert os.path.dirname(info.segment_path) == seg_dir
    seg = HostSegment.attach(info.segment_path, info.num_blocks, info.layer_block_bytes)
    client.attached(0)
    assert not os.path.exists(info.segment_path), "unlinked once every rank mapped it"
    a = chain("a", 3)
    reply = client.plan_step([SaveRequest(key="r1", hashes=a)], [], owner="test")
    (planned,) = reply.saves
    assert planned.positions == [0, 1, 2] and reply.total_blocks == info.num_blocks
    assert client.lookup(a) == 0, "nothing is matched before the rank confirms the save"
    client.save_done(0, [planned.job_id])
    assert client.lookup(a) == 3
    assert client.pin("k1", a, owner="test") == planned.block_ids
    stats = client.stats()
    assert stats.pinned_blocks == 3 and stats.cached_blocks == 3
    client.plan_step([], ["k1"])
    assert client.stats().pinned_blocks == 0
    assert client.reset() == 3 and client.lookup(a) == 0
    seg.close()
    client.close()


def test_two_ranks_register_concurrently_and_commit_needs_both(endpoint: str,
                                                               seg_dir: str) -> None:
    srv = make_server(endpoint, seg_dir, world=2, budget=1 << 20)
    try:
        infos: dict[int, object] = {}

        def rank(r: int) -> None:
            c = MetadataClient(endpoint)
            infos[r] = c.register(reg(r, 2, nbytes=512 * (r + 1)), timeout_s=10)
            c.close()

        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert set(infos) == {0, 1}
        paths = {i.segment_path for i in infos.values()}  # type: ignore[attr-defined]
        assert len(paths) == 2, "non-MLA: one segment per rank"
        n = infos[0].num_blocks  # type: ignore[attr-defined]
        # both segments fit the budget together
        assert n * (2 * 512 + 2 * 1024) <= 1 << 20
        client = MetadataClient(endpoint)
        (planned,) = client.plan_step([SaveRequest(key="r", hashes=chain("x", 2))], [],
                                      owner="test").saves
        client.save_done(0, [planned.job_id])
        assert client.lookup(chain("x", 2)) == 0
        client.save_done(1, [planned.job_id])
        assert client.lookup(chain("x", 2)) == 2
        client.close()
    finally:
        srv.stop()
    assert not os.listdir(seg_dir), "stop() removes segments nobody attached"


def test_mla_ranks_of_a_stage_share_one_segment(endpoint: str, seg_dir: str) -> None:
    srv = make_server(endpoint, seg_dir, world=4, budget=1 << 20)
    try:
        results = {}

        def rank(r: int) -> None:
            c = MetadataClient(endpoint)
            results[r] = c.register(reg(r, 4, tp=2, mla=True), timeout_s=10)
            c.close()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        assert results[0].segment_path == results[1].segment_path
        assert results[2].segment_path == results[3].segment_path
        assert results[0].segment_path != results[2].segment_path
        assert all(i.shared for i in results.values())
    finally:
        srv.stop()


def test_a_dead_rank_frees_its_blocks_by_lease(endpoint: str, seg_dir: str) -> None:
    clock = FakeClock()
    srv = make_server(endpoint, seg_dir, world=2, budget=1 << 20, save_ttl=10.0, clock=clock)
    try:
        clients = [MetadataClient(endpoint) for _ in range(2)]
        threads = [threading.Thread(target=clients[r].register, args=(reg(r, 2),),
                                    kwargs={"timeout_s": 10}) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(15)
        sched = MetadataClient(endpoint)
        (planned,) = sched.plan_step([SaveRequest(key="r", hashes=chain("a", 4))], [],
                                     owner="test").saves
        clients[0].save_done(0, [planned.job_id])
        # rank 1 died before confirming: its blocks are pending, not matched, not free
        stats = sched.stats()
        assert stats.pending_blocks == 4 and sched.lookup(chain("a", 4)) == 0
        clock.now = 11.0
        stats = sched.stats()
        assert stats.pending_blocks == 0 and stats.free_blocks == stats.total_blocks
        assert stats.expired_jobs == 1
        clients[1].save_done(1, [planned.job_id])  # a late confirmation is ignored
        assert sched.lookup(chain("a", 4)) == 0
        # a rank that says goodbye releases at once
        (p2,) = sched.plan_step([SaveRequest(key="r", hashes=chain("b", 2))], [],
                                owner="test").saves
        clients[1].rank_gone(1)
        assert sched.stats().pending_blocks == 0 and p2.job_id
    finally:
        srv.stop()


@pytest.mark.parametrize("payload", [
    b"",
    b"\x00" * 3,
    b"hello world",
    HEADER + b"\xff\xfe\xfd",
    HEADER + msgspec.msgpack.encode({"type": "NoSuchMessage"}),
    HEADER + msgspec.msgpack.encode({"type": "Lookup", "hashes": [b"short"]}),
    HEADER + msgspec.msgpack.encode({"type": "Lookup", "hashes": "not a list"}),
    HEADER + msgspec.msgpack.encode({"type": "SaveDone", "rank": -1, "job_ids": []}),
    b"VAKV\x09" + msgspec.msgpack.encode({"type": "Ping"}),
])
def test_garbage_gets_an_error_reply_and_the_server_keeps_serving(
        server: MetadataServer, endpoint: str, payload: bytes) -> None:
    reply = make_codec().decode(raw_request(endpoint, payload))
    assert isinstance(reply, ErrorReply) and reply.code == "bad_message"
    ok = make_codec().decode(raw_request(endpoint, make_codec().encode(
        Lookup(hashes=chain("a", 1)))))
    assert isinstance(ok, LookupReply)


class _Exploit:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {_Exploit.marker}",))

    marker = ""


def test_a_pickle_is_never_unpickled(server: MetadataServer, endpoint: str,
                                     tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _Exploit.marker = str(marker)
    for payload in (pickle.dumps(_Exploit()), HEADER + pickle.dumps(_Exploit())):
        reply = make_codec().decode(raw_request(endpoint, payload))
        assert isinstance(reply, ErrorReply)
    time.sleep(0.2)
    assert not marker.exists()
    assert server.rpc_stats["bad_messages"] == 2


def test_well_formed_but_impossible_requests_are_refused(server: MetadataServer,
                                                         endpoint: str) -> None:
    client = MetadataClient(endpoint)
    with pytest.raises(RemoteError, match="outside this instance's world of 1"):
        client.register(reg(3, 4), timeout_s=2)
    with pytest.raises(RemoteError, match="says the world has 2 ranks"):
        client.register(reg(0, 2), timeout_s=2)
    bad = RegisterRank(rank=0, world_size=1, layer_names=["a"], layer_block_bytes=[])
    with pytest.raises(RemoteError, match="one size per layer"):
        client.register(bad, timeout_s=2)
    with pytest.raises(RemoteError, match="not ready"):
        client.save_done(0, [1])
    client.register(reg(0), timeout_s=2)
    with pytest.raises(RemoteError, match="different layout"):
        client.register(reg(0, nbytes=64), timeout_s=2)
    client.pin("dup", [], owner="test")
    with pytest.raises(RemoteError, match="an owner is required"):
        client.pin("ownerless", [b"x" * 32], owner="")
    client.close()


def test_too_small_budget_is_a_clear_error(endpoint: str, seg_dir: str) -> None:
    srv = make_server(endpoint, seg_dir, budget=100)
    try:
        with pytest.raises(RemoteError, match="cannot hold one host block"):
            MetadataClient(endpoint).register(reg(0), timeout_s=2)
    finally:
        srv.stop()


def test_missing_ranks_time_out_clearly(endpoint: str, seg_dir: str) -> None:
    srv = make_server(endpoint, seg_dir, world=2)
    try:
        with pytest.raises(PoolNotReadyError, match="not every one of the 2 ranks registered"):
            MetadataClient(endpoint).register(reg(0, 2), timeout_s=0.5)
    finally:
        srv.stop()


def test_client_backs_off_after_a_dead_server(tmp_path: Path) -> None:
    clock = FakeClock()
    client = MetadataClient(f"ipc://{tmp_path}/nobody.ipc", timeout_s=0.1, retry_after_s=30,
                            clock=clock)
    start = time.monotonic()
    with pytest.raises(ServerUnavailable):
        client.lookup(chain("a", 1))
    with pytest.raises(ServerUnavailable, match="unavailable"):
        client.lookup(chain("a", 1))
    assert time.monotonic() - start < 1.0, "the second call must not wait again"
    assert not client.available
    clock.now = 31
    assert client.available
    client.close()


def test_default_endpoint_is_unique_per_engine_and_dp_rank() -> None:
    a = default_endpoint("1234-abcd", 0)
    assert a.startswith("ipc://") and a.endswith("-dp0.ipc")
    assert a != default_endpoint("1234-abcd", 1) != default_endpoint("9999", 0)
    assert "/" not in default_endpoint("../../etc/passwd").rsplit("/", 1)[1][:-4]
