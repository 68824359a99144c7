# SPDX-License-Identifier: Apache-2.0
"""The outsider of issue 51: a process in another network namespace, with no key and no role,
against a P's side channel and Mooncake's ports (the fault tests
``test_faults_mooncake_outsider.py`` and ``test_faults_outsider_local.py``).

:data:`OUTSIDER` is the outsider's script, run with :func:`run_in_netns`. Its arguments: P's
address, P's side-channel port, the outsider's own address, the bytes to read, and the
ports to try as JSON (a list of port numbers), or ``"scan"``: every TCP port of P's address
that accepts a connection (a port scan, 1-65535), P's side channel left out. It

1. asks P's side channel for P's metadata (``GetMeta``), as D would (``get_meta``: what
   came back);
2. for each port, asks Mooncake for the first buffer address of the segment
   ``<P's address>:<port>`` (``TransferEngine.get_first_buffer_address``) and, where it
   gets one, reads that many bytes there with a transfer engine of its own (``ports``: per
   port, the address, the read's return code, the bytes' sha256 and how many are not
   zero; ``scanned``: the open ports a scan found, side channel included).

It prints one JSON line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from vllm_ascend.distributed.kv_transfer.core import auth

#: the outsider's run, at most (seconds)
OUTSIDER_TIMEOUT_S = 120

OUTSIDER = r"""
import ctypes, hashlib, json, socket, sys
from vllm_ascend.distributed.kv_transfer.core.channel import RpcClient
from vllm_ascend.distributed.kv_transfer.core.errors import KVTransferError, RemoteError
from vllm_ascend.distributed.kv_transfer.kv_p2p.protocol import CODEC, GetMeta

p_host, side_port, me, nbytes = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
out = {"get_meta": "", "ports": {}}
if sys.argv[5] == "scan":
    found = []
    for port in range(1, 65536):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            if s.connect_ex((p_host, port)) == 0:
                found.append(port)
    out["scanned"] = found
    ports = [p for p in found if p != side_port]
else:
    ports = json.loads(sys.argv[5])
client = RpcClient(f"tcp://{p_host}:{side_port}", CODEC, timeout_s=5, auth=None)
try:
    reply = client.call(GetMeta(requester="outsider"))
    out["get_meta"] = "answered " + type(reply).__name__
except RemoteError as exc:
    out["get_meta"] = f"refused: {exc.code}"
except KVTransferError as exc:
    out["get_meta"] = f"no answer: {exc}"
client.close()
if ports:
    from mooncake.engine import TransferEngine

    te = TransferEngine()
    assert te.initialize(me, "P2PHANDSHAKE", "tcp", "") == 0
    buf = ctypes.create_string_buffer(nbytes)
    assert te.register_memory(ctypes.addressof(buf), nbytes) == 0
for port in ports:
    segment = f"{p_host}:{port}"
    try:
        addr = int(te.get_first_buffer_address(segment))
    except Exception as exc:
        out["ports"][port] = {"error": f"{type(exc).__name__}: {exc}"}
        continue
    got = {"address": addr}
    if addr:
        rc = te.transfer_sync_read(segment, ctypes.addressof(buf), addr, nbytes)
        got["read_rc"] = rc
        if rc == 0:
            got["sha256"] = hashlib.sha256(buf.raw).hexdigest()
            got["nonzero"] = sum(1 for b in buf.raw if b)
    out["ports"][port] = got
print(json.dumps(out), flush=True)
"""


def netns_env(ns_host: str, key: str | None) -> list[str]:
    """``env`` arguments of a child in a namespace: the addresses it binds and advertises,
    the deployment key or none."""
    hosts = {"VLLM_HOST_IP": ns_host, "VLLM_ASCEND_KV_HOST": ns_host,
             "MC_TCP_BIND_ADDRESS": ns_host, "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": ns_host,
             "PYTHONPATH": os.pathsep.join(sys.path)}
    args = [f"--unset={v}" for v in (auth.ENV_KEY_FILE, auth.ENV_ALLOW_UNAUTHENTICATED)]
    args += [f"{k}={v}" for k, v in hosts.items()]
    args += [f"{auth.ENV_KEY}={key}"] if key else [f"--unset={auth.ENV_KEY}"]
    return args


def run_in_netns(ns: str, host: str, key: str | None, script: str, *args: str,
                 timeout_s: float = OUTSIDER_TIMEOUT_S) -> dict[str, Any]:
    """Run ``script`` (Python) in namespace ``ns`` as :func:`netns_env` says; the JSON object
    of its last output line."""
    res = subprocess.run(["ip", "netns", "exec", ns, "env", *netns_env(host, key),
                          sys.executable, "-c", script, *args],
                         capture_output=True, text=True, timeout=timeout_s, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]
