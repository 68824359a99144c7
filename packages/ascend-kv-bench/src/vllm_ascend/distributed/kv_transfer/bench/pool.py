# SPDX-License-Identifier: Apache-2.0
"""Benchmarks of the pool: ``vllm-ascend-kv bench pool`` and ``vllm-ascend-kv bench trace``.

``pool``
    Put/get throughput through the backends, against the raw
    ``MooncakeDistributedStore`` batch calls on the same data in the same run
    (the ratio is the overhead of the backend layer; the goal is >= 0.9); the
    ``local`` backend against a plain copy, once with this machine's glibc and once
    in a child process whose glibc copies non-temporally from 4 MiB
    (:data:`LOW_NT_THRESHOLD`, as on many hosts: glibc derives it from the cache size
    the CPU reports, and a virtual machine may report a huge one), and
    the lookup rate in keys/s, both for ``Backend.exists`` and for the whole
    scheduler -> worker lookup over ZeroMQ (goal: >= 100k keys/s batched).
    Without ``--master`` a ``mooncake_master`` is started on loopback.
``trace``
    Replays a Mooncake trace (``conversation_trace.jsonl``: per request the
    hash ids of its 512-token prefix blocks) and generated traces of other
    reuse patterns against the ``local`` backend at several capacities, with
    every eviction policy and the offline optimum, beside the best possible hit
    rate (an unbounded pool) measured in the same run (:mod:`.trace_replay`).

Both print a table and write ``<out>/<name>.json``; neither fails on a number.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .benchutil import (
    add_common_args,
    format_table,
    glibc_copy_facts,
    write_results,
)
from .ledger import series
from .mooncake_store import MooncakeMaster
from .trace_replay import SEGMENTS, TRACE_ENV, held_out_traces, load_trace, replay, run_trace

logger = logging.getLogger(__name__)

__all__ = ["SEGMENTS", "TRACE_ENV", "add_pool_command", "add_trace_command", "held_out_traces",
           "load_trace", "replay", "run_pool", "run_trace"]


# ---------------------------------------------------------------------- helpers
def _timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    """Wall time of each of ``repeat`` runs of ``fn``."""
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


#: ``_local_rows``' rows and the timed keys behind each: (backend, the copy it is held to).
LOCAL_PAIRS = {"local put (empty pool)": ("put", "fresh"),
               "local put (full pool)": ("full", "copy"), "local get": ("get", "copy")}


def local_series(times: dict[str, list[float]], nbytes: int, suffix: str = ""
                 ) -> list[dict[str, Any]]:
    """The ledger's series of the ``local`` rows: each round's backend call and its copy of
    the same bytes (``role`` backend / baseline), one sample a round."""
    out = []
    for path, keys in LOCAL_PAIRS.items():
        for role, key in zip(("backend", "baseline"), keys, strict=True):
            out.append(series({"path": path + suffix, "role": role, "bytes": nbytes},
                              [[t] for t in times[key]]))
    return out


class _Blocks:
    """``n`` blocks of ``parts`` ranges each (as KV regions), in registered host memory."""

    def __init__(self, n: int, parts: int, part_bytes: int) -> None:
        self.n, self.parts, self.part_bytes = n, parts, part_bytes
        self.src = np.random.default_rng(0).integers(0, 255, (parts, n * part_bytes),
                                                     dtype=np.uint8)
        self.dst = np.zeros_like(self.src)

    def ranges(self, arr: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
        base = [int(arr[p].ctypes.data) for p in range(self.parts)]
        addrs = [[b + i * self.part_bytes for b in base] for i in range(self.n)]
        return addrs, [[self.part_bytes] * self.parts for _ in range(self.n)]

    def memory(self) -> list[tuple[int, int]]:
        return [(int(row.ctypes.data), int(row.nbytes)) for arr in (self.src, self.dst)
                for row in arr]

    @property
    def nbytes(self) -> int:
        return self.n * self.parts * self.part_bytes


# ---------------------------------------------------------------------- pool
def _shape(quick: bool) -> tuple[int, int, int]:
    """Blocks, ranges per block and bytes per range of the put/get measurements."""
    return (32, 4, 64 << 10) if quick else (128, 8, 128 << 10)


def run_pool(args: argparse.Namespace) -> dict[str, Any]:
    """Put/get through the backends against raw store calls; lookup rates."""
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.local_backend import (
        LocalBackend,
    )

    n, parts, part = _shape(args.quick)
    repeat = 2 if args.quick else 9  # alternating rounds of the Mooncake calls
    blocks = _Blocks(n, parts, part)
    src_a, src_s = blocks.ranges(blocks.src)
    dst_a, dst_s = blocks.ranges(blocks.dst)
    rows: list[dict[str, Any]] = []

    local = LocalBackend(capacity=4 * blocks.nbytes)
    local_rows, local_rounds, times = _local_rows(local, blocks, rounds=5 if args.quick else 9)
    rows += local_rows
    samples = local_series(times, blocks.nbytes)
    low_nt = _local_rows_in_child(LOW_NT_THRESHOLD, args.quick)
    rows += low_nt.pop("rows", [])
    samples += low_nt.pop("samples", [])
    lookup = _lookup_rates(local, args.quick, samples=samples)
    mooncake: dict[str, Any] = {}
    try:
        mooncake = _mooncake_rows(args, blocks, repeat, samples)
        rows += mooncake.pop("rows")
    except Exception as exc:  # benchmarks report what they could measure
        logger.warning("Mooncake part skipped: %s", exc)
        mooncake = {"skipped": str(exc)}
    for r in lookup:
        rows.append(r)
    return {"config": {"blocks": n, "ranges_per_block": parts, "range_bytes": part,
                       "repeat": repeat, "local_rounds": len(local_rounds),
                       "local_copy_threads": local.copy_threads},
            "rows": rows, "local_rounds": local_rounds, "mooncake": mooncake,
            "local_low_nt": low_nt, "ledger_samples": samples}


#: glibc's non-temporal threshold of the second measurement of the ``local`` rows (bytes)
LOW_NT_THRESHOLD = 4 << 20
_CHILD_FLAG = "--local-rows-child"


def _local_rows_in_child(threshold: int, quick: bool) -> dict[str, Any]:
    """The ``local`` rows measured again in a child process whose glibc copies ranges from
    ``threshold`` bytes on with non-temporal stores (a tunable read only at start-up).
    Returns ``rows`` (paths suffixed with the threshold), the child's ``memcpy`` facts and
    ``threshold``; or ``skipped`` with the reason."""
    env = dict(os.environ, GLIBC_TUNABLES=f"glibc.cpu.x86_non_temporal_threshold={threshold:#x}")
    cmd = [sys.executable, "-m", __name__, _CHILD_FLAG, *(["--quick"] if quick else [])]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600,
                              check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        return {"skipped": f"child not run: {exc}"}
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"skipped": f"child exited {proc.returncode}: {tail}"}
    try:
        out = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"skipped": "child printed no result"}
    facts = out.get("memcpy") or {}
    if facts.get("non_temporal_threshold") != threshold:
        return {"skipped": f"glibc did not take the threshold (child: {facts})"}
    label = f", non-temporal from {threshold >> 20} MiB"
    rows = [{**row, "path": row["path"] + label} for row in out["rows"]]
    return {"threshold": threshold, "memcpy": facts, "rows": rows,
            "samples": local_series(out["times"], out["nbytes"], label)}


def _child_main(argv: list[str]) -> int:
    quick = "--quick" in argv
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.local_backend import (
        LocalBackend,
    )

    blocks = _Blocks(*_shape(quick))
    local = LocalBackend(capacity=4 * blocks.nbytes)
    try:
        rows, _rounds, times = _local_rows(local, blocks, rounds=5 if quick else 9)
    finally:
        local.close()
    print(json.dumps({"rows": rows, "memcpy": glibc_copy_facts(), "times": times,
                      "nbytes": blocks.nbytes}))
    return 0


def _spread(ratios: list[float]) -> dict[str, float]:
    return {"ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios)}


def _local_rows(local: Any, blocks: _Blocks, rounds: int
                ) -> tuple[list[dict[str, Any]], list[dict[str, float]], dict[str, list[float]]]:
    """The local backend against a plain copy of the same bytes, alternating, ``rounds`` times.

    * ``put (empty pool)``: into a pool emptied first, against a numpy copy into freshly
      allocated memory (both pay the page faults of new memory);
    * ``put (full pool)``: a pool at capacity, every put evicting as much as it writes,
      against a copy into memory touched before;
    * ``get``: against a copy into memory touched before.
    Each round times ours and the copy back to back; the ratio (copy time / ours, 1.0 =
    as fast as the copy) is reported as the median of the rounds with its min and max.
    Returns the rows, each round's ratios and every call's time by key (:data:`LOCAL_PAIRS`).
    """
    n = blocks.n
    src_a, src_s = blocks.ranges(blocks.src)
    dst_a, dst_s = blocks.ranges(blocks.dst)
    full = type(local)(capacity=blocks.nbytes, eviction_policy=local.policy.name)
    full.put([f"warm{i}" for i in range(n)], src_a, src_s)  # fills it: later puts evict
    per_round: list[dict[str, float]] = []
    gib = blocks.nbytes / (1 << 30)
    times: dict[str, list[float]] = {k: [] for k in ("put", "fresh", "full", "get", "copy")}

    def clock(key: str, fn: Callable[[], Any]) -> float:
        start = time.perf_counter()
        fn()
        t = time.perf_counter() - start
        times[key].append(t)
        return t

    def fresh_copy() -> None:
        fresh = np.empty_like(blocks.src)
        np.copyto(fresh, blocks.src)

    keys = [f"k{i}" for i in range(n)]
    for r in range(rounds):
        local.close()
        t_put = clock("put", lambda: local.put(keys, src_a, src_s))
        t_fresh = clock("fresh", fresh_copy)
        round_keys = [f"r{r}-{i}" for i in range(n)]
        t_full = clock("full", lambda: full.put(round_keys, src_a, src_s))  # noqa: B023
        blocks.dst[:] = 0
        t_get = clock("get", lambda: local.get(keys, dst_a, dst_s))
        t_copy = clock("copy", lambda: np.copyto(blocks.dst, blocks.src))
        if not np.array_equal(blocks.dst, blocks.src):
            raise RuntimeError("local round trip corrupted data")
        per_round.append({"put": t_fresh / t_put, "put_full": t_copy / t_full,
                          "get": t_copy / t_get})
    # the full pool is compared with the touched copy of its own round
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [
        {"path": "local put (empty pool)", "GiB/s": gib / med["put"],
         "raw GiB/s": gib / med["fresh"], **_spread([r["put"] for r in per_round])},
        {"path": "local put (full pool)", "GiB/s": gib / med["full"],
         "raw GiB/s": gib / med["copy"], **_spread([r["put_full"] for r in per_round])},
        {"path": "local get", "GiB/s": gib / med["get"], "raw GiB/s": gib / med["copy"],
         **_spread([r["get"] for r in per_round])},
    ]
    full.close()
    return rows, per_round, times


def _mooncake_rows(args: argparse.Namespace, blocks: _Blocks, repeat: int,
                   samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Backend put/get against the raw Store batch calls, ``repeat`` alternating rounds
    (each call's time appended to ``samples``: ``path`` mooncake put/get, ``role`` backend
    or baseline), and the lookup rates through the backend."""
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.mooncake_store import (
        MooncakeBackend,
    )
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config import MooncakeStoreConfig

    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    master = None
    if args.master:
        cfg = {"master_server_address": args.master, "metadata_server": args.metadata_server,
               "global_segment_size": "1GB", "local_buffer_size": "64MB", "protocol": "tcp"}
    else:
        try:
            master = MooncakeMaster(Path(tempfile.mkdtemp(prefix="bench-master-"))).start(20)
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"{exc}, or pass --master host:port") from exc
        cfg = master.config(global_segment_size="1GB")
    try:
        backend = MooncakeBackend(store_config=MooncakeStoreConfig.from_dict(cfg),
                                  hostname="127.0.0.1")
        raw = backend.store
        for addr, length in blocks.memory():
            backend.register_buffer([addr], [length])
        src_a, src_s = blocks.ranges(blocks.src)
        dst_a, dst_s = blocks.ranges(blocks.dst)
        gib = blocks.nbytes / (1 << 30)
        rows = []
        times: dict[str, list[float]] = {f"{op}-{who}": [] for op in ("put", "get")
                                         for who in ("backend", "raw")}
        calls = {"backend": (backend.put, backend.get),
                 "raw": (raw.batch_put_from_multi_buffers, raw.batch_get_into_multi_buffers)}
        # a round untimed first (the store's first put of a segment maps it), then rounds of
        # backend and raw calls, who goes first flipping every round
        for rnd in range(repeat + 1):
            order = list(calls.items())
            for who, (put, get) in (order if rnd % 2 else order[::-1]):
                keys = [f"bench-{uuid.uuid4().hex}" for _ in range(blocks.n)]
                start = time.perf_counter()
                res = put(keys, src_a, src_s)
                t_put = time.perf_counter() - start
                if any(int(r) != 0 for r in res):
                    raise RuntimeError(f"{who} put failed: {list(res)[:4]}")
                blocks.dst[:] = 0
                start = time.perf_counter()
                get(keys, dst_a, dst_s)
                t_get = time.perf_counter() - start
                if rnd:
                    times[f"put-{who}"].append(t_put)
                    times[f"get-{who}"].append(t_get)
                if not np.array_equal(blocks.dst, blocks.src):
                    raise RuntimeError(f"Mooncake round trip through {who} corrupted data")
                raw.batch_remove(keys, True)
        for op in ("put", "get"):
            for who, role in (("backend", "backend"), ("raw", "baseline")):
                samples.append(series({"path": f"mooncake {op}", "role": role,
                                       "bytes": blocks.nbytes},
                                      [[t] for t in times[f"{op}-{who}"]]))
            tb, tr = min(times[f"{op}-backend"]), min(times[f"{op}-raw"])
            rows.append({"path": f"mooncake {op}", "GiB/s": gib / tb, "raw GiB/s": gib / tr,
                         "ratio": tr / tb})
        lookup = _lookup_rates(backend, args.quick, label="mooncake", samples=samples)
        backend.close()
        return {"rows": rows + lookup, "master": cfg["master_server_address"]}
    finally:
        if master is not None:
            master.stop()
            shutil.rmtree(master.workdir, ignore_errors=True)


def _lookup_rates(backend: Any, quick: bool, label: str = "local",
                  samples: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """keys/s of ``exists`` in batches, and of the ZeroMQ scheduler->worker lookup (the best
    of the rounds); every round's time appended to ``samples`` (``role`` lookup, ``keys``
    a call)."""
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.config import AscendStoreConfig
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.context import PoolContext
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.lookup import (
        LookupClient,
        LookupServer,
        lookup_endpoint,
    )
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.store_worker import KVPoolWorker

    batch = 1024
    rounds = 5 if quick else 20
    ctx = PoolContext(model_name="bench", block_size=128, salt="bench")
    worker = KVPoolWorker(ctx, AscendStoreConfig.from_dict({}), backend=backend,
                          start_lookup_server=False)
    hashes = [uuid.uuid4().hex + uuid.uuid4().hex for _ in range(batch)]
    keys = [worker._key(h) for h in hashes]
    buf = np.zeros(64, dtype=np.uint8)
    backend.register_buffer([buf.ctypes.data], [buf.nbytes])
    half = keys[: batch // 2]
    backend.put(half, [[buf.ctypes.data]] * len(half), [[64]] * len(half))
    t_exists = _timed(lambda: backend.exists(keys), rounds)
    endpoint = lookup_endpoint(f"bench-{uuid.uuid4().hex}", 0, base_path=tempfile.gettempdir())
    server = LookupServer(endpoint, worker.lookup_scheduler)
    client = LookupClient(endpoint, timeout_s=30)
    try:
        # a full hit walks every key: the worst case of one lookup
        all_hit = hashes[: batch // 2]
        got = client.lookup(all_hit, len(all_hit) * 128)
        if got != len(all_hit) * 128:
            raise RuntimeError(f"lookup answered {got} tokens, expected {len(all_hit) * 128}")
        t_rpc = _timed(lambda: client.lookup(all_hit, len(all_hit) * 128), rounds)
    finally:
        client.close()
        server.close()
        worker._send.stop(1)
        worker._recv.stop(1)
    paths = [(f"{label} exists (batch {batch})", batch, t_exists),
             (f"{label} lookup over ZeroMQ (batch {batch // 2})", batch // 2, t_rpc)]
    if samples is not None:
        samples += [series({"path": path, "role": "lookup", "keys": keys}, [[t] for t in ts])
                    for path, keys, ts in paths]
    return [{"path": path, "keys/s": keys / min(ts)} for path, keys, ts in paths]


# ---------------------------------------------------------------------- CLI
def _run(name: str, fn: Callable[[argparse.Namespace], dict[str, Any]],
         args: argparse.Namespace) -> int:
    result = fn(args)
    samples = result.pop("ledger_samples", None)
    path = write_results(name, result, args.out, args=args, samples=samples)
    table = result.get("table", result["rows"])
    columns = list(dict.fromkeys(k for row in table for k in row))
    print(format_table(table, columns))
    print(f"results: {path}")
    return 0


def add_pool_command(sub: Any) -> None:
    """``vllm-ascend-kv bench pool``."""
    p = sub.add_parser("pool", help="pool put/get vs raw Mooncake Store calls; lookup rate")
    add_common_args(p)
    p.add_argument("--master", default="", help="host:port of a running mooncake_master "
                                                 "(default: start one on loopback)")
    p.add_argument("--metadata-server", default="P2PHANDSHAKE",
                   help="metadata server of --master (default: %(default)s)")
    p.set_defaults(func=lambda a: _run("pool", run_pool, a))


def add_trace_command(sub: Any) -> None:
    """``vllm-ascend-kv bench trace``."""
    p = sub.add_parser("trace", help="replay a Mooncake trace against the local pool")
    add_common_args(p)
    p.add_argument("trace", nargs="?", default="",
                   help=f"trace file (default: ${TRACE_ENV})")
    p.add_argument("--block-bytes", type=int, default=4096,
                   help="bytes stored per 512-token block (scaled down; default %(default)s)")
    p.add_argument("--held-out", action="append", metavar="NAME=PATH", default=[],
                   help="a trace the eviction policies were not tuned on, replayed beside the "
                        "others (repeatable; e.g. Mooncake's FAST25-release/traces/"
                        "synthetic_trace.jsonl)")
    p.set_defaults(func=lambda a: _run("trace", run_trace, a))


if __name__ == "__main__" and _CHILD_FLAG in sys.argv[1:]:
    raise SystemExit(_child_main(sys.argv[1:]))
