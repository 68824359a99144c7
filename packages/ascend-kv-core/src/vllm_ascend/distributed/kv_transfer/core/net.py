# SPDX-License-Identifier: Apache-2.0
"""Host addresses and ports."""

from __future__ import annotations

import os
import random
import socket

#: Environment variables, in order, that name the address to advertise and bind.
HOST_ENV_VARS = ("VLLM_ASCEND_KV_HOST", "VLLM_HOST_IP")


def get_host_ip() -> str:
    """The address this process advertises to peers and binds its sockets to.

    ``VLLM_ASCEND_KV_HOST`` or ``VLLM_HOST_IP`` when set; otherwise the address
    of the interface that routes outwards, falling back to ``127.0.0.1``.
    Sockets bind to this address, never to all interfaces by default.
    """
    for var in HOST_ENV_VARS:
        value = os.environ.get(var, "").strip()
        if value:
            return value
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent for UDP connect
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


#: Ports :func:`free_port` has handed out in this process, so that two calls
#: never return overlapping spans while neither is bound yet.
_HANDED_OUT: set[int] = set()
#: Where :func:`free_port` looks: below Linux's default ephemeral range
#: (32768-60999), so the port is not taken meanwhile by an outgoing connection.
_PORT_RANGE = (20000, 32000)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1", span: int = 8) -> int:
    """A base port that, with the ``span - 1`` above it, was free a moment ago.

    For tests and demos. Connectors bind ``base + rank`` for each worker rank
    (TP x PP), so a base alone is not enough: every port of the span is checked,
    and spans handed out earlier in this process are never handed out again.
    Ports come from below the kernel's ephemeral range, which outgoing
    connections draw from; the kernel picks one when no span is found there.
    """
    rng = random.Random()
    lo, hi = _PORT_RANGE
    for _ in range(500):
        base = rng.randrange(lo, hi - span)
        ports = range(base, base + span)
        if any(p in _HANDED_OUT for p in ports):
            continue
        if all(_bindable(host, p) for p in ports):
            _HANDED_OUT.update(ports)
            return base
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
