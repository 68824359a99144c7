# SPDX-License-Identifier: Apache-2.0
"""The proxy's calls to its instances at fleet size: a connection pool per instance, and no
health probe of an instance that answered a request since the round before."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.instances import InstanceSet
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.metrics import Metrics
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.policies import RoundRobin
from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.upstream import (
    HealthChecks,
    PerOriginTransport,
    Upstream,
)


class Servers:
    """Tiny HTTP/1.1 servers on 127.0.0.1 answering every request 200, counting the
    requests (by port and path) and the connections (by port) they get."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[int, str]] = Counter()
        self.connections: Counter[int] = Counter()
        self.servers: list[asyncio.Server] = []

    async def start(self, n: int) -> list[str]:
        for _ in range(n):
            self.servers.append(await asyncio.start_server(self._serve, "127.0.0.1", 0))
        return [f"http://127.0.0.1:{s.sockets[0].getsockname()[1]}" for s in self.servers]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        port = writer.get_extra_info("sockname")[1]
        self.connections[port] += 1
        try:
            while line := await reader.readline():
                length = 0
                while (header := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = header.decode().partition(":")
                    if name.strip().lower() == "content-length":
                        length = int(value)
                await reader.readexactly(length)
                self.requests[(port, line.split()[1].decode())] += 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    def close(self) -> None:
        for s in self.servers:
            s.close()


def port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def test_each_instance_has_its_own_pool_and_keeps_its_connection() -> None:
    async def run() -> None:
        servers = Servers()
        a, b = await servers.start(2)
        transport = PerOriginTransport(httpx.Limits(max_keepalive_connections=4))
        async with httpx.AsyncClient(transport=transport) as client:
            for _ in range(3):
                assert (await client.post(a + "/v1/completions", json={})).status_code == 200
            assert transport.origins == 1  # b not asked yet: no pool for it
            assert (await client.get(b + "/health")).status_code == 200
            assert transport.origins == 2
        servers.close()
        assert servers.requests == {(port(a), "/v1/completions"): 3, (port(b), "/health"): 1}
        # one connection each: a's three requests went over its pool's kept connection
        assert servers.connections == {port(a): 1, port(b): 1}

    asyncio.run(run())


async def _probe_rounds(n_instances: int, role: str, rounds: int,
                        answer: tuple[bool, str] | None) -> list[list[int]]:
    """Health rounds over ``n_instances`` test servers: each instance's probe count after
    each of the first ``rounds`` rounds. ``answer``: after round 1, the first instance ends
    a request so (``(ok, error)`` of ``InstanceSet.end``)."""
    servers = Servers()
    urls = await servers.start(n_instances)
    metrics = Metrics()
    policy = RoundRobin()
    instances = InstanceSet(role, urls, policy)
    upstream = Upstream(5.0, metrics)
    upstream.open()
    seen: list[list[int]] = []
    done = asyncio.Event()

    def after_round() -> None:
        seen.append([servers.requests[(port(u), "/health")] for u in urls])
        if len(seen) == 1 and answer is not None:
            inst = instances.instances[0]
            instances.begin(inst)
            instances.end(inst, ok=answer[0], error=answer[1])
        if len(seen) == rounds:
            done.set()

    checks = HealthChecks([instances], upstream, policy, metrics, 0.01, after_round)
    task = asyncio.create_task(checks.run())
    await asyncio.wait_for(done.wait(), 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await upstream.close()
    servers.close()
    return seen[:rounds]


def test_an_instance_that_answered_since_the_last_round_is_not_probed() -> None:
    """Round 1 probes every instance; A answers a request after it, so round 2 probes only
    B; round 3 probes both again (A answered nothing since round 2 began)."""
    seen = asyncio.run(_probe_rounds(2, "prefill", 3, (True, "")))
    probes_a, probes_b = [r[0] for r in seen], [r[1] for r in seen]
    assert probes_a == [1, 1, 2]  # skipped in round 2
    assert probes_b == [1, 2, 3]


def test_a_failed_answer_does_not_spare_the_probe() -> None:
    """An answer of HTTP 500 and up (``end(ok=False)``) says nothing of health: the next
    round probes the instance."""
    seen = asyncio.run(_probe_rounds(1, "decode", 2, (False, "HTTP 500")))
    assert [r[0] for r in seen] == [1, 2]
