# SPDX-License-Identifier: Apache-2.0
"""Protocol ``local`` (:mod:`core.local_protocol`): the transfer-engine wrapper without a
Mooncake engine. It opens no port, records registrations, reads a real same-host process
with ``process_vm_readv`` and refuses, with the protocol's message, every peer it cannot read
that way; a Mooncake engine (a fake one here) never dials a ``local`` session."""

from __future__ import annotations

import ctypes
import errno
import os
import types
from collections.abc import Callable
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.core import local_protocol, local_reads, own_sockets
from vllm_ascend.distributed.kv_transfer.core import transfer_engine as te_mod
from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError, TransferError
from vllm_ascend.distributed.kv_transfer.core.local_reads import host_identity
from vllm_ascend.distributed.kv_transfer.core.transfer_engine import MooncakeTransferEngine

pytestmark = pytest.mark.skipif(not local_reads.available(),
                                reason="process_vm_readv needs Linux 3.2 or later")

@pytest.fixture(scope="module")
def child(child: tuple[int, int]) -> tuple[int, int]:
    """conftest's child process, once the kernel lets this process read it."""
    addr, pid = child
    try:
        out = ctypes.create_string_buffer(1)
        local_reads.read_from(pid, [ctypes.addressof(out)], [addr], [1])
    except local_reads.LocalReadError as exc:
        if exc.errno == errno.EPERM:
            pytest.skip("the kernel refuses process_vm_readv here (Yama ptrace_scope or no "
                        "ptrace rights over a child)")
        raise
    return child


def _no_mooncake(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError("protocol local imported Mooncake")


@pytest.fixture
def local(monkeypatch: pytest.MonkeyPatch) -> MooncakeTransferEngine:
    monkeypatch.setattr(te_mod, "optional_dependency", _no_mooncake)
    return MooncakeTransferEngine("127.0.0.1", local_protocol.LOCAL_PROTOCOL)


def test_it_starts_no_mooncake_engine_and_opens_no_port(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(te_mod, "optional_dependency", _no_mooncake)
    before = own_sockets.listening_ports()
    a = MooncakeTransferEngine("127.0.0.1", "local")
    b = MooncakeTransferEngine("127.0.0.1", "local")
    assert own_sockets.listening_ports() == before
    assert a.listen_ports == set() and a.rpc_port == 0
    with pytest.raises(TransferError, match="needs a Mooncake transfer engine"):
        _ = a.raw
    # unique per process (and per engine), and still "host:port"-shaped for the code that
    # takes the host off the left of the last colon
    assert a.session_id != b.session_id
    host, _, port = a.session_id.rpartition(":")
    assert host == "127.0.0.1" and port.startswith(f"local-{os.getpid()}-")
    assert local_protocol.is_local_session(a.session_id)
    assert not local_protocol.is_local_session("127.0.0.1:15001")


def test_registrations_are_recorded_and_counted(local: MooncakeTransferEngine) -> None:
    buf = ctypes.create_string_buffer(8192)
    base = ctypes.addressof(buf)
    assert local.register_memory(base, 8192)
    assert not local.register_memory(base, 8192)  # the same range again: a reference
    assert local.register_memory(base + 4096, 8192)  # overlapping: only the new part
    assert local.registered_bytes == 12288 and local.registrations == 3
    assert local.unregister_memory(base, 8192) and local.registered_bytes == 12288
    assert local.unregister_memory(base, 8192)
    assert local.unregister_memory(base + 4096, 8192)
    assert local.registered_bytes == 0 and local.registrations == 0


def test_a_same_host_peer_is_read_from_its_memory(local: MooncakeTransferEngine,
                                                  child: tuple[int, int],
        child_bytes: Callable[[int, int], bytes]) -> None:
    addr, pid = child
    out = ctypes.create_string_buffer(8192)
    base = ctypes.addressof(out)
    assert local.add_local_peer("127.0.0.1:local-1-ab", host_identity(), pid)
    got = local.read("127.0.0.1:local-1-ab", [base, base + 4096], [addr + 7, addr + 4103],
                     [4096, 4096])
    assert got == 8192 and out.raw == child_bytes(7, 8192)
    assert (local.stats.reads, local.stats.local_reads, local.stats.bytes_read_local) == (
        1, 1, 8192)
    # never polled asynchronously: there is no engine to poll
    assert local.submit_read("127.0.0.1:local-1-ab", [base], [addr], [64]) is None


@pytest.mark.parametrize("why", ["another host", "offers no host", "this process"])
def test_a_peer_that_is_not_same_host_readable_fails_with_the_protocols_message(
        local: MooncakeTransferEngine, child: tuple[int, int], why: str) -> None:
    addr, pid = child
    host, peer_pid = {"another host": ("another-boot/1", pid), "offers no host": ("", 0),
                      "this process": (host_identity(), os.getpid())}[why]
    out = ctypes.create_string_buffer(64)
    assert not local.add_local_peer("10.0.0.9:15001", host, peer_pid)
    with pytest.raises(TransferError, match="protocol local moves KV only between processes "
                                            "on one host.*use tcp/rdma across hosts"):
        local.read("10.0.0.9:15001", [ctypes.addressof(out)], [addr], [64])
    assert out.raw == b"\0" * 64 and local.stats.failures == 1 and local.stats.reads == 0


def test_a_read_the_kernel_refuses_fails_and_the_peer_is_forgotten(
        local: MooncakeTransferEngine, child: tuple[int, int]) -> None:
    addr, pid = child
    out = ctypes.create_string_buffer(64)
    assert local.add_local_peer("p:local-2-cd", host_identity(), pid)
    # an address the child never mapped: EFAULT
    with pytest.raises(TransferError, match=r"Bad address.*protocol local moves KV only"):
        local.read("p:local-2-cd", [ctypes.addressof(out)], [8], [64])
    assert not local.is_local_peer("p:local-2-cd")
    with pytest.raises(TransferError, match="protocol local"):  # no engine to fall back on
        local.read("p:local-2-cd", [ctypes.addressof(out)], [addr], [64])


def test_writes_are_refused(local: MooncakeTransferEngine, child: tuple[int, int]) -> None:
    addr, pid = child
    out = ctypes.create_string_buffer(64)
    assert local.add_local_peer("p:local-3-ef", host_identity(), pid)
    with pytest.raises(TransferError, match="never writes into a peer"):
        local.write("p:local-3-ef", [ctypes.addressof(out)], [addr], [64])


def test_the_protocol_needs_same_host_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(te_mod, "optional_dependency", _no_mooncake)
    monkeypatch.setenv(local_reads.LOCAL_READS_ENV, "0")
    with pytest.raises(ConfigError, match="VLLM_ASCEND_KV_LOCAL_READS=0"):
        MooncakeTransferEngine("127.0.0.1", "local")


class _Engine:
    """``mooncake.engine.TransferEngine``, recording what it is asked to read."""

    def __init__(self) -> None:
        self.reads: list[str] = []

    def initialize(self, *args: Any) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 17000

    def batch_transfer_sync_read(self, peer: str, *args: Any) -> int:
        self.reads.append(peer)
        return 0


def test_a_tcp_engine_reads_a_local_peer_from_its_memory_and_never_dials_it(
        monkeypatch: pytest.MonkeyPatch, child: tuple[int, int],
        child_bytes: Callable[[int, int], bytes]) -> None:
    """A D running tcp beside a P running local: P's memory, or a clear error."""
    monkeypatch.setattr(te_mod, "optional_dependency",
                        lambda *a, **k: types.SimpleNamespace(TransferEngine=_Engine))
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    tcp = MooncakeTransferEngine("127.0.0.1", "tcp")
    addr, pid = child
    out = ctypes.create_string_buffer(64)
    peer = "127.0.0.1:local-4-01"
    assert tcp.add_local_peer(peer, host_identity(), pid)
    assert tcp.read(peer, [ctypes.addressof(out)], [addr + 3], [64]) == 64
    assert out.raw == child_bytes(3, 64) and tcp.stats.local_reads == 1
    assert not tcp.add_local_peer(peer, "another-boot/1", pid)
    with pytest.raises(TransferError, match="runs protocol 'local' \\(no Mooncake port"):
        tcp.read(peer, [ctypes.addressof(out)], [addr], [64])
    assert tcp.submit_read(peer, [ctypes.addressof(out)], [addr], [64]) is None
    assert tcp.raw.reads == []  # Mooncake was never asked to dial it
