# SPDX-License-Identifier: Apache-2.0
"""Same-host reads (:mod:`core.local_reads`) from a real child process's memory, and the
transfer-engine wrapper's use of them: a same-host peer is copied from directly, a refused
read goes over the engine (a fake one here) and the peer is then read that way for good."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import subprocess
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest

from vllm_ascend.distributed.kv_transfer.core import local_reads
from vllm_ascend.distributed.kv_transfer.core import transfer_engine as te_mod
from vllm_ascend.distributed.kv_transfer.core.local_reads import (
    LOCAL_READS_ENV,
    LocalReadError,
    host_identity,
    read_from,
)
from vllm_ascend.distributed.kv_transfer.core.transfer_engine import MooncakeTransferEngine

pytestmark = pytest.mark.skipif(not local_reads.available(),
                                reason="process_vm_readv needs Linux 3.2 or later")

def _read_or_skip(pid: int, local: list[int], remote: list[int], lengths: list[int]) -> int:
    try:
        return read_from(pid, local, remote, lengths)
    except LocalReadError as exc:
        if exc.errno == errno.EPERM:
            pytest.skip("the kernel refuses process_vm_readv here (Yama ptrace_scope or no "
                        "ptrace rights over a child)")
        raise


def test_reads_scattered_ranges_of_another_process(child: tuple[int, int],
        child_bytes: Callable[[int, int], bytes]) -> None:
    addr, pid = child
    out = ctypes.create_string_buffer(1 << 20)
    base = ctypes.addressof(out)
    ranges = [(0, 4096), (10_000, 1), (500_000, 70_000), (1_048_000, 576)]
    got = _read_or_skip(pid, [base + off for off, _ in ranges],
                        [addr + off for off, _ in ranges], [n for _, n in ranges])
    assert got == sum(n for _, n in ranges)
    for off, n in ranges:
        assert out.raw[off:off + n] == child_bytes(off, n)
    assert out.raw[4096:10_000] == b"\0" * (10_000 - 4096)  # nothing else was written


def test_more_ranges_than_one_call_takes(child: tuple[int, int],
        child_bytes: Callable[[int, int], bytes]) -> None:
    addr, pid = child
    n = local_reads.IOV_MAX * 2 + 5
    out = ctypes.create_string_buffer(n * 16)
    base = ctypes.addressof(out)
    # every other 16-byte piece of the child's buffer, packed here
    got = _read_or_skip(pid, [base + 16 * i for i in range(n)],
                        [addr + 32 * i for i in range(n)], [16] * n)
    assert got == n * 16
    for i in (0, local_reads.IOV_MAX, n - 1):
        assert out.raw[16 * i:16 * i + 16] == child_bytes(32 * i, 16)


def test_unmapped_remote_memory_and_a_dead_pid_are_errors(child: tuple[int, int]) -> None:
    addr, pid = child
    out = ctypes.create_string_buffer(64)
    _read_or_skip(pid, [ctypes.addressof(out)], [addr], [64])  # allowed here at all
    with pytest.raises(LocalReadError) as info:
        read_from(pid, [ctypes.addressof(out)], [8], [64])  # page 0 is never mapped
    assert info.value.errno == errno.EFAULT
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    with pytest.raises(LocalReadError) as info:
        read_from(int(dead.stdout), [ctypes.addressof(out)], [addr], [64])
    assert info.value.errno == errno.ESRCH
    with pytest.raises(ValueError, match="differ in length"):
        read_from(pid, [1], [2, 3], [4])


def test_identity_is_off_with_the_env(monkeypatch: pytest.MonkeyPatch) -> None:
    assert host_identity()  # Linux with /proc
    for off in ("0", "off", "False"):
        monkeypatch.setenv(LOCAL_READS_ENV, off)
        assert host_identity() == ""


# ------------------------------------------------------------ the wrapper


class _Engine:
    """``mooncake.engine.TransferEngine`` as far as reads go: records and fills with 0xEE."""

    def __init__(self) -> None:
        self.reads: list[tuple[str, list[int], list[int], list[int]]] = []

    def initialize(self, *args: Any) -> int:
        return 0

    def get_rpc_port(self) -> int:
        return 17000

    def batch_transfer_sync_read(self, peer: str, loc: list[int], rem: list[int],
                                 lens: list[int]) -> int:
        self.reads.append((peer, loc, rem, lens))
        for a, n in zip(loc, lens, strict=True):
            ctypes.memset(a, 0xEE, n)
        return 0


@pytest.fixture
def engine(monkeypatch: pytest.MonkeyPatch) -> MooncakeTransferEngine:
    monkeypatch.setattr(te_mod, "optional_dependency",
                        lambda *a, **k: types.SimpleNamespace(TransferEngine=_Engine))
    monkeypatch.setenv(te_mod.TCP_PROGRESS_TIMEOUT_ENV, "5")
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    return MooncakeTransferEngine("127.0.0.1", "tcp")


def test_a_same_host_peer_is_read_from_its_memory(engine: MooncakeTransferEngine,
                                                  child: tuple[int, int],
        child_bytes: Callable[[int, int], bytes]) -> None:
    addr, pid = child
    out = ctypes.create_string_buffer(8192)
    base = ctypes.addressof(out)
    _read_or_skip(pid, [base], [addr], [1])
    assert engine.add_local_peer("127.0.0.1:1", host_identity(), pid)
    assert engine.is_local_peer("127.0.0.1:1")
    # two adjacent ranges: coalesced into one
    got = engine.read("127.0.0.1:1", [base, base + 4096], [addr + 100, addr + 4196],
                      [4096, 4096])
    assert got == 8192 and out.raw == child_bytes(100, 8192)
    assert engine.raw.reads == []  # not through the engine
    assert (engine.stats.reads, engine.stats.local_reads) == (1, 1)
    assert engine.stats.bytes_read == engine.stats.bytes_read_local == 8192


def test_peers_of_another_host_or_this_process_are_not_local(
        engine: MooncakeTransferEngine, child: tuple[int, int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    _addr, pid = child
    assert not engine.add_local_peer("p:1", "another-boot/1", pid)
    assert not engine.add_local_peer("p:1", "", pid)
    assert not engine.add_local_peer("p:1", host_identity(), 0)
    assert not engine.add_local_peer("p:1", host_identity(), os.getpid())
    assert engine.add_local_peer("p:1", host_identity(), pid)
    assert engine.add_local_peer("p:1", host_identity(), pid)  # again: still the same
    assert engine.is_local_peer("p:1")
    monkeypatch.setenv(LOCAL_READS_ENV, "0")  # off here: no peer is ever local
    assert not engine.add_local_peer("p:1", host_identity(), pid)
    assert not engine.is_local_peer("p:1")  # what holds now wins over the earlier answer
    monkeypatch.delenv(LOCAL_READS_ENV)
    assert engine.add_local_peer("p:1", host_identity(), pid)
    assert not engine.add_local_peer("p:1", "", 0)  # the peer (restarted) offers nothing now
    assert not engine.is_local_peer("p:1")


def test_a_refused_read_goes_over_the_engine_and_the_peer_stays_there(
        engine: MooncakeTransferEngine, child: tuple[int, int],
        caplog: pytest.LogCaptureFixture) -> None:
    addr, pid = child
    out = ctypes.create_string_buffer(64)
    base = ctypes.addressof(out)
    assert engine.add_local_peer("127.0.0.1:1", host_identity(), pid)
    with caplog.at_level(logging.WARNING, logger=te_mod.__name__):
        # an address the child never mapped: the kernel says EFAULT
        assert engine.read("127.0.0.1:1", [base], [8], [64]) == 64
    assert "over the transfer engine from now on" in caplog.text
    assert engine.raw.reads == [("127.0.0.1:1", [base], [8], [64])]
    assert out.raw == b"\xee" * 64
    assert not engine.is_local_peer("127.0.0.1:1")
    engine.read("127.0.0.1:1", [base], [addr], [64])  # a good address: still the engine
    assert len(engine.raw.reads) == 2 and engine.stats.local_reads == 0


def test_a_peer_read_counts_only_while_the_process_lives(child: tuple[int, int],
        child_bytes: Callable[[int, int], bytes]) -> None:
    addr, pid = child
    out = ctypes.create_string_buffer(64)
    _read_or_skip(pid, [ctypes.addressof(out)], [addr], [64])
    peer = local_reads.Peer(pid)
    assert peer.alive()
    assert peer.read([ctypes.addressof(out)], [addr + 64], [64]) == 64
    assert out.raw == child_bytes(64, 64)
    peer.close()
    assert not peer.alive()  # its descriptor is gone: never taken for alive
    with pytest.raises(LocalReadError) as info:
        peer.read([ctypes.addressof(out)], [addr], [64])
    assert info.value.errno == errno.ESRCH
    # a process that exited: its pid names nobody, and a descriptor opened while it lived
    # says so after its pid was read
    waits = "import os, sys; print(os.getpid(), flush=True); sys.stdin.read()"
    proc = subprocess.Popen([sys.executable, "-c", waits], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdin is not None
    pid2 = int(proc.stdout.readline())
    gone = local_reads.Peer(pid2)
    proc.stdin.close()
    proc.wait(10)
    proc.stdout.close()
    assert not gone.alive()
    with pytest.raises(LocalReadError):
        local_reads.Peer(pid2)
