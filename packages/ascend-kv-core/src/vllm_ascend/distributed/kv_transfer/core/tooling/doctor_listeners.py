# SPDX-License-Identifier: Apache-2.0
"""``doctor``'s probe of where the Mooncake transfer engine actually listens.

Mooncake's data plane authenticates no one (``docs/security.md``), so its ports must
be reachable only on the interface the deployment chose. Setting the address is not
enough to know: the probe starts a transfer engine on the advertised address, exactly
as a connector does (:class:`~vllm_ascend.distributed.kv_transfer.core.transfer_engine.
MooncakeTransferEngine`), lists the sockets it listens on (``/proc/self/net/tcp*``,
matched to its own file descriptors) and tries to connect to each of them through every
other non-loopback address of this host. A port that answers there is reported.

On the machines of this project (``mooncake-transfer-engine`` 0.3.x, Linux) the engine
given ``127.0.0.1`` still listened with its RPC port on ``0.0.0.0`` and its TCP transport
on ``::`` (every interface), whatever ``MC_TCP_BIND_ADDRESS`` said: a firewall is what
keeps those ports private. Mooncake's source says why: its handshake listener and the port
search of its RPC port bind ``INADDR_ANY``/``IN6ADDR_ANY``, its TCP transport a dual-stack
``tcp::v6()`` acceptor, and no variable changes that (``MC_TCP_BIND_ADDRESS`` only sets the
address it *advertises*, ``MC_LEGACY_RPC_PORT_BINDING`` which port it takes).

With a deployment key a port that answers on another interface **fails** the check: the
key protects the control plane only, and such a port hands the KV to anyone who reaches
it (``docs/security.md``); without one it warns. ``doctor`` cannot see the transfer engine
of a running ``vllm serve``: what it checks is an engine of its own, started the way a
connector starts one (same Mooncake build, same ``MC_*`` environment, same address), which
listens where the instance's engine would.

Under protocol ``local`` (a connector's ``protocol`` option, else
``VLLM_ASCEND_KV_PROTOCOL``; :mod:`..local_protocol`) no Mooncake engine is started and no
Mooncake port is opened: the probe says so and starts none.

The probe runs in a child process (``python -m ...doctor_listeners HOST``), so that an
engine that hangs or crashes cannot take ``doctor`` with it, and its ports close with it.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import logging
import os
import socket
import struct
import subprocess
import sys
from typing import Any

from .. import auth, local_protocol

logger = logging.getLogger(__name__)

#: ``SIOCGIFADDR``: the IPv4 address of an interface (Linux ``ioctl``).
_SIOCGIFADDR = 0x8915
_TCP_LISTEN = "0A"


def _decode_addr(hexaddr: str) -> str:
    """An address of ``/proc/net/tcp{,6}`` (hex, host byte order per 32-bit word)."""
    raw = bytes.fromhex(hexaddr)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def own_listeners() -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket this process listens on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/self/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if len(parts) < 10 or parts[3] != _TCP_LISTEN or parts[9] not in inodes:
                continue
            addr, port = parts[1].rsplit(":", 1)
            out.append((_decode_addr(addr), int(port, 16)))
    return sorted(set(out))


def local_addresses() -> list[str]:
    """The IPv4 and IPv6 addresses of this host's interfaces (loopback included)."""
    out: list[str] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _index, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                     struct.pack("256s", name[:15].encode()))
                out.append(socket.inet_ntoa(packed[20:24]))
    with contextlib.suppress(OSError), open("/proc/net/if_inet6") as f:
        for line in f:
            parts = line.split()
            if parts and parts[3] == "00":  # global scope only (not link-local)
                out.append(str(ipaddress.ip_address(bytes.fromhex(parts[0]))))
    return sorted(set(out))


def exposures(listeners: list[tuple[str, int]], addresses: list[str], host: str, *,
              timeout_s: float = 0.5) -> dict[int, list[str]]:
    """Port -> the non-loopback addresses other than ``host`` it accepts connections on."""
    chosen = {host}
    with contextlib.suppress(OSError):
        chosen |= {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    others = [a for a in addresses
              if a not in chosen and not ipaddress.ip_address(a).is_loopback]
    out: dict[int, list[str]] = {}
    for _bound, port in listeners:
        for addr in others:
            family = socket.AF_INET6 if ":" in addr else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.settimeout(timeout_s)
                if s.connect_ex((addr, port)) == 0:
                    out.setdefault(port, []).append(addr)
    return out


def probe(host: str) -> dict[str, Any]:
    """Start a transfer engine on ``host`` and report where it listens (child process)."""
    from ..transfer_engine import MooncakeTransferEngine

    before = set(own_listeners())
    engine = MooncakeTransferEngine(host, "tcp")
    mine = [x for x in own_listeners() if x not in before]
    exposed = exposures(mine, local_addresses(), host)
    return {"host": host, "rpc_port": engine.rpc_port, "listeners": mine,
            "exposed": {str(k): v for k, v in exposed.items()},
            "bind_env": os.environ.get("MC_TCP_BIND_ADDRESS", "")}


def transfer_protocol(kv_config: Any) -> str:
    """The transfer protocol a ``kv_transfer_config`` runs: its (or a MultiConnector child's)
    ``protocol`` option, else ``VLLM_ASCEND_KV_PROTOCOL``; ``""``: the device's default."""
    extra = kv_config.get("kv_connector_extra_config") if isinstance(kv_config, dict) else None
    extras = [extra] if isinstance(extra, dict) else []
    if extras and isinstance(extras[0].get("connectors"), list):
        extras += [c.get("kv_connector_extra_config") or {}
                   for c in extras[0]["connectors"] if isinstance(c, dict)]
    for ex in extras:
        if isinstance(ex, dict) and isinstance(ex.get("protocol"), str) and ex["protocol"]:
            return str(ex["protocol"]).strip().lower()
    from ..transfer_engine import PROTOCOL_ENV

    return os.environ.get(PROTOCOL_ENV, "").strip().lower()


def check(doctor: Any, host: str, *, timeout_s: float = 30.0,
          keyed: bool | None = None) -> None:
    """Run :func:`probe` in a child and report through ``doctor.ok`` / ``warn`` / ``fail``
    (``fail`` for an exposed port when a deployment key is set: ``keyed``, default from the
    environment). Under protocol ``local`` (:func:`transfer_protocol` of ``doctor``'s
    ``kv_config``) nothing is probed: no Mooncake port is opened."""
    what = "Mooncake ports reachable"
    if transfer_protocol(getattr(doctor, "kv_config", None)) == local_protocol.LOCAL_PROTOCOL:
        doctor.ok(what, "protocol local: no Mooncake transfer engine is started and no "
                        "Mooncake port is opened (D reads P's KV from P's memory on this "
                        "host; not probed)")
        return
    keyed = auth.configured() if keyed is None else keyed
    try:
        proc = subprocess.run([sys.executable, "-m", __name__, host], capture_output=True,
                              text=True, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        doctor.warn(what, f"the probe engine on {host} did not start within {timeout_s:g} s",
                    "run doctor again; check MC_* variables")
        return
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        doctor.warn(what, f"not probed: a transfer engine could not start on {host}: {tail}",
                    "install the [cpu]/[npu] extra of ascend-kv-core, or skip the probe with "
                    "--no-listener-probe")
        return
    report = json.loads(lines[-1])
    exposed = report["exposed"]
    listening = ", ".join(f"{a}:{p}" for a, p in report["listeners"]) or "nothing"
    checked = ("(checked: a probe engine doctor started on the advertised address as a "
               "connector does, not the running instance's)")
    if exposed:
        where = "; ".join(f"port {p} on {', '.join(addrs)}" for p, addrs in exposed.items())
        detail = (f"an engine started on {host} listens on {listening} and accepts "
                  f"connections on other interfaces: {where}. Anyone who reaches them can "
                  f"read or write registered KV memory{', key or no key' if keyed else ''} "
                  f"{checked}")
        fix = ("firewall the transfer engine's ports to the deployment's private network, "
               "or run the instance in its own network namespace (Mooncake binds them on "
               "every interface whatever MC_TCP_BIND_ADDRESS says); see docs/security.md")
        if keyed:
            doctor.fail(what, detail, fix)
        else:
            doctor.warn(what, detail, fix)
    else:
        doctor.ok(what, f"an engine started on {host} listens on {listening}; reachable "
                        f"through no other interface of this host {checked}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m ...doctor_listeners HOST", file=sys.stderr)
        return 2
    print(json.dumps(probe(args[0])), flush=True)
    os._exit(0)  # no engine teardown: the ports close with the process


if __name__ == "__main__":
    sys.exit(main())
