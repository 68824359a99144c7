# SPDX-License-Identifier: Apache-2.0
"""Transfer protocol ``local``: KV moved between processes of one host, no Mooncake engine.

Mooncake 0.3.x's transfer engine listens on every interface (its RPC/handshake port and its
TCP transport's port) and hands anyone who reaches the RPC port the address of a registered
buffer, which that anyone can then read (``docs/security.md``). Under protocol ``local``
(``VLLM_ASCEND_KV_PROTOCOL=local`` or the P/D connectors' ``protocol`` option) the
process's transfer-engine wrapper
(:class:`~vllm_ascend.distributed.kv_transfer.core.transfer_engine.MooncakeTransferEngine`)
starts **no** Mooncake engine and opens no port: registering memory only records it, and a
peer is read with :mod:`.local_reads` (``process_vm_readv``) or not at all.

This module holds what both sides of that need: the session name such an engine gives its
peers (``<host>:local-<pid>-<random>``: unique per process, still ``host:port``-shaped for
code that takes the host off the left of the last ``:``), how a Mooncake engine recognizes
a peer that has no Mooncake engine to dial (:func:`is_local_session`), and the errors.

Limits: one host only (a peer elsewhere, or one that advertises no host identity, fails its
transfer with :func:`not_readable`'s message: vLLM then recomputes or fails the request as
its policy says); KV caches in host memory only (an NPU or CUDA KV cache is refused at
start, :func:`refuse_device_kv`); ``process_vm_readv`` needs ``ptrace`` rights over the peer
(the same user, and Yama ``ptrace_scope`` 0, or ``CAP_SYS_PTRACE``); D reads, nothing is
written into a peer (the layerwise connector, whose P writes into D, refuses to start).
"""

from __future__ import annotations

import os
import secrets

from . import local_reads
from .errors import ConfigError, TransferError

#: the protocol's name (``VLLM_ASCEND_KV_PROTOCOL`` and the connectors' ``protocol`` option)
LOCAL_PROTOCOL = "local"
#: what the port part of such an engine's session starts with
SESSION_TAG = "local-"
_SCOPE = ("protocol local moves KV only between processes on one host, with their KV caches "
          "in host memory; use tcp/rdma across hosts")


def session_name(hostname: str) -> str:
    """The session an engine of protocol ``local`` gives its peers: unique per process
    (pid, and random bytes for pid namespaces that reuse the number)."""
    return f"{hostname}:{SESSION_TAG}{os.getpid()}-{secrets.token_hex(4)}"


def is_local_session(session: str) -> bool:
    """Whether ``session`` names an engine of protocol ``local`` (no port to dial)."""
    return session.rpartition(":")[2].startswith(SESSION_TAG)


def refuse_unavailable() -> None:
    """Raise :class:`ConfigError` unless this process can read same-host peers.

    Raises:
        ConfigError: same-host reads are off (``VLLM_ASCEND_KV_LOCAL_READS``) or this
            system lacks ``process_vm_readv``/pid file descriptors.
    """
    if not local_reads.enabled():
        raise ConfigError(
            f"protocol {LOCAL_PROTOCOL!r} moves KV with same-host reads, which "
            f"{local_reads.LOCAL_READS_ENV}=0 turns off: unset it or use another protocol",
            key=local_reads.LOCAL_READS_ENV, value="0", source="environment")
    if not local_reads.available():
        raise ConfigError(
            f"protocol {LOCAL_PROTOCOL!r} needs process_vm_readv and pid file descriptors "
            "(Linux 5.3 or later), which this system lacks: use tcp",
            key="protocol", value=LOCAL_PROTOCOL)


def refuse_device_kv(who: str) -> None:
    """Raise the :class:`ConfigError` of a KV cache in device memory under ``local``."""
    raise ConfigError(
        f"{who}: protocol {LOCAL_PROTOCOL!r} cannot move a KV cache in device memory (NPU or "
        f"CUDA; process_vm_readv reads host memory only): {_SCOPE}, use the device's "
        "protocol (ascend, rdma) for this instance", key="protocol", value=LOCAL_PROTOCOL)


def refuse_writes(who: str) -> None:
    """Raise the :class:`ConfigError` of a connector that writes into its peers."""
    raise ConfigError(
        f"{who}: protocol {LOCAL_PROTOCOL!r} only reads peers on this host, it does not "
        "write into them (the layerwise push writes into D's blocks): use "
        "MooncakeConnectorV1 (D pulls) with protocol local, or tcp/rdma/ascend",
        key="protocol", value=LOCAL_PROTOCOL)


def not_readable(op: str, peer: str, protocol: str, why: str = "") -> TransferError:
    """The error of a transfer with ``peer`` that no same-host read can serve, ``why``: the
    kernel's refusal (if it was asked)."""
    direction = "from" if op == "read" else "to"
    if protocol == LOCAL_PROTOCOL:
        what = (f"this engine runs protocol {LOCAL_PROTOCOL!r} (no Mooncake engine) and "
                f"{peer} is not a process on this host it may read")
    else:
        what = (f"{peer} runs protocol {LOCAL_PROTOCOL!r} (no Mooncake port to reach) and is "
                "not a process on this host this one may read")
    if op != "read":
        what += "; protocol local never writes into a peer"
    return TransferError(f"{op} {direction} {peer} failed: {what}{f' ({why})' if why else ''}"
                         f": {_SCOPE}", op=op, peer=peer)


def no_engine(use: str) -> TransferError:
    """The error of something that needs the Mooncake engine itself (``use``) under
    ``local``."""
    return TransferError(f"{use} needs a Mooncake transfer engine, and protocol "
                         f"{LOCAL_PROTOCOL!r} starts none: use tcp/rdma/ascend for it",
                         op="engine")
