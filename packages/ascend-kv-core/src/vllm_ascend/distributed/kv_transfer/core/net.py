# SPDX-License-Identifier: Apache-2.0
"""Host addresses and ports."""

from __future__ import annotations

import os
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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (tests and demos)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
