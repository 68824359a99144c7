# SPDX-License-Identifier: Apache-2.0
"""The scheduler -> worker lookup over ZeroMQ: msgspec only, garbage-proof, bounded waits."""

from __future__ import annotations

import pickle
import time
from pathlib import Path

import pytest
import zmq

from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.lookup import (
    LookupClient,
    LookupServer,
    in_process_handler,
    lookup_endpoint,
)


@pytest.fixture
def endpoint(tmp_path: Path) -> str:
    return lookup_endpoint("engine/with:odd chars", 0, 7, base_path=str(tmp_path))


def test_endpoint_is_per_engine_and_dp_rank(tmp_path: Path) -> None:
    a = lookup_endpoint("e1", 0, base_path=str(tmp_path))
    assert a.startswith("ipc://") and a != lookup_endpoint("e2", 0, base_path=str(tmp_path))
    assert a != lookup_endpoint("e1", 1, base_path=str(tmp_path))
    assert lookup_endpoint("a/b", 0, base_path=str(tmp_path)).startswith(f"ipc://{tmp_path}/")
    long_base = str(tmp_path / ("x" * 120))
    assert len(lookup_endpoint("e1", 0, base_path=long_base)) < 110  # falls back to a short dir


def test_round_trip(endpoint: str) -> None:
    seen = []

    def handler(hashes: list[str], token_end: int) -> int:
        seen.append((hashes, token_end))
        return 64

    server = LookupServer(endpoint, handler)
    client = LookupClient(endpoint, timeout_s=5, in_process=False)
    try:
        assert client.lookup(["aa", "bb"], 70) == 64
        assert client.lookup(["aa"], 10) == 10  # never more than asked for
        assert client.lookup([], 0) == 0
        assert seen[0] == (["aa", "bb"], 70)
    finally:
        client.close()
        server.close()


def test_garbage_and_pickles_do_not_kill_the_server(endpoint: str) -> None:
    server = LookupServer(endpoint, lambda h, n: 32)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    client = LookupClient(endpoint, timeout_s=5, in_process=False)
    try:
        for junk in (b"", b"garbage", pickle.dumps({"hashes": ["x"]}), b"VAKV\x01\xff\xff"):
            sock.send(junk)
            assert sock.poll(5000)
            assert b"bad_message" in sock.recv()
        assert client.lookup(["aa"], 40) == 32
    finally:
        sock.close(0)
        client.close()
        server.close()


def test_handler_error_is_a_miss_not_a_crash(endpoint: str) -> None:
    def boom(hashes: list[str], token_end: int) -> int:
        raise RuntimeError("store exploded")

    server = LookupServer(endpoint, boom)
    client = LookupClient(endpoint, timeout_s=5, retry_interval_s=0, in_process=False)
    try:
        assert client.lookup(["aa"], 32) == 0
        assert client.failures == 1
    finally:
        client.close()
        server.close()


def test_dead_server_costs_one_timeout_then_misses_at_once(endpoint: str) -> None:
    now = [0.0]
    client = LookupClient(endpoint, timeout_s=0.3, retry_interval_s=10, clock=lambda: now[0])
    try:
        start = time.monotonic()
        assert client.lookup(["aa"], 32) == 0
        assert 0.2 < time.monotonic() - start < 3
        start = time.monotonic()
        assert client.lookup(["aa"], 32) == 0  # within the retry interval: no wait
        assert time.monotonic() - start < 0.1
        assert client.failures == 1
        server = LookupServer(endpoint, lambda h, n: 32)
        try:
            now[0] = 11.0  # retry interval over: asks again
            assert client.lookup(["aa"], 32) == 32
        finally:
            server.close()
    finally:
        client.close()


def test_server_replaces_a_stale_socket_file(endpoint: str) -> None:
    path = Path(endpoint[len("ipc://"):])
    path.write_text("stale")
    server = LookupServer(endpoint, lambda h, n: 1)
    client = LookupClient(endpoint, timeout_s=5)
    try:
        assert client.lookup(["a"], 4) == 1
    finally:
        client.close()
        server.close()
    assert not path.exists()


def test_same_process_lookup_calls_the_handler_directly(endpoint: str) -> None:
    """Scheduler and lookup rank in one process: no socket, no hop to the server thread."""
    import threading

    threads: list[str] = []

    def handler(hashes: list[str], token_end: int) -> int:
        threads.append(threading.current_thread().name)
        return 64

    server = LookupServer(endpoint, handler)
    client = LookupClient(endpoint, timeout_s=5)
    try:
        assert in_process_handler(endpoint) is handler
        assert client.lookup(["aa", "bb"], 70) == 64
        assert client.lookup(["aa"], 10) == 10  # never more than asked for
        assert threads == [threading.current_thread().name] * 2
        assert server._server.stats["requests"] == 0  # nothing went through the socket
    finally:
        client.close()
        server.close()
    assert in_process_handler(endpoint) is None
    late = LookupClient(endpoint, timeout_s=0.2)
    try:  # the server is gone: the socket path answers (here: a timeout, a miss)
        assert late.lookup(["aa"], 32) == 0 and late.failures == 1
    finally:
        late.close()


def test_same_process_handler_error_is_a_miss(endpoint: str) -> None:
    def boom(hashes: list[str], token_end: int) -> int:
        raise RuntimeError("store exploded")

    server = LookupServer(endpoint, boom)
    client = LookupClient(endpoint, timeout_s=5, retry_interval_s=0)
    try:
        assert client.lookup(["aa"], 32) == 0
        assert client.failures == 1
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("in_process", [False, True])
def test_group_lookup_round_trip(endpoint: str, in_process: bool) -> None:
    """The hybrid KV cache manager's lookup: per group, per hash, over the socket or by a
    direct call; a server without a group handler answers a miss, never an error."""
    seen = []

    def groups(hashes: list[str], group_ids: list[int]) -> list[list[bool]]:
        seen.append((hashes, group_ids))
        return [[g == 1 or i == 0 for i in range(len(hashes))] for g in group_ids]

    server = LookupServer(endpoint, lambda h, n: 0, groups)
    client = LookupClient(endpoint, timeout_s=5, in_process=in_process)
    try:
        assert client.lookup_groups(["aa", "bb"], [0, 1]) == [[True, False], [True, True]]
        assert seen == [(["aa", "bb"], [0, 1])]
        assert client.lookup_groups([], [0, 1]) == [[], []]
    finally:
        client.close()
        server.close()
    plain = LookupServer(endpoint, lambda h, n: 0)
    client = LookupClient(endpoint, timeout_s=5, in_process=False, retry_interval_s=0.0)
    try:
        assert client.lookup_groups(["aa"], [0, 1]) == [[False], [False]]
        assert client.failures == 1
    finally:
        client.close()
        plain.close()


def test_group_lookup_refuses_odd_groups_before_the_handler(endpoint: str) -> None:
    """Repeated, negative or too many groups over the socket: an error reply (a miss), the
    store never asked."""
    seen = []

    def groups(hashes: list[str], group_ids: list[int]) -> list[list[bool]]:
        seen.append(group_ids)
        return [[True] * len(hashes) for _ in group_ids]

    server = LookupServer(endpoint, lambda h, n: 0, groups)
    client = LookupClient(endpoint, timeout_s=5, in_process=False, retry_interval_s=0.0)
    try:
        for odd in ([1, 1], [-1], list(range(65))):
            assert client.lookup_groups(["aa"], odd) == [[False]] * len(odd)
        assert seen == [] and client.failures == 3
        assert client.lookup_groups(["aa"], [0]) == [[True]]
    finally:
        client.close()
        server.close()
