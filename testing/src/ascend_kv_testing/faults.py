# SPDX-License-Identifier: Apache-2.0
"""Support of the fault, fuzz and soak tests: what a process listens on and how much memory
it holds, pickles that would run code, raw probes of ZeroMQ endpoints, and what an engine
still holds after a fault.

Everything here reads ``/proc``, talks to a socket or asks an engine process
(``EngineProcess.call``); nothing imports vLLM in the test process.
"""

from __future__ import annotations

import os
import pickle
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Addresses that mean "every interface".
WILDCARDS = frozenset({"0.0.0.0", "::"})


@dataclass(frozen=True)
class Listener:
    """One listening socket of a process."""

    kind: str  # "tcp", "tcp6" or "unix"
    host: str  # address for tcp, "" for unix
    port: int  # 0 for unix
    path: str  # socket path for unix ("@name" for abstract ones), "" for tcp
    inode: int

    @property
    def wildcard(self) -> bool:
        """Bound to every interface."""
        return self.kind != "unix" and self.host in WILDCARDS

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.kind}:{host}:{self.port}"


def _socket_inodes(pid: int) -> set[int]:
    out = set()
    fd_dir = Path(f"/proc/{pid}/fd")
    try:
        names = os.listdir(fd_dir)
    except (FileNotFoundError, PermissionError):
        return out
    for name in names:
        try:
            target = os.readlink(fd_dir / name)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[len("socket:["):-1]))
    return out


def _hex_addr(text: str, v6: bool) -> tuple[str, int]:
    addr, port = text.split(":")
    raw = bytes.fromhex(addr)
    if v6:
        # four little-endian 32-bit words
        raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
        host = socket.inet_ntop(socket.AF_INET6, raw)
        if host.startswith("::ffff:") and "." in host:
            host = host[len("::ffff:"):]
    else:
        host = socket.inet_ntop(socket.AF_INET, raw[::-1])
    return host, int(port, 16)


def listening_sockets(pid: int) -> list[Listener]:
    """Every TCP and Unix stream socket ``pid`` listens on (read from ``/proc``).

    The tables are read in the process's own network namespace
    (``/proc/<pid>/net``), so this works for a process inside another namespace.
    """
    inodes = _socket_inodes(pid)
    out: list[Listener] = []
    for kind, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = Path(f"/proc/{pid}/net/{kind}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != "0A":  # 0A: LISTEN
                continue
            inode = int(cols[9])
            if inode in inodes:
                host, port = _hex_addr(cols[1], v6)
                out.append(Listener(kind, host, port, "", inode))
    try:
        lines = Path(f"/proc/{pid}/net/unix").read_text().splitlines()[1:]
    except OSError:
        lines = []
    for line in lines:
        cols = line.split()
        # Num RefCount Protocol Flags Type St Inode [Path]; flags 00010000 = listening
        if len(cols) < 8 or not int(cols[3], 16) & 0x10000:
            continue
        inode = int(cols[6])
        if inode in inodes:
            out.append(Listener("unix", "", 0, cols[7], inode))
    return out


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` in bytes (``VmRSS``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (from ``/proc/*/stat``)."""
    parent: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        # the command name may hold spaces: the parent pid follows the closing parenthesis
        parent[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    out: list[int] = []
    todo = [pid]
    while todo:
        cur = todo.pop()
        kids = [p for p, pp in parent.items() if pp == cur]
        out += kids
        todo += kids
    return out


class _RunsCode:
    """Unpickling this runs ``open(path, "w")``: the marker file appears."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.path, "w"))


def evil_pickles(marker: Path) -> list[bytes]:
    """Pickles (every protocol, bare and behind the wire header) whose loading creates
    ``marker``: a peer that unpickles any of them leaves the file behind."""
    from vllm_ascend.distributed.kv_transfer.core.wire import HEADER

    payloads = [pickle.dumps(_RunsCode(str(marker)), protocol=p)
                for p in range(2, pickle.HIGHEST_PROTOCOL + 1)]
    return payloads + [HEADER + p for p in payloads]


class ZmqProbe:
    """A DEALER socket that sends arbitrary frames to a ROUTER endpoint and waits for an
    answer with a deadline (a REQ socket cannot send malformed envelopes)."""

    def __init__(self, endpoint: str, *, max_size: int = 64 << 20) -> None:
        import zmq

        self.endpoint = endpoint
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._max_size = max_size
        self._sock = self._new()

    def _new(self) -> Any:
        sock = self._ctx.socket(self._zmq.DEALER)
        sock.setsockopt(self._zmq.LINGER, 0)
        sock.setsockopt(self._zmq.MAXMSGSIZE, self._max_size)
        sock.connect(self.endpoint)
        return sock

    def reconnect(self) -> None:
        """A fresh socket (a server that dropped an oversize frame closes the connection)."""
        self._sock.close(0)
        self._sock = self._new()

    def ask(self, frames: Sequence[bytes], timeout_s: float = 5.0) -> list[bytes] | None:
        """Send ``[b"", *frames]`` (REQ framing) and return the answer's frames after the
        delimiter, or None when nothing came within ``timeout_s``."""
        zmq = self._zmq
        # drain late answers to earlier probes
        while self._sock.poll(0, zmq.POLLIN):
            self._sock.recv_multipart()
        self._sock.send_multipart([b"", *frames])
        if not self._sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        reply = self._sock.recv_multipart()
        return reply[1:] if reply and reply[0] == b"" else reply

    def close(self) -> None:
        self._sock.close(0)


def raw_send(endpoint: str, data: bytes, *, timeout_s: float = 2.0) -> bytes:
    """Connect to a ``tcp://`` or ``ipc://`` endpoint with a plain socket, send ``data``,
    read what comes back until the peer closes or ``timeout_s`` passes (not ZMTP at all)."""
    if endpoint.startswith("ipc://"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        addr: Any = endpoint[len("ipc://"):]
    else:
        host, _, port = endpoint[len("tcp://"):].rpartition(":")
        host = host.strip("[]")
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET,
                             socket.SOCK_STREAM)
        addr = (host, int(port))
    got = b""
    with sock:
        sock.settimeout(timeout_s)
        sock.connect(addr)
        try:
            sock.sendall(data)
            end = time.monotonic() + timeout_s
            while time.monotonic() < end:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                got += chunk
        except OSError:  # reset or timeout: the server gave up on us, which is fine
            pass
    return got


def start_in_parallel(factories: dict[str, Any]) -> dict[str, Any]:
    """Call every ``name -> factory()`` on its own thread (engines start in parallel) and
    return ``name -> result``; when one fails, the others are closed and the error raised."""
    import threading

    made: dict[str, Any] = {}
    errors: list[BaseException] = []

    def run(name: str, factory: Any) -> None:
        try:
            made[name] = factory()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=item) for item in factories.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for obj in made.values():
            obj.close()
        raise errors[0]
    return made


def wait_for(predicate: Any, timeout_s: float, interval_s: float = 0.05) -> bool:
    """Poll ``predicate()`` until it is true or ``timeout_s`` passed; its last value."""
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value or time.monotonic() >= end:
            return bool(value)
        time.sleep(interval_s)


#: A P/D pull engine's leak-state counts that must be 0 once it is idle.
PULL_STATE = ("p2p_held", "p2p_pending")
#: The same for a layerwise engine (P's pushes in flight too).
PUSH_STATE = ("p2p_held", "p2p_pending", "p2p_pushes")
#: The same for a pool engine (saves not yet in the store).
POOL_STATE = ("pool_pending_saves",)


def leak_state(engine: Any) -> dict[str, int]:
    """What ``engine`` holds: requests, blocks in use, the connector's held requests."""
    from .pd import PROBES

    return engine.call(f"{PROBES}:leak_state")  # type: ignore[no-any-return]


def connector_totals(engine: Any) -> dict[str, float]:
    """``engine``'s connector counters so far (summed over its workers)."""
    from .pd import PROBES

    return engine.call(f"{PROBES}:connector_totals")  # type: ignore[no-any-return]


def failure_counts(engine: Any) -> dict[str, float]:
    """``engine``'s P/D failures so far, by cause."""
    return {k.split("cause=")[-1]: v for k, v in connector_totals(engine).items()
            if k.startswith("p2p_failures")}


def holds_nothing(engine: Any, report: Any = None, *, zero: Sequence[str] = PULL_STATE,
                  idle_s: float = 30.0) -> dict[str, int]:
    """Wait until ``engine`` is idle; its leak state, which must show no request, no block in
    use and 0 for each of ``zero`` (observed as ``zero`` on a fault ``report``)."""
    idle = engine.wait_idle(idle_s)
    state = leak_state(engine)
    empty = state["requests"] == 0 and state["used_blocks"] == 0
    held = {k: state[k] for k in zero if state[k] != 0}
    if report is not None:
        report.check("zero", idle and empty and not held, f"idle={idle}, {state}")
    assert idle, state
    assert empty, state
    assert not held, state
    return state
