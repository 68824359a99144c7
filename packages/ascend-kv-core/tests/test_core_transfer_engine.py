# SPDX-License-Identifier: Apache-2.0
"""The transfer-engine wrapper with the real Mooncake engine over TCP on loopback."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import time
from typing import Any

import pytest
import torch

from ascend_kv_testing.peers import get_or_die, transfer_engine_target
from vllm_ascend.distributed.kv_transfer.core import transfer_engine as te_mod
from vllm_ascend.distributed.kv_transfer.core.errors import TransferError
from vllm_ascend.distributed.kv_transfer.core.transfer_engine import coalesce, get_transfer_engine

SIZE = 64 << 20


def test_coalesce_of_many_ranges_merges_as_the_python_loop_does() -> None:
    """From VECTOR_MIN_RANGES ranges coalesce merges with numpy: the same ranges as the
    loop (runs adjacent on both sides merged, empty ranges dropped, sorted by local)."""
    import random

    transfer_engine = te_mod
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(transfer_engine.VECTOR_MIN_RANGES, 200)
        loc = [rng.randrange(0, 64 * 64, 64) for _ in range(n)]
        rem = [a + rng.choice([0, 0, 0, 4096]) for a in loc]
        lens = [rng.choice([64, 64, 64, 0]) for _ in range(n)]
        fast = coalesce(loc, rem, lens)
        transfer_engine.VECTOR_MIN_RANGES, saved = 1 << 30, transfer_engine.VECTOR_MIN_RANGES
        try:
            assert coalesce(loc, rem, lens) == fast
        finally:
            transfer_engine.VECTOR_MIN_RANGES = saved
    with pytest.raises(ValueError):
        coalesce([0] * 40, [0] * 40, [-1] * 40)


def test_coalesce_merges_only_ranges_adjacent_on_both_sides() -> None:
    loc, rem, n = coalesce([0, 16, 48, 32], [100, 116, 200, 132], [16, 16, 8, 16])
    assert (loc, rem, n) == ([0, 48], [100, 200], [48, 8])
    assert coalesce([], [], []) == ([], [], [])
    with pytest.raises(ValueError, match="differ in length"):
        coalesce([1], [], [])
    with pytest.raises(ValueError, match="negative"):
        coalesce([1], [2], [-1])


@pytest.fixture(scope="module")
def peer() -> Any:
    ctx = mp.get_context("spawn")
    q_out, q_in = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=transfer_engine_target, args=(q_out, q_in, SIZE), daemon=True)
    proc.start()
    info = get_or_die(q_out, proc, 120)
    yield proc, q_out, q_in, info
    q_in.put("bye")
    proc.join(10)
    if proc.is_alive():
        proc.kill()


def test_64mib_read_and_write_arrive_intact(peer: Any) -> None:
    proc, q_out, q_in, (session, src_addr, dst_addr, digest) = peer
    te = get_transfer_engine("127.0.0.1", "tcp")
    local = torch.zeros(SIZE, dtype=torch.uint8)
    before = te.registered_bytes
    read_before = te.stats.bytes_read
    assert te.register_memory(local.data_ptr(), SIZE)
    assert not te.register_memory(local.data_ptr(), SIZE)  # once, even when asked twice
    assert not te.register_memory(local.data_ptr() + 4096, 4096)  # inside a registered range
    assert te.registered_bytes - before == SIZE
    # read in 1 MiB blocks, in shuffled order: coalescing must keep every byte in place
    block = 1 << 20
    order = torch.randperm(SIZE // block).tolist()
    start = time.perf_counter()
    moved = te.read(session, [local.data_ptr() + i * block for i in order],
                    [src_addr + i * block for i in order], [block] * len(order))
    elapsed = time.perf_counter() - start
    assert moved == SIZE
    assert hashlib.sha256(local.numpy().tobytes()).hexdigest() == digest
    # and write it back into the peer's second buffer
    assert te.write(session, [local.data_ptr()], [dst_addr], [SIZE]) == SIZE
    q_in.put("written")
    assert get_or_die(q_out, proc, 60) == digest
    assert te.stats.bytes_read - read_before == SIZE and elapsed > 0
    # reference counted: the memory stays registered while any registration needs it
    assert te.unregister_memory(local.data_ptr(), SIZE)
    assert te.unregister_memory(local.data_ptr(), SIZE)
    assert te.registered_bytes - before == SIZE  # the inner range still needs the segment
    assert te.unregister_memory(local.data_ptr() + 4096)
    assert te.registered_bytes == before
    assert not te.unregister_memory(local.data_ptr())


def test_overlapping_ranges_register_only_the_gaps(peer: Any) -> None:
    _proc, _q_out, _q_in, (session, src_addr, _dst, _digest) = peer
    te = get_transfer_engine("127.0.0.1", "tcp")
    buf = torch.zeros(3 << 20, dtype=torch.uint8)
    p, mib = buf.data_ptr(), 1 << 20
    before = te.registered_bytes
    assert te.register_memory(p, 2 * mib)
    assert te.register_memory(p + mib, 2 * mib)  # overlaps the first: only the last MiB is new
    assert te.registered_bytes - before == 3 * mib
    # a read spanning both registrations works
    assert te.read(session, [p + mib], [src_addr], [2 * mib]) == 2 * mib
    assert te.unregister_memory(p) and te.unregister_memory(p + mib)
    assert te.registered_bytes == before


class _CountingEngine:
    """Forwards to the real Mooncake engine and records the size of every batch call
    (``read`` / ``write`` for the synchronous ones, ``async_read`` / ``async_write``)."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.calls: list[tuple[str, int]] = []

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.real, name)
        if not name.startswith("batch_transfer_"):
            return fn
        label = name.removeprefix("batch_transfer_").removeprefix("sync_")

        def call(peer: str, loc: Any, rem: Any, lens: Any) -> int:
            self.calls.append((label, len(loc)))
            return int(fn(peer, loc, rem, lens))
        return call


def test_batches_larger_than_max_batch_are_chunked(peer: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _proc, _q_out, _q_in, (session, src_addr, dst_addr, _digest) = peer
    te = get_transfer_engine("127.0.0.1", "tcp")
    counting = _CountingEngine(te.raw)
    monkeypatch.setattr(te, "_engine", counting)
    monkeypatch.setattr(te, "max_batch", 3)
    monkeypatch.setattr(te, "wait", "spin")  # Mooncake's synchronous call, one per chunk
    # 10 ranges of 4 KiB, every other 4 KiB on both sides: none can be coalesced
    n, size = 10, 4096
    local = torch.zeros(2 * n * size, dtype=torch.uint8)
    te.register_memory(local.data_ptr(), local.numel())
    try:
        offsets = [2 * i * size for i in range(n)]
        reads_before = te.stats.reads
        got = te.read(session, [local.data_ptr() + o for o in offsets],
                      [src_addr + o for o in offsets], [size] * n)
        assert got == n * size
        assert counting.calls == [("read", 3), ("read", 3), ("read", 3), ("read", 1)]
        assert te.stats.reads - reads_before == 1  # one logical read
        # the peer's source buffer is arange(int64): every range arrived, in place, the
        # gaps between them untouched
        src = torch.arange(SIZE // 8, dtype=torch.int64).view(torch.uint8)
        for o in offsets:
            assert torch.equal(local[o:o + size], src[o:o + size])
            assert not local[o + size:o + 2 * size].any()
        # writes are chunked the same way: a pattern written to non-adjacent ranges of the
        # peer's second buffer reads back intact
        counting.calls.clear()
        pattern = torch.randint(1, 255, (n * size,), dtype=torch.uint8)
        for i, o in enumerate(offsets):
            local[o:o + size] = pattern[i * size:(i + 1) * size]
        assert te.write(session, [local.data_ptr() + o for o in offsets],
                        [dst_addr + 8 * o for o in offsets], [size] * n) == n * size
        assert [c for c in counting.calls if c[0] == "write"] == [
            ("write", 3), ("write", 3), ("write", 3), ("write", 1)]
        local.zero_()
        assert te.read(session, [local.data_ptr() + o for o in offsets],
                       [dst_addr + 8 * o for o in offsets], [size] * n) == n * size
        for i, o in enumerate(offsets):
            assert torch.equal(local[o:o + size], pattern[i * size:(i + 1) * size])
        # yield (the default): every range a batch of its own, polled; the same bytes land
        monkeypatch.setattr(te, "wait", "yield")
        counting.calls.clear()
        local.zero_()
        assert te.read(session, [local.data_ptr() + o for o in offsets],
                       [src_addr + o for o in offsets], [size] * n) == n * size
        assert counting.calls == [("async_read", 1)] * n
        for o in offsets:
            assert torch.equal(local[o:o + size], src[o:o + size])
            assert not local[o + size:o + 2 * size].any()
        counting.calls.clear()
        assert te.write(session, [local.data_ptr() + o for o in offsets],
                        [dst_addr + 8 * o for o in offsets], [size] * n) == n * size
        assert counting.calls == [("async_write", 1)] * n
        # and Mooncake's own wait, asked for by the call, still is one call per chunk
        counting.calls.clear()
        assert te.read(session, [local.data_ptr()], [src_addr], [size], wait="spin") == size
        assert counting.calls == [("read", 1)]
    finally:
        te.unregister_memory(local.data_ptr())


def test_singleton_and_dead_peer_is_a_fast_clear_error() -> None:
    te = get_transfer_engine("127.0.0.1", "tcp")
    assert get_transfer_engine() is te
    buf = torch.zeros(4096, dtype=torch.uint8)
    te.register_memory(buf.data_ptr(), 4096)
    start = time.monotonic()
    with pytest.raises(TransferError, match="127.0.0.1:1") as info:
        te.read("127.0.0.1:1", [buf.data_ptr()], [0x1000], [4096])
    assert info.value.rc < 0 and info.value.op == "read"
    assert time.monotonic() - start < 10
    te.unregister_memory(buf.data_ptr())


class _WaitRecorder:
    """Forwards to the real Mooncake engine and records which calls a transfer made."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.real, name)
        if not name.startswith(("batch_transfer", "get_batch_transfer_status")):
            return fn

        def call(*args: Any) -> Any:
            self.calls.append(name)
            return fn(*args)
        return call


def test_with_sleep_large_batches_are_slept_on_and_small_ones_are_one_call(
        peer: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    _proc, _q_out, _q_in, (session, src_addr, dst, _digest) = peer
    te = get_transfer_engine("127.0.0.1", "tcp")
    rec = _WaitRecorder(te.raw)
    monkeypatch.setattr(te, "_engine", rec)
    big = te_mod.SLEEP_MIN_BYTES
    local = torch.zeros(2 * big, dtype=torch.uint8)
    src = torch.arange(SIZE // 8, dtype=torch.int64).view(torch.uint8)
    te.register_memory(local.data_ptr(), local.numel())
    assert te.wait == "yield"  # the default: every range polled, yielding between polls
    monkeypatch.setattr(te, "wait", "sleep")
    try:
        for _ in range(te_mod.RATE_WINDOW + 1):
            rec.calls.clear()
            local.zero_()
            assert te.read(session, [local.data_ptr()], [src_addr + 4096], [2 * big]) == 2 * big
            assert rec.calls == ["batch_transfer_async_read", "get_batch_transfer_status"]
            assert torch.equal(local, src[4096:4096 + 2 * big])
        # the rates timed replace the assumed one once the window is full
        rates = te._rates[("read", session)]
        assert len(rates) == te_mod.RATE_WINDOW and te_mod.INITIAL_RATE not in rates
        assert all(0 < r < te_mod.INITIAL_RATE for r in rates)
        # below the threshold: one synchronous call
        rec.calls.clear()
        assert te.read(session, [local.data_ptr()], [src_addr], [big - 4096]) == big - 4096
        assert rec.calls == ["batch_transfer_sync_read"]
        # a large write is slept on too, and lands intact
        rec.calls.clear()
        pattern = torch.randint(1, 255, (2 * big,), dtype=torch.uint8)
        local.copy_(pattern)
        assert te.write(session, [local.data_ptr()], [dst], [2 * big]) == 2 * big
        assert rec.calls == ["batch_transfer_async_write", "get_batch_transfer_status"]
        local.zero_()
        assert te.read(session, [local.data_ptr()], [dst], [2 * big]) == 2 * big
        assert torch.equal(local, pattern)
        # spin: every batch is one synchronous call, as Mooncake waits for it
        monkeypatch.setattr(te, "wait", "spin")
        rec.calls.clear()
        local.zero_()
        assert te.read(session, [local.data_ptr()], [src_addr], [2 * big]) == 2 * big
        assert rec.calls == ["batch_transfer_sync_read"]
        assert torch.equal(local, src[:2 * big])
    finally:
        te.unregister_memory(local.data_ptr())


def test_a_large_batch_to_a_dead_peer_is_a_fast_clear_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    te = get_transfer_engine("127.0.0.1", "tcp")
    monkeypatch.setattr(te, "wait", "sleep")
    n = te_mod.SLEEP_MIN_BYTES
    buf = torch.zeros(n, dtype=torch.uint8)
    te.register_memory(buf.data_ptr(), n)
    start = time.monotonic()
    try:
        for op in (te.read, te.write):
            with pytest.raises(TransferError, match="127.0.0.1:1") as info:
                op("127.0.0.1:1", [buf.data_ptr()], [0x1000], [n])
            assert info.value.rc < 0
        assert time.monotonic() - start < 20
    finally:
        te.unregister_memory(buf.data_ptr())


def test_an_unknown_wait_mode_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(te_mod.WAIT_ENV, "busy")
    with pytest.raises(ValueError, match="VLLM_ASCEND_KV_TE_WAIT='busy'"):
        te_mod.MooncakeTransferEngine("127.0.0.1", "tcp")
    te = get_transfer_engine("127.0.0.1", "tcp")
    with pytest.raises(ValueError, match="wait='busy'"):
        te.read("127.0.0.1:1", [0], [0], [1], wait="busy")


def _poll(pending: Any, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while True:
        got = pending.poll()
        if got is not None:
            return int(got)
        assert time.monotonic() < deadline, "the read did not end"
        time.sleep(0.0005)


def test_submit_read_polls_every_range_to_its_end(peer: Any) -> None:
    """Every range is in once poll says so (a big range behind a small one too: the status
    call Mooncake offers without blocking looks at a batch's first task only)."""
    _proc, _q_out, _q_in, (session, src_addr, _dst, _digest) = peer
    te = get_transfer_engine("127.0.0.1", "tcp")
    local = torch.zeros(SIZE, dtype=torch.uint8)
    te.register_memory(local.data_ptr(), SIZE)
    try:
        before = (te.stats.reads, te.stats.bytes_read)
        # P's last 4 KiB first, then all the rest (P's buffer holds 0, 1, 2 ... as int64)
        pending = te.submit_read(session, [local.data_ptr(), local.data_ptr() + 4096],
                                 [src_addr + SIZE - 4096, src_addr], [4096, SIZE - 4096])
        assert pending is not None and len(pending.batches) == 2
        assert _poll(pending) == SIZE and pending.done
        words = local.view(torch.int64)
        n = SIZE // 8
        assert torch.equal(words[:512], torch.arange(n - 512, n))
        assert torch.equal(words[512:], torch.arange(0, n - 512))
        assert pending.poll() == SIZE  # asked again: the same answer, counted once
        assert (te.stats.reads, te.stats.bytes_read) == (before[0] + 1, before[1] + SIZE)
        # adjacent ranges go out as one
        pending = te.submit_read(session, [local.data_ptr(), local.data_ptr() + 64],
                                 [src_addr, src_addr + 64], [64, 64])
        assert pending is not None and len(pending.batches) == 1 and _poll(pending) == 128
    finally:
        te.unregister_memory(local.data_ptr())


def test_submit_read_of_a_dead_peer_fails_clearly_and_same_host_peers_are_not_submitted(
        peer: Any) -> None:
    te = get_transfer_engine("127.0.0.1", "tcp")
    buf = torch.zeros(4096, dtype=torch.uint8)
    te.register_memory(buf.data_ptr(), 4096)
    failures = te.stats.failures
    try:
        start = time.monotonic()
        pending = te.submit_read("127.0.0.1:1", [buf.data_ptr()], [0x1000], [4096])
        assert pending is not None
        with pytest.raises(TransferError, match="127.0.0.1:1") as info:
            _poll(pending)
        assert info.value.op == "read" and info.value.rc < 0 and pending.done
        assert time.monotonic() - start < 10 and te.stats.failures == failures + 1
        with pytest.raises(TransferError):  # still failed when asked again, counted once
            pending.poll()
        assert te.stats.failures == failures + 1
        # a peer read from its memory on this host: read synchronously (read), not here
        _proc, _q_out, _q_in, (session, _src, _dst, _digest) = peer
        te._local_peers = {**te._local_peers, session: object()}  # type: ignore[dict-item]
        try:
            assert te.submit_read(session, [buf.data_ptr()], [0x1000], [4096]) is None
        finally:
            te.forget_local_peer(session)
    finally:
        te.unregister_memory(buf.data_ptr())
