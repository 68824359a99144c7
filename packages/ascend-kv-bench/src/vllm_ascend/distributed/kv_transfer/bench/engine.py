# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench engine``: the Mooncake transfer engine alone, the connectors' ceiling.

Two processes, as in a P/D deployment: a *target* process (spawned) owns a
registered buffer filled with a known pattern; this process (the *initiator*)
registers its own buffer and moves blocks with the raw
``batch_transfer_sync_read`` / ``batch_transfer_sync_write`` calls of
``mooncake.engine.TransferEngine`` (no wrapper in the timed path, so nothing
is coalesced: every block is one descriptor, as KV blocks scattered over a
cache are). The sweep is block size x batch (descriptors per call) x
concurrency (threads submitting at once, each on its own slice of both
buffers), for reads and writes. Blocks sit at random, non-adjacent slots.

Reported per point: GB/s (bytes moved by all threads / wall time), median and
99th-percentile latency of one batch call. Before the sweep, one read and one
write of every block size are checked byte for byte. The connector benchmarks
(``bench p2p``, ``bench pool``) quote their ratio against a raw engine call
measured in their own run; this sweep is the map of what that engine does on
the machine.

Writes ``<out>/engine.json`` and prints a table; never fails on a number.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import random
import statistics
import threading
import time
from dataclasses import dataclass
from typing import Any

from .benchutil import add_common_args, format_table, progress, write_results

logger = logging.getLogger(__name__)

KIB = 1024
MIB = 1024 * KIB
FULL_BLOCK_SIZES = (16 * KIB, 64 * KIB, 256 * KIB, 1 * MIB, 4 * MIB)
FULL_BATCHES = (1, 8, 64)
FULL_CONCURRENCY = (1, 2, 4)
QUICK_BLOCK_SIZES = (64 * KIB, 1 * MIB)
QUICK_BATCHES = (1, 16)
QUICK_CONCURRENCY = (1, 2)
#: Bytes of each side's registered buffer.
DEFAULT_BUFFER_MIB = 256
QUICK_BUFFER_MIB = 64


def _pattern(nbytes: int) -> Any:
    import numpy as np

    off = np.arange(nbytes, dtype=np.int64)
    return ((off * 7 + off // 4099) % 251).astype(np.uint8)


# ---------------------------------------------------------------------- target
def target_process(host: str, protocol: str, nbytes: int, conn: Any) -> None:
    """The remote side: a registered, patterned buffer, until told to stop."""
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
    try:
        from vllm_ascend.distributed.kv_transfer.core.transfer_engine import MooncakeTransferEngine

        buf = _pattern(nbytes)
        te = MooncakeTransferEngine(host, protocol)
        te.register_memory(int(buf.ctypes.data), nbytes)
        conn.send(("ready", te.session_id, int(buf.ctypes.data)))
    except Exception as exc:  # the parent reports it
        conn.send(("error", f"{type(exc).__name__}: {exc}", 0))
        return
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        if isinstance(msg, tuple) and msg[0] == "crc":
            import zlib

            _op, off, length = msg
            conn.send(zlib.crc32(buf[off:off + length].tobytes()))
    te.unregister_memory(int(buf.ctypes.data))
    conn.send("stopped")


class Target:
    """The spawned target process and its pipe."""

    def __init__(self, host: str, protocol: str, nbytes: int, timeout: float = 60.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target_process, args=(host, protocol, nbytes, child),
                                daemon=True)
        self.proc.start()
        if not self.conn.poll(timeout):
            self.close()
            raise TimeoutError(f"the target transfer engine did not start within {timeout}s")
        status, session, base = self.conn.recv()
        if status != "ready":
            self.close()
            raise RuntimeError(f"the target transfer engine failed: {session}")
        self.session: str = session
        self.base: int = base

    def crc(self, offset: int, length: int) -> int:
        """CRC32 of the target's bytes ``[offset, offset + length)``."""
        self.conn.send(("crc", offset, length))
        if not self.conn.poll(30):
            raise TimeoutError("the target did not answer")
        return int(self.conn.recv())

    def close(self) -> None:
        """Stop the target (killed if it does not stop within seconds)."""
        if self.proc.is_alive():
            try:
                self.conn.send("stop")
                if self.conn.poll(10):
                    self.conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# ---------------------------------------------------------------------- sweep
@dataclass(frozen=True)
class Point:
    """One configuration of the sweep."""

    op: str
    block_bytes: int
    batch: int
    concurrency: int


def slots_for(point: Point, buffer_bytes: int) -> int:
    """Block slots one thread has (each slot is two blocks wide, so no two blocks touch)."""
    return buffer_bytes // point.concurrency // (2 * point.block_bytes)


def feasible(point: Point, buffer_bytes: int) -> bool:
    """Whether every thread can place ``batch`` non-adjacent blocks in its slice."""
    return slots_for(point, buffer_bytes) >= point.batch


def sweep_points(block_sizes: tuple[int, ...], batches: tuple[int, ...],
                 concurrency: tuple[int, ...], ops: tuple[str, ...],
                 buffer_bytes: int) -> tuple[list[Point], list[Point]]:
    """Feasible and skipped points of the sweep (skipped: the buffer is too small)."""
    ok: list[Point] = []
    skipped: list[Point] = []
    for op in ops:
        for bb in block_sizes:
            for b in batches:
                for c in concurrency:
                    p = Point(op, bb, b, c)
                    (ok if feasible(p, buffer_bytes) else skipped).append(p)
    return ok, skipped


def _offsets(point: Point, thread: int, buffer_bytes: int, rng: random.Random) -> list[int]:
    n = slots_for(point, buffer_bytes)
    base = thread * (buffer_bytes // point.concurrency)
    return [base + s * 2 * point.block_bytes for s in rng.sample(range(n), point.batch)]


def measure(te: Any, session: str, local_base: int, remote_base: int, point: Point,
            buffer_bytes: int, min_time: float, rng: random.Random) -> dict[str, Any]:
    """Run ``point`` for ``min_time`` seconds on ``concurrency`` threads; GB/s and latency."""
    call = te.batch_transfer_sync_read if point.op == "read" else te.batch_transfer_sync_write
    lat: list[list[float]] = [[] for _ in range(point.concurrency)]
    moved = [0] * point.concurrency
    errors: list[str] = []
    plans = []
    for t in range(point.concurrency):
        offs = [_offsets(point, t, buffer_bytes, rng) for _ in range(4)]
        plans.append([([local_base + o for o in lo], [remote_base + o for o in ro])
                      for lo, ro in zip(offs, offs[1:] + offs[:1], strict=True)])
    lengths = [point.block_bytes] * point.batch
    barrier = threading.Barrier(point.concurrency + 1)
    stop_at = [0.0]

    def worker(t: int) -> None:
        barrier.wait()
        i = 0
        while True:
            loc, rem = plans[t][i % len(plans[t])]
            start = time.perf_counter()
            rc = call(session, loc, rem, lengths)
            end = time.perf_counter()
            if rc < 0:
                errors.append(f"rc={rc}")
                return
            lat[t].append(end - start)
            moved[t] += point.block_bytes * point.batch
            i += 1
            if end >= stop_at[0]:
                return

    threads = [threading.Thread(target=worker, args=(t,), daemon=True)
               for t in range(point.concurrency)]
    for th in threads:
        th.start()
    begin = time.perf_counter()
    stop_at[0] = begin + min_time
    barrier.wait()
    for th in threads:
        th.join()
    elapsed = time.perf_counter() - begin
    if errors:
        raise RuntimeError(f"{point.op} of {point.batch} x {point.block_bytes} B failed: "
                           f"{errors[0]}")
    all_lat = sorted(x for per in lat for x in per)
    p99 = all_lat[min(len(all_lat) - 1, int(round(0.99 * (len(all_lat) - 1))))]
    return {"op": point.op, "block_kib": point.block_bytes // KIB, "batch": point.batch,
            "concurrency": point.concurrency, "calls": len(all_lat),
            "GBps": sum(moved) / elapsed / 1e9, "p50_ms": statistics.median(all_lat) * 1e3,
            "p99_ms": p99 * 1e3}


def verify(te: Any, target: Target, local: Any, block_bytes: int, rng: random.Random) -> None:
    """One read and one write of ``block_bytes`` checked byte for byte.

    Raises:
        RuntimeError: the engine moved wrong bytes.
    """
    import zlib

    import numpy as np

    nbytes = local.nbytes
    slots = nbytes // (2 * block_bytes)
    src_off, dst_off = (s * 2 * block_bytes for s in rng.sample(range(slots), 2))
    local_addr = int(local.ctypes.data)
    local[src_off:src_off + block_bytes] = 0
    rc = te.batch_transfer_sync_read(target.session, [local_addr + src_off],
                                     [target.base + src_off], [block_bytes])
    want = _pattern(src_off + block_bytes)[src_off:]
    if rc < 0 or not (local[src_off:src_off + block_bytes] == want).all():
        raise RuntimeError(f"read of {block_bytes} bytes at {src_off} returned wrong data "
                           f"(rc={rc})")
    payload = bytes(rng.getrandbits(8) for _ in range(min(block_bytes, 4096)))
    payload = (payload * (block_bytes // len(payload) + 1))[:block_bytes]
    local[src_off:src_off + block_bytes] = np.frombuffer(payload, dtype=np.uint8)
    rc = te.batch_transfer_sync_write(target.session, [local_addr + src_off],
                                      [target.base + dst_off], [block_bytes])
    if rc < 0 or target.crc(dst_off, block_bytes) != zlib.crc32(payload):
        raise RuntimeError(f"write of {block_bytes} bytes to {dst_off} landed wrong (rc={rc})")
    # put the target's pattern back, so later checks read what they expect
    local[src_off:src_off + block_bytes] = _pattern(dst_off + block_bytes)[dst_off:]
    te.batch_transfer_sync_write(target.session, [local_addr + src_off],
                                 [target.base + dst_off], [block_bytes])


def run_sweep(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark: start the target, verify, sweep; returns the JSON payload."""
    import numpy as np

    from vllm_ascend.distributed.kv_transfer.core.transfer_engine import MooncakeTransferEngine

    quick = args.quick
    block_sizes = tuple(k * KIB for k in args.block_kib) if args.block_kib else (
        QUICK_BLOCK_SIZES if quick else FULL_BLOCK_SIZES)
    batches = tuple(args.batch) if args.batch else (QUICK_BATCHES if quick else FULL_BATCHES)
    concurrency = tuple(args.concurrency) if args.concurrency else (
        QUICK_CONCURRENCY if quick else FULL_CONCURRENCY)
    ops = tuple(args.ops)
    buffer_bytes = (args.buffer_mib or (QUICK_BUFFER_MIB if quick else DEFAULT_BUFFER_MIB)) * MIB
    min_time = args.min_time if args.min_time is not None else (0.05 if quick else 0.25)
    points, skipped = sweep_points(block_sizes, batches, concurrency, ops, buffer_bytes)
    host = args.host
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)

    target = Target(host, args.protocol, buffer_bytes)
    rows: list[dict[str, Any]] = []
    try:
        local = np.zeros(buffer_bytes, dtype=np.uint8)
        te = MooncakeTransferEngine(host, args.protocol)
        te.register_memory(int(local.ctypes.data), buffer_bytes)
        rng = random.Random(0)
        for bb in block_sizes:
            verify(te.raw, target, local, bb, rng)
        for point in progress(points, "engine sweep"):
            rows.append(measure(te.raw, target.session, int(local.ctypes.data), target.base,
                                point, buffer_bytes, min_time, rng))
        te.unregister_memory(int(local.ctypes.data))
    finally:
        target.close()
    return {
        "description": "raw Mooncake transfer engine (batch_transfer_sync_read/write), two "
                       "processes, one descriptor per block at random non-adjacent slots",
        "config": {"protocol": args.protocol, "host": host, "buffer_bytes": buffer_bytes,
                   "min_time_s": min_time, "block_bytes": list(block_sizes),
                   "batches": list(batches), "concurrency": list(concurrency), "ops": list(ops)},
        "verified": [bb // KIB for bb in block_sizes],
        "skipped": [{"op": p.op, "block_kib": p.block_bytes // KIB, "batch": p.batch,
                     "concurrency": p.concurrency, "reason": "buffer too small"}
                    for p in skipped],
        "rows": rows,
        "best": best_per_block(rows),
    }


def best_per_block(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each op and block size, the fastest point of the sweep (the engine's ceiling)."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        key = (r["op"], r["block_kib"])
        if key not in best or r["GBps"] > best[key]["GBps"]:
            best[key] = r
    return [best[k] for k in sorted(best)]


def run(args: argparse.Namespace) -> int:
    """Run ``bench engine``; print the table and write ``engine.json``."""
    payload = run_sweep(args)
    cols = ["op", "block_kib", "batch", "concurrency", "GBps", "p50_ms", "p99_ms"]
    print(format_table(payload["rows"], cols))
    print("\nceiling per block size (best point)")
    print(format_table(payload["best"], cols))
    path = write_results("engine", payload, args.out, args=args)
    print(f"results: {path}")
    return 0


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of integers: {text!r}") from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return values


def add_parser(subparsers: Any) -> None:
    """Register ``vllm-ascend-kv bench engine``."""
    p = subparsers.add_parser(
        "engine", help="the raw Mooncake transfer engine: block size x batch x concurrency, "
                       "read and write (the connectors' ceiling)")
    add_common_args(p)
    p.add_argument("--block-kib", type=_int_list, default=None,
                   help="block sizes in KiB, comma-separated (default 16,64,256,1024,4096)")
    p.add_argument("--batch", type=_int_list, default=None,
                   help="descriptors per call, comma-separated (default 1,8,64)")
    p.add_argument("--concurrency", type=_int_list, default=None,
                   help="threads submitting at once, comma-separated (default 1,2,4)")
    p.add_argument("--ops", type=lambda s: [x for x in s.split(",") if x],
                   default=["read", "write"], help="read,write (default both)")
    p.add_argument("--buffer-mib", type=int, default=None,
                   help=f"registered bytes per side, MiB (default {DEFAULT_BUFFER_MIB}, "
                        f"quick {QUICK_BUFFER_MIB})")
    p.add_argument("--min-time", type=float, default=None,
                   help="seconds per point (default 0.25, quick 0.05)")
    p.add_argument("--protocol", default="tcp", help="transfer protocol (default tcp)")
    p.add_argument("--host", default=os.environ.get("VLLM_ASCEND_KV_HOST", "127.0.0.1"),
                   help="address both engines bind and advertise (default 127.0.0.1)")
    p.set_defaults(func=_checked_run)


def _checked_run(args: argparse.Namespace) -> int:
    bad = [op for op in args.ops if op not in ("read", "write")]
    if bad:
        raise SystemExit(f"bench engine: unknown op(s) {bad}; use read and/or write")
    return run(args)
