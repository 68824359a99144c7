# SPDX-License-Identifier: Apache-2.0
"""Two network namespaces joined by a veth pair, and engines that run inside one.

A test that cuts the network between P and D puts each in its own namespace
(``ip netns add``), joins them with a veth pair, gives each end an address and
later sets a link down. Creating namespaces needs root (CAP_SYS_ADMIN) and a
kernel that allows it; :func:`netns_problem` says why not, for the skip reason.

:class:`NetnsEngineProcess` is an :class:`~.engines.EngineProcess` whose child
enters a namespace (``setns``) before anything opens a socket; the pipe to the
parent was opened before and keeps working across namespaces.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .engines import EngineProcess

CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/var/run/netns")


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=30)


def netns_problem() -> str | None:
    """None when this machine lets the test create network namespaces, else the reason."""
    name = f"vakv-probe-{uuid.uuid4().hex[:8]}"
    try:
        res = _ip("netns", "add", name, check=False)
    except (FileNotFoundError, subprocess.TimeoutExpired) as exc:
        return f"cannot run `ip netns add` ({exc})"
    if res.returncode != 0:
        return f"`ip netns add` fails here: {res.stderr.strip() or res.returncode}"
    _ip("netns", "del", name, check=False)
    return None


@dataclass
class VethPair:
    """Namespaces ``<prefix>-a`` and ``<prefix>-b`` joined by a veth pair.

    Args:
        subnet: the first three octets of a /24 that is not in use on this machine.
    """

    subnet: str = "10.213.77"
    prefix: str = field(default_factory=lambda: f"vakv{uuid.uuid4().hex[:6]}")

    @property
    def ns_a(self) -> str:
        return f"{self.prefix}-a"

    @property
    def ns_b(self) -> str:
        return f"{self.prefix}-b"

    @property
    def addr_a(self) -> str:
        return f"{self.subnet}.1"

    @property
    def addr_b(self) -> str:
        return f"{self.subnet}.2"

    @property
    def dev_a(self) -> str:
        return f"{self.prefix}a"  # interface names are limited to 15 characters

    @property
    def dev_b(self) -> str:
        return f"{self.prefix}b"

    def create(self) -> VethPair:
        """Create both namespaces, the veth pair, addresses; bring everything up."""
        try:
            _ip("netns", "add", self.ns_a)
            _ip("netns", "add", self.ns_b)
            _ip("link", "add", self.dev_a, "netns", self.ns_a, "type", "veth", "peer", "name",
                self.dev_b, "netns", self.ns_b)
            for ns, dev, addr in ((self.ns_a, self.dev_a, self.addr_a),
                                  (self.ns_b, self.dev_b, self.addr_b)):
                _ip("link", "set", "lo", "up", netns=ns)
                _ip("addr", "add", f"{addr}/24", "dev", dev, netns=ns)
                _ip("link", "set", dev, "up", netns=ns)
        except subprocess.CalledProcessError as exc:
            self.destroy()
            raise RuntimeError(f"could not build the veth pair: {exc.cmd}: {exc.stderr}") from exc
        return self

    def set_link(self, up: bool) -> None:
        """Bring both ends of the veth pair up or down (down: the network is cut)."""
        state = "up" if up else "down"
        _ip("link", "set", self.dev_a, state, netns=self.ns_a)
        _ip("link", "set", self.dev_b, state, netns=self.ns_b)

    def ping(self, timeout_s: int = 1) -> bool:
        """True when a's end reaches b's address."""
        res = subprocess.run(["ip", "netns", "exec", self.ns_a, "ping", "-c", "1", "-W",
                              str(timeout_s), self.addr_b], capture_output=True, timeout=30,
                             check=False)
        return res.returncode == 0

    def destroy(self) -> None:
        """Delete both namespaces (the veth pair goes with them)."""
        for ns in (self.ns_a, self.ns_b):
            _ip("netns", "del", ns, check=False)

    def __enter__(self) -> VethPair:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()


def enter_netns(name: str) -> None:
    """Move the calling thread (and the threads it starts later) into namespace ``name``."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / name, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({name}): {os.strerror(err)}")
    finally:
        os.close(fd)


class NetnsEngineProcess(EngineProcess):
    """An :class:`~.engines.EngineProcess` inside network namespace ``netns``, binding and
    advertising ``host`` (``VLLM_HOST_IP``, ``VLLM_ASCEND_KV_HOST``, Mooncake's addresses)."""

    def __init__(self, model: str | Path, kv_transfer_config: dict[str, Any] | None = None, *,
                 netns: str, host: str, env: dict[str, str] | None = None,
                 pre_import: list[str] | None = None, startup_timeout: float = 300.0,
                 **llm_overrides: Any) -> None:
        hosts = {"VLLM_HOST_IP": host, "VLLM_ASCEND_KV_HOST": host, "MC_TCP_BIND_ADDRESS": host,
                 "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": host}
        self.netns = netns
        self._launch(model, kv_transfer_config, {**hosts, **(env or {})}, pre_import,
                     startup_timeout, llm_overrides, netns=netns)
