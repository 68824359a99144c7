# SPDX-License-Identifier: Apache-2.0
"""free_port hands out spans of ports that connectors bind as base + rank."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from vllm_ascend.distributed.kv_transfer.core import net
from vllm_ascend.distributed.kv_transfer.core.net import free_port


def test_every_port_of_the_span_binds_and_spans_never_overlap() -> None:
    bases = [free_port(span=4) for _ in range(50)]
    spans = [set(range(b, b + 4)) for b in bases]
    seen: set[int] = set()
    for span in spans:
        assert not span & seen
        seen |= span
    socks = []
    try:
        for port in spans[0] | spans[1]:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", port))
            socks.append(s)
    finally:
        for s in socks:
            s.close()


def test_a_span_with_a_bound_port_is_never_handed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    held_port = free_port(span=1)
    ephemeral_lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert held_port < ephemeral_lo
    # Every span of 8 that the narrowed range offers holds the bound port.
    monkeypatch.setattr(net, "_PORT_RANGE", (held_port - 7, held_port + 9))
    monkeypatch.setattr(net, "_HANDED_OUT", set())
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", held_port))
        held.listen()
        other = free_port(span=8)
    assert not other <= held_port < other + 8
    assert other >= ephemeral_lo  # the kernel's pick, as none of the spans was free
