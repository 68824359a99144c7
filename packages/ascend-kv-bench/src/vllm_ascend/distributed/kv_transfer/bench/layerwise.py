# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench layerwise``: layerwise push against the pull connector.

What is measured, per request and for both connectors in the same run on the same
KV cache: the time from the end of P's forward pass to D having all of the request's
KV. P and D workers run in this process and move bytes with the real Mooncake
transfer engine (TCP on loopback unless ``VLLM_ASCEND_KV_PROTOCOL`` says otherwise);
P's forward pass is simulated layer by layer (matrix multiplies for ``--layer-ms``
per layer).

* layerwise (``MooncakeLayerwiseConnector``): each layer is pushed from
  ``save_kv_layer`` right after it is "computed"; at the end of the forward only the
  last layer and the completion message remain;
* pull (``MooncakeConnectorV1``): D starts reading after the forward ends. The
  scheduler round trips of the real flow (P's output to the proxy, the proxy to D,
  D's scheduler step) are not included, so the pull numbers are a lower bound.

The forward-pass time is reported too: pushing while computing competes for the
same CPU or link, and the ratio shows what that costs.

Against the raw engine, with no compute in between (the connector's own cost): the
layerwise connector pushing every layer of a request (``save_kv_layer`` per layer,
then ``wait_for_save``, until D reports it received) against one raw
``batch_transfer_sync_write`` of exactly the same byte ranges, alternating, same run.
Nothing here fails on a number.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace
from typing import Any

import torch

from vllm_ascend.distributed.kv_transfer.core.net import free_port

from .benchutil import (
    add_common_args,
    format_table,
    progress,
    write_results,
)
from .ledger import series

NAME = "layerwise"


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench layerwise`` (the ``vllm_ascend_kv.bench`` entry point)."""
    p = subparsers.add_parser(NAME, help="layerwise push vs pull: time from the end of P's "
                                         "forward pass to D having all KV")
    add_common_args(p)
    p.add_argument("--layers", type=int, default=32, help="attention layers (default %(default)s)")
    p.add_argument("--blocks", type=int, default=16, help="blocks per request (default "
                                                          "%(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block")
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-size", type=int, default=128, help="head size")
    p.add_argument("--layer-ms", type=float, default=4.0,
                   help="simulated compute per layer in ms (default %(default)s)")
    p.add_argument("--requests", type=int, default=10, help="requests per connector")
    p.set_defaults(func=run)
    return p


def _config(role: str, kv_port: int, block_size: int, heads: int) -> Any:
    """The parts of a ``VllmConfig`` the workers read."""
    kvc = SimpleNamespace(kv_port=kv_port, is_kv_producer=role == "kv_producer",
                          is_kv_consumer=role == "kv_consumer", kv_connector_extra_config={})
    return SimpleNamespace(
        kv_transfer_config=kvc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, data_parallel_rank=0,
                                        pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=block_size),
        model_config=SimpleNamespace(model="/models/bench", get_total_num_kv_heads=lambda: heads))


def _caches(args: argparse.Namespace, num_blocks: int, fill: bool) -> dict[str, torch.Tensor]:
    """vLLM CPU layout: ``(num_blocks, heads, block_size, 2 * head_size)`` per layer."""
    out = {}
    for i in range(args.layers):
        t = torch.zeros(num_blocks, args.heads, args.block_size, 2 * args.head_size)
        if fill:
            t.normal_()
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


class _Compute:
    """One simulated layer: small matrix multiplies until ``ms`` milliseconds have passed
    (real CPU work, so pushes running meanwhile compete with it as they would)."""

    def __init__(self, ms: float) -> None:
        self.seconds = ms / 1000
        self.a = torch.randn(128, 128)

    def __call__(self) -> None:
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            self.a @ self.a


def _wait_recv(worker: Any, rid: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _s, recving = (worker.get_finished(set()) if _is_layerwise(worker)
                       else worker.get_finished())
        if recving and rid in recving:
            if worker.get_block_ids_with_load_errors():
                raise RuntimeError(f"{rid}: the transfer failed")
            return
        time.sleep(0.0002)
    raise TimeoutError(f"{rid} was not received within {timeout}s")


def _is_layerwise(worker: Any) -> bool:
    from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.worker import LayerwiseWorker

    return isinstance(worker, LayerwiseWorker)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Run both connectors on the same requests; returns per-connector samples."""
    from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
    from vllm_ascend.distributed.kv_transfer.kv_p2p.config import (
        MooncakeLayerwiseConfig,
        MooncakeP2PConfig,
    )
    from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.contract import (
        MooncakeLayerwiseConnectorMetadata,
        PushReq,
        RecvReq,
    )
    from vllm_ascend.distributed.kv_transfer.kv_p2p.layerwise.worker import LayerwiseWorker
    from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
    from vllm_ascend.distributed.kv_transfer.kv_p2p.params import PushTarget, RemotePrefill
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import (
        MooncakeConnectorMetadata,
        RecvMeta,
        SendMeta,
    )
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.worker import PullWorker

    nb = 2 * args.blocks + 2
    lw_cfg = MooncakeLayerwiseConfig.from_dict({"lease_ttl_s": 60})
    pull_cfg = MooncakeP2PConfig.from_dict({"lease_ttl_s": 60})
    ports = {k: free_port() for k in ("lp", "ld", "pp", "pd")}
    workers: dict[str, Any] = {
        "lp": LayerwiseWorker(_config("kv_producer", ports["lp"], args.block_size, args.heads),
                              lw_cfg, "bench-lp", MetricsRecorder(P2P_METRICS), tp_rank=0,
                              pp_rank=0),
        "ld": LayerwiseWorker(_config("kv_consumer", ports["ld"], args.block_size, args.heads),
                              lw_cfg, "bench-ld", MetricsRecorder(P2P_METRICS), tp_rank=0,
                              pp_rank=0),
        "pp": PullWorker(_config("kv_producer", ports["pp"], args.block_size, args.heads),
                         pull_cfg, "bench-pp", MetricsRecorder(P2P_METRICS), tp_rank=0,
                         pp_rank=0),
        "pd": PullWorker(_config("kv_consumer", ports["pd"], args.block_size, args.heads),
                         pull_cfg, "bench-pd", MetricsRecorder(P2P_METRICS), tp_rank=0,
                         pp_rank=0),
    }
    p_cache = _caches(args, nb, fill=True)
    caches = {"lp": p_cache, "pp": p_cache, "ld": _caches(args, nb, fill=False),
              "pd": _caches(args, nb, fill=False)}
    samples: dict[str, list[tuple[float, float]]] = {"layerwise": [], "pull": []}
    bulk: dict[str, list[float]] = {"raw": [], "connector": []}
    p_blocks = list(range(args.blocks))
    d_blocks = list(range(args.blocks, 2 * args.blocks))
    try:
        for key, w in workers.items():
            w.register_kv_caches(caches[key])
        compute = _Compute(args.layer_ms)
        layer_names = list(p_cache)

        def push(rid: str, compute: _Compute | None) -> tuple[float, float, float]:
            """One layerwise request, P pushing each layer after its (simulated) compute;
            returns when the pushes started, when the forward ended, when D had all KV."""
            p, d = workers["lp"], workers["ld"]
            d.start_load_kv(MooncakeLayerwiseConnectorMetadata(
                requests={rid: RecvReq(rid, d_blocks)}))
            tgt = PushTarget("bench-ld", d.host, ports["ld"], rid, d_blocks, 0, 1)
            meta = MooncakeLayerwiseConnectorMetadata(pushes={rid: PushReq(
                rid, tgt, list(range(args.blocks)), p_blocks, last=True)})
            start = time.perf_counter()
            for name in layer_names:
                if compute is not None:
                    compute()
                p.save_kv_layer(meta, name, p_cache[name])
            end = time.perf_counter()
            p.wait_for_save(meta)
            _wait_recv(d, rid)
            ready = time.perf_counter()
            p.get_finished({rid})
            return start, end, ready

        for i in progress(range(args.requests), "requests"):
            order = ("layerwise", "pull") if i % 2 == 0 else ("pull", "layerwise")
            for kind in order:
                rid = f"{kind}-{i}"
                if kind == "layerwise":
                    start, end, ready = push(rid, compute)
                else:
                    d, p = workers["pd"], workers["pp"]
                    start = time.perf_counter()
                    for _name in layer_names:
                        compute()
                    end = time.perf_counter()
                    p.start_load_kv(MooncakeConnectorMetadata(
                        requests_to_send={rid: SendMeta(rid, p_blocks)}))
                    remote = RemotePrefill("bench-pp", p.host, ports["pp"], rid, p_blocks,
                                           tp_size=1, pcp_size=1, dcp_size=1)
                    d.start_load_kv(MooncakeConnectorMetadata(requests={rid: RecvMeta(
                        rid, d_blocks, remote, remote_block_ids=p_blocks)}))
                    _wait_recv(d, rid)
                    ready = time.perf_counter()
                    p.get_finished()
                samples[kind].append((end - start, ready - end))
                if not torch.equal(caches["ld" if kind == "layerwise" else "pd"][
                        layer_names[-1]][d_blocks[-1]], p_cache[layer_names[-1]][p_blocks[-1]]):
                    raise RuntimeError(f"{kind}: D's last block differs from P's")
                caches["ld" if kind == "layerwise" else "pd"][layer_names[-1]].zero_()
        # the connector's cost against the raw engine: no compute, same bytes
        p, d = workers["lp"], workers["ld"]
        assert p.layout is not None and d.layout is not None and d.meta is not None
        src: list[int] = []
        dst: list[int] = []
        lens: list[int] = []
        for pr, dr in zip(p.layout.regions, d.layout.regions, strict=True):
            for pb, db in zip(p_blocks, d_blocks, strict=True):
                src.append(pr.block_addr(pb))
                dst.append(dr.block_addr(db))
                lens.append(pr.block_len)
        for i in progress(range(args.requests + 1), "raw vs connector"):
            for kind in (("raw", "connector") if i % 2 else ("connector", "raw")):
                rid = f"bulk-{i}"
                last = caches["ld"][layer_names[-1]]
                last.zero_()
                if kind == "raw":
                    start = time.perf_counter()
                    moved = p.te.write(d.meta.session, src, dst, lens, wait="spin")
                    ready = time.perf_counter()
                    if moved != sum(lens):
                        raise RuntimeError(f"raw write moved {moved} of {sum(lens)} bytes")
                else:
                    start, _end, ready = push(rid, None)
                if not torch.equal(last[d_blocks[-1]], p_cache[layer_names[-1]][p_blocks[-1]]):
                    raise RuntimeError(f"{kind}: D's last block differs from P's")
                if i:  # the first round warms connections up
                    bulk[kind].append(ready - start)
    finally:
        for w in workers.values():
            w.shutdown()
    block_bytes = args.heads * args.block_size * 2 * args.head_size * 4
    return {"samples": samples, "bulk": bulk,
            "request_bytes": block_bytes * args.blocks * args.layers}


def _summary(kind: str, samples: list[tuple[float, float]]) -> dict[str, Any]:
    fwd = [s[0] for s in samples]
    tail = sorted(s[1] for s in samples)
    return {"connector": kind, "forward_ms": 1000 * statistics.median(fwd),
            "kv_ready_after_forward_ms": 1000 * statistics.median(tail),
            "p90_ms": 1000 * tail[min(len(tail) - 1, int(0.9 * len(tail)))]}


def run(args: argparse.Namespace) -> int:
    """Entry of ``vllm-ascend-kv bench layerwise``."""
    if args.quick:
        args.layers, args.blocks, args.heads, args.head_size = 4, 4, 2, 64
        args.layer_ms, args.requests = 1.0, 3
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one worker rank's forward; steadier on a shared machine
    try:
        res = measure(args)
    finally:
        torch.set_num_threads(threads)
    rows = [_summary(k, v) for k, v in res["samples"].items()]
    lw, pull = rows[0], rows[1]
    ratio = (pull["kv_ready_after_forward_ms"] / lw["kv_ready_after_forward_ms"]
             if lw["kv_ready_after_forward_ms"] > 0 else float("inf"))
    payload = {
        "what": "time from the end of P's forward pass to D having all KV (median of "
                f"{args.requests} requests), same cache and requests, same run",
        "config": {k: getattr(args, k) for k in ("layers", "blocks", "block_size", "heads",
                                                 "head_size", "layer_ms", "requests")},
        "request_bytes": res["request_bytes"],
        "rows": rows,
        "pull_over_layerwise": ratio,
        "layerwise_forward_slowdown": lw["forward_ms"] / pull["forward_ms"],
        "samples_s": res["samples"],
        "vs_raw": _vs_raw(res["bulk"], res["request_bytes"]),
    }
    path = write_results(NAME, payload, args.out, args=args,
                         samples=ledger_series(res, args.requests))
    print(format_table(rows))
    print(f"KV per request: {res['request_bytes'] / 2**20:.1f} MiB; KV ready after the forward "
          f"pass: pull / layerwise = {ratio:.2f}x; forward pass with pushes / without = "
          f"{payload['layerwise_forward_slowdown']:.2f}x")
    vs = payload["vs_raw"]
    print(f"no compute, same bytes: raw write {vs['raw_ms']:.2f} ms "
          f"({vs['raw_GBps']:.2f} GB/s), connector {vs['connector_ms']:.2f} ms "
          f"({vs['connector_GBps']:.2f} GB/s): connector / raw = {vs['ratio']:.3f}")
    print(f"results: {path}")
    return 0


def ledger_series(res: dict[str, Any], requests: int) -> list[dict[str, Any]]:
    """The raw samples of a run for the ledger, one sample a round: request ``i`` of both
    connectors is round ``i`` (their order alternates), its forward pass and the time from
    its end to D having all KV (``what``: ``forward``, ``kv_ready``); and each alternating
    round of the connector's push against the raw write of the same bytes (``what``:
    ``bulk``, ``path``: ``connector`` or ``raw``; tags hold the ``bytes``)."""
    out = []
    for kind, samples in res["samples"].items():
        for what, idx in (("forward", 0), ("kv_ready", 1)):
            out.append(series({"what": what, "connector": kind, "requests": requests},
                              [[s[idx]] for s in samples]))
    for path, times in res["bulk"].items():
        out.append(series({"what": "bulk", "path": path, "bytes": res["request_bytes"]},
                          [[t] for t in times]))
    return out


def _vs_raw(bulk: dict[str, list[float]], nbytes: int) -> dict[str, Any]:
    raw, conn = statistics.median(bulk["raw"]), statistics.median(bulk["connector"])
    return {"what": "every layer of one request pushed by the connector (save_kv_layer per "
                    "layer, wait_for_save, until D reports it received) against one raw "
                    "batch write of the same byte ranges; no compute; median, same run",
            "bytes": nbytes, "raw_ms": 1000 * raw, "connector_ms": 1000 * conn,
            "raw_GBps": nbytes / raw / 1e9, "connector_GBps": nbytes / conn / 1e9,
            "ratio": raw / conn}


def main(argv: list[str] | None = None) -> int:
    """``python -m vllm_ascend.distributed.kv_transfer.bench.layerwise [options]``."""
    import sys

    parser = argparse.ArgumentParser(prog="layerwise-bench")
    sub = parser.add_subparsers(dest="bench", required=True)
    add_parser(sub)
    args = parser.parse_args([NAME, *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
