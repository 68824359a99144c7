# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench p2p``: the pull connector's transfer path against the raw engine.

A prefill worker (a real ``MooncakeConnectorV1`` worker with its side channel)
runs in a spawned process and holds requests of 1, 16 and 128 blocks; the
decode worker in this process loads them. For each size the same block
ranges are also read with one raw ``batch_transfer_sync_read`` of the
Mooncake transfer engine, in the same run: the ratio raw time / connector
time is the connector's efficiency (the connector adds the claim, the
hand-off to its pull thread and the bookkeeping; the done message goes to P
after the load was reported).

The connector's time runs from ``start_load_kv`` until the worker marks the
request finished receiving (:meth:`PullWorker.wait_loads` wakes up), so it
includes waking the waiting thread but not a ``get_finished`` polling
interval, which in vLLM is one engine step and no part of the connector.
Each load runs in both claim modes of the worker (claims overlapped with the
read, claims first); ``ratio`` is the mode the worker picks on this machine
(:data:`~vllm_ascend.distributed.kv_transfer.kv_p2p.pull_reader.OVERLAP_MIN_CPUS`), the
other is reported beside it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue
import statistics
import time
from types import SimpleNamespace
from typing import Any

#: KV cache shape of the benchmark: 8 layers, CPU layout, 128 KiB per layer and block.
LAYERS = 8
HEADS = 2
BLOCK_TOKENS = 32
HEAD_SIZE = 256
NUM_BLOCKS = 300


def _vllm_config(role: str, kv_port: int) -> Any:
    kvc = SimpleNamespace(kv_port=kv_port, is_kv_producer=role == "kv_producer",
                          is_kv_consumer=role == "kv_consumer", kv_connector_extra_config={})
    return SimpleNamespace(
        kv_transfer_config=kvc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0,
                                        pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=BLOCK_TOKENS),
        model_config=SimpleNamespace(model="/bench/model", get_total_num_kv_heads=lambda: HEADS))


def _caches(fill: bool) -> dict[str, Any]:
    import torch

    out = {}
    for layer in range(LAYERS):
        t = torch.empty(NUM_BLOCKS, HEADS, BLOCK_TOKENS, 2 * HEAD_SIZE, dtype=torch.float16)
        t.fill_(layer + 1 if fill else 0)
        out[f"model.layers.{layer}.self_attn.attn"] = t
    return out


def _worker(role: str, kv_port: int) -> Any:
    from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
    from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig

    from ..p2p_metrics import P2P_METRICS
    from ..pull_worker import PullWorker

    return PullWorker(_vllm_config(role, kv_port), MooncakeP2PConfig(), f"bench-{role}",
                      MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)


def prefill_process(kv_port: int, q_in: Any, q_out: Any) -> None:
    """The P side: hold requests on command, serve the side channel, release on Done."""
    from ..pull_contract import MooncakeConnectorMetadata, SendMeta

    worker = _worker("kv_producer", kv_port)
    caches = _caches(fill=True)
    worker.register_kv_caches(caches)
    assert worker.meta is not None
    q_out.put((worker.meta.session, worker.meta.region_addrs, worker.meta.region_strides))
    while True:
        try:
            cmd = q_in.get(timeout=0.005)
        except queue.Empty:
            worker.get_finished()
            continue
        if cmd is None:
            break
        rid, blocks = cmd
        worker.start_load_kv(MooncakeConnectorMetadata(
            requests_to_send={rid: SendMeta(rid, blocks)}))
        q_out.put(rid)
    worker.shutdown()


def _raw_read(d: Any, session: str, p_addrs: list[int], p_strides: list[int],
              d_blocks: list[int], p_blocks: list[int], nbytes: int) -> float:
    """One raw Mooncake batch read of the ranges the connector reads; returns seconds."""
    loc, rem, lens = [], [], []
    for i, region in enumerate(d.layout.regions):
        for lb, pb in zip(d_blocks, p_blocks, strict=True):
            loc.append(region.base_addr + lb * region.block_stride)
            rem.append(p_addrs[i] + pb * p_strides[i])
            lens.append(region.block_len)
    t0 = time.perf_counter()
    moved = d.te.read(session, loc, rem, lens)
    elapsed = time.perf_counter() - t0
    assert moved == nbytes
    return elapsed


def _connector_load(d: Any, q_in: Any, q_out: Any, rid: str, p_port: int,
                    d_blocks: list[int], p_blocks: list[int]) -> float:
    """One connector load: seconds from ``start_load_kv`` until the worker marks the request
    finished receiving (then checked with ``get_finished``)."""
    from ..params import RemotePrefill
    from ..pull_contract import MooncakeConnectorMetadata, RecvMeta

    q_in.put((rid, p_blocks))
    assert q_out.get(timeout=60) == rid
    remote = RemotePrefill(engine_id="bench-kv_producer", host=d.host, port=p_port,
                           request_id=rid, block_ids=p_blocks, tp_size=1, pcp_size=1,
                           dcp_size=1)
    metadata = MooncakeConnectorMetadata(requests={rid: RecvMeta(
        rid, d_blocks, remote, remote_block_ids=p_blocks)})
    t0 = time.perf_counter()
    d.start_load_kv(metadata)
    if not d.wait_loads([rid], timeout=60):
        raise RuntimeError(f"connector load {rid} did not end within 60 s")
    elapsed = time.perf_counter() - t0
    _s, done = d.get_finished()
    if not done or rid not in done:
        raise RuntimeError(f"connector load {rid} ended but get_finished did not report it")
    return float(elapsed)


#: the connector's claim modes, as ``PullWorker.overlap_claims``
MODES = {"overlapped": True, "claims_first": False}


def run(args: argparse.Namespace) -> int:
    import random

    from vllm_ascend.distributed.kv_transfer.core.net import free_port
    from vllm_ascend.distributed.kv_transfer.core.tooling.benchutil import (
        format_table,
        write_results,
    )

    from ..pull_reader import usable_cpus

    sizes = [1, 16] if args.quick else [1, 16, 128]
    repeats = 3 if args.quick else args.repeats
    p_port = free_port()
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=prefill_process, args=(p_port, q_in, q_out), daemon=True)
    proc.start()
    d = _worker("kv_consumer", free_port())
    rows: list[dict[str, Any]] = []
    cpus = usable_cpus()
    default = ""
    try:
        session, p_addrs, p_strides = q_out.get(timeout=120)
        d.register_kv_caches(_caches(fill=False))
        assert d.layout is not None and d.te is not None
        rng = random.Random(0)
        auto = d.overlap_claims
        default = next(m for m, on in MODES.items() if on == auto)
        paths = ["raw", *MODES]
        for n in sizes:
            times: dict[str, list[float]] = {k: [] for k in paths}
            nbytes = n * d.layout.block_bytes
            for rep in range(repeats + 1):  # the first round warms connections up
                p_blocks = rng.sample(range(NUM_BLOCKS), n)
                d_blocks = rng.sample(range(NUM_BLOCKS), n)
                # the same memory is warm for every path (one untimed read), and each path
                # runs first in as many rounds as the others (repeats a multiple of 3)
                _raw_read(d, session, p_addrs, p_strides, d_blocks, p_blocks, nbytes)
                for kind in paths[rep % 3:] + paths[:rep % 3]:
                    if kind == "raw":
                        t = _raw_read(d, session, p_addrs, p_strides, d_blocks, p_blocks, nbytes)
                    else:
                        d.overlap_claims = MODES[kind]
                        t = _connector_load(d, q_in, q_out, f"bench-{n}-{rep}-{kind}", p_port,
                                            d_blocks, p_blocks)
                        if d.get_block_ids_with_load_errors():
                            raise RuntimeError(f"connector load of {n} blocks failed")
                    if rep:
                        times[kind].append(t)
            d.overlap_claims = auto
            med = {k: statistics.median(times[k]) for k in paths}
            raw, conn = med["raw"], med[default]
            rows.append({"blocks": n, "bytes": nbytes, "raw_GBps": nbytes / raw / 1e9,
                         "connector_GBps": nbytes / conn / 1e9, "ratio": raw / conn,
                         "raw_ms": raw * 1e3, "connector_ms": conn * 1e3,
                         **{f"ratio_{m}": raw / med[m] for m in MODES}})
            print(f"{n} blocks: raw {raw * 1e3:.2f} ms, connector {conn * 1e3:.2f} ms ({default}; "
                  + ", ".join(f"{m} {med[m] * 1e3:.2f} ms" for m in MODES) + ")", flush=True)
    finally:
        q_in.put(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
        d.shutdown()
    print(format_table(rows, ["blocks", "bytes", "raw_GBps", "connector_GBps", "ratio",
                              "raw_ms", "connector_ms", *(f"ratio_{m}" for m in MODES)]))
    path = write_results("p2p", {
        "description": "MooncakeConnectorV1 load (claim + read; done sent after) timed from "
                       "start_load_kv until the worker marks the request finished receiving, vs "
                       "one raw Mooncake batch read of the same ranges, TCP on loopback, P in "
                       f"another process; claims {default.replace('_', ' ')} (the worker's "
                       f"choice with {cpus} CPUs; ratio_overlapped / ratio_claims_first: both "
                       "modes, same run)",
        "claim_mode": default,
        "cpus": cpus,
        "goal": "ratio >= 0.9",
        "layout": {"layers": LAYERS, "block_bytes_per_layer": HEADS * BLOCK_TOKENS * 2 *
                   HEAD_SIZE * 2},
        "results": rows}, args.out)
    print(f"results: {path}")
    return 0


def add_parser(subparsers: Any) -> None:
    """Register ``vllm-ascend-kv bench p2p``."""
    from vllm_ascend.distributed.kv_transfer.core.tooling.benchutil import add_common_args

    p = subparsers.add_parser("p2p", help="pull connector transfer vs the raw Mooncake engine")
    add_common_args(p)
    p.add_argument("--repeats", type=int, default=9,
                   help="measurements per size and path (the median is reported)")
    p.set_defaults(func=run)
