# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench p2p``: the pull connector's transfer path against the raw engine.

A prefill worker (a real ``MooncakeConnectorV1`` worker with its side channel)
runs in a spawned process and holds requests of 1, 16 and 128 blocks; the
decode worker in this process loads them. For each size the same block
ranges are also read with one raw ``batch_transfer_sync_read`` of the
Mooncake transfer engine, in the same run: the ratio raw time / connector
time is the connector's efficiency (the connector adds the claim, the
hand-off to its pull thread and the bookkeeping; the done message goes to P
after the load was reported, and is sent before the next measurement starts).

The connector's time runs from the moment D's scheduler sees the request until the
worker marks the request finished receiving. P's params carry its read window
(``kv_p2p.pull.contract``), so D reads the fresh request without claiming it; mode ``ahead``
(params without the window) has the scheduler send the claim when it sees the request
(``kv_p2p.pull.scheduler.ClaimAhead``) and hand the request to the worker with the answer
if it is in, else the next engine step brings it, one step every :data:`ENGINE_STEP_S`. The
time ends when the worker marks the request finished receiving
(:meth:`PullWorker.wait_loads` wakes up), so it includes waking the waiting thread
but not a ``get_finished`` polling interval, which in vLLM is one engine step and no
part of the connector. The worker's own claims (overlapped with the read, or before
it: what it does when the scheduler sent none) are measured beside it, from
``start_load_kv``, and so are window loads with ``inline_reads`` on (mode ``inline``:
read from ``start_load_kv`` and polled by ``wait_loads``, ``kv_p2p.pull.inline``), with
their own bootstrap interval (``ratio_inline_low`` / ``_high``).

Measurement: ``--rounds`` rounds (round 0 warms up and is dropped); in each, for
each size, ``--pairs`` times (:data:`SMALL_LOADS` / blocks times as many below that many
blocks, at most :data:`SMALL_LOADS_MAX` times: a one-block load takes half a millisecond)
the raw read and every claim mode, in an order drawn at random each time. A round's ratio is raw median / connector median of that round;
``ratio`` is the median over the rounds, with ``ratio_min`` / ``ratio_max``, and
``ratio_low`` / ``ratio_high``: the 95% paired bootstrap interval over the rounds of the
ratio of the rounds' median times (as ``bench serve``), which decides the goal.

With ``--auth`` (issue 19: what a deployment key costs), a second P process and D
worker with a fresh key load the same block ranges, their loads and their own raw reads
alternating with the others in the same rounds; ``keyed_vs_plain`` is the median over the
rounds of the plain connector's time over the keyed one's, each in units of its own pair's
raw read (1.0: the key costs nothing), with its min-max and its bootstrap interval
(``keyed_vs_plain_low`` / ``_high``); ``keyed_vs_plain_time`` is the same without the
units. Measuring the two in separate phases compared two states of a noisy machine (the
raw read's own median moved by 40% between them); two pairs in the same rounds differ by
where their processes run (one pair's raw read measured up to 15% slower than the other's,
and its connector followed it), which their own raw reads take out.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import queue
import statistics
import time
from types import SimpleNamespace
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.local_reads import LOCAL_READS_ENV

from .benchutil import environ

#: KV cache shape of the benchmark: CPU layout, 128 KiB per layer and block, 8 layers unless
#: ``--layers`` says otherwise (real models have 32-80: each layer is a byte range of a block).
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
        model_config=SimpleNamespace(model="/bench/model", get_total_num_kv_heads=lambda: HEADS),
        instance_id=f"{os.getpid()}-{time.time_ns()}")


def _caches(fill: bool, layers: int = LAYERS) -> dict[str, Any]:
    import torch

    out = {}
    for layer in range(layers):
        t = torch.empty(NUM_BLOCKS, HEADS, BLOCK_TOKENS, 2 * HEAD_SIZE, dtype=torch.float16)
        t.fill_(layer + 1 if fill else 0)
        out[f"model.layers.{layer}.self_attn.attn"] = t
    return out


def _worker(role: str, kv_port: int) -> Any:
    from vllm_ascend.distributed.kv_transfer.core.metrics import MetricsRecorder
    from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig
    from vllm_ascend.distributed.kv_transfer.kv_p2p.p2p_metrics import P2P_METRICS
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.worker import PullWorker

    return PullWorker(_vllm_config(role, kv_port), MooncakeP2PConfig(), f"bench-{role}",
                      MetricsRecorder(P2P_METRICS), tp_rank=0, pp_rank=0)


def prefill_process(kv_port: int, q_in: Any, q_out: Any, layers: int = LAYERS) -> None:
    """The P side: hold requests on command, serve the side channel, release on Done."""
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import (
        MooncakeConnectorMetadata,
        SendMeta,
    )

    worker = _worker("kv_producer", kv_port)
    caches = _caches(fill=True, layers=layers)
    worker.register_kv_caches(caches)
    assert worker.meta is not None
    q_out.put((worker.meta.session, worker.meta.region_addrs, worker.meta.region_strides,
               worker.meta.instance))
    while True:
        try:
            cmd = q_in.get(timeout=0.005)
        except queue.Empty:
            worker.get_finished()
            continue
        if cmd is None:
            break
        rid, blocks, token = cmd
        worker.start_load_kv(MooncakeConnectorMetadata(
            requests_to_send={rid: SendMeta(rid, blocks, token)}))
        q_out.put(rid)
    worker.shutdown()


def _raw_read(d: Any, session: str, p_addrs: list[int], p_strides: list[int],
              d_blocks: list[int], p_blocks: list[int], nbytes: int) -> float:
    """One raw Mooncake batch read of the ranges the connector reads, waited for by Mooncake's
    synchronous call (``wait="spin"``: the engine's own way, not the connector's); returns
    seconds."""
    loc, rem, lens = [], [], []
    for i, region in enumerate(d.layout.regions):
        for lb, pb in zip(d_blocks, p_blocks, strict=True):
            loc.append(region.base_addr + lb * region.block_stride)
            rem.append(p_addrs[i] + pb * p_strides[i])
            lens.append(region.block_len)
    t0 = time.perf_counter()
    moved = d.te.read(session, loc, rem, lens, wait="spin")
    elapsed = time.perf_counter() - t0
    assert moved == nbytes
    return elapsed


#: below this many blocks a round has ``SMALL_LOADS // blocks`` times as many loads (at
#: most :data:`SMALL_LOADS_MAX` times): they are short, and with a round's median of 3 loads
#: at 16 blocks the ratio of four such medians (the keyed pair's loads against the plain
#: pair's, each over its own raw read) spread over 0.37-1.68 in 15 rounds
SMALL_LOADS = 64
#: at most this many times as many loads: with 64 times as many one-block loads the
#: connector's one-block load measured 0.82 ms instead of 0.63-0.67 ms, the raw read
#: unchanged (P's bookkeeping of the over 1,000 requests it then held for their read
#: windows of 1 s was suspected). Not reproduced on 2026-12-05 without ``--auth``, two runs
#: of 15 rounds each way: 0.68 ms (0.67 and 0.71 of the raw read) with the code of then,
#: 0.62 and 0.75 ms (0.71 both) once P stopped scanning what it holds at every step
SMALL_LOADS_MAX = 8

#: an idle engine's step (seconds): how often the simulated engine passes D's scheduler's
#: metadata (with the answers of the claims it sent ahead) to the worker while a load runs
ENGINE_STEP_S = 0.001


def _connector_load(d: Any, q_in: Any, q_out: Any, rid: str, p_port: int,
                    d_blocks: list[int], p_blocks: list[int], mode: str,
                    instance: str = "") -> float:
    """One connector load: seconds from the moment D's scheduler sees the request (modes
    ``window`` and ``ahead``: it sends the claim then unless the request is within P's
    read window) or ``start_load_kv`` (the other modes, whose claims go out from the worker)
    until the worker marks the request finished receiving (then checked with
    ``get_finished``). Only ``window`` loads carry P's read window in their params."""
    from vllm_ascend.distributed.kv_transfer.core.auth import capability_token
    from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig
    from vllm_ascend.distributed.kv_transfer.kv_p2p.params import RemotePrefill
    from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.contract import (
        MooncakeConnectorMetadata,
        RecvMeta,
        in_window,
        window_end,
        window_tag,
    )

    token = capability_token()  # P's capability for the request, as P's scheduler issues it
    held_at = time.time()  # P's scheduler stamps the params before its worker holds
    q_in.put((rid, p_blocks, token))
    assert q_out.get(timeout=60) == rid
    window = mode in ("window", "inline")
    hold_s = MooncakeP2PConfig().hold_window_s
    remote = RemotePrefill(engine_id="bench-kv_producer", host=d.host, port=p_port,
                           request_id=rid, block_ids=p_blocks, tp_size=1, pcp_size=1,
                           dcp_size=1, token=token, instance=instance if window else "",
                           held_at=held_at if window else 0.0, hold_s=hold_s if window else 0.0,
                           window_tag=window_tag(instance=instance, request_id=rid,
                                                 block_ids=p_blocks, held_at=held_at,
                                                 hold_s=hold_s, token=token))
    ahead = d.claim_ahead if mode in ("ahead", "window", "inline") else None
    t0 = time.perf_counter()
    early = None
    sent = False
    # D's scheduler checks P's window tag once and sends its verdict with the request
    until = window_end(remote)
    if ahead is not None and not in_window(remote, until=until):
        # D's scheduler: get_num_new_matched_tokens sends the claim, update_state_after_alloc
        # hands the request over (with the answers if they are in already)
        ahead.start(rid, remote, p_blocks)
        sent, early = ahead.hand_over(rid, p_blocks)
    d.start_load_kv(MooncakeConnectorMetadata(requests={rid: RecvMeta(
        rid, d_blocks, remote, remote_block_ids=p_blocks, claimed_ahead=sent,
        early_claims=early, window_until=until)}))
    deadline = t0 + 60
    while not d.wait_loads([rid], timeout=ENGINE_STEP_S):
        if time.perf_counter() > deadline:
            raise RuntimeError(f"connector load {rid} did not end within 60 s")
        if ahead is not None:  # the engine's next step: the answers that came since
            d.start_load_kv(MooncakeConnectorMetadata(claim_answers=ahead.take_answers()))
    elapsed = time.perf_counter() - t0
    _s, done = d.get_finished()
    if not done or rid not in done:
        raise RuntimeError(f"connector load {rid} ended but get_finished did not report it")
    return float(elapsed)


#: the connector's claim modes: ``window`` (P's params carry its read window, D reads
#: unclaimed: the connector's way in vLLM for a request D takes up within it), ``ahead``
#: (D's scheduler claims when it first sees the request: its way after the window, or
#: with a P whose ``read_window_s`` is 0), the worker's own claims with
#: ``PullWorker.overlap_claims`` on and off (its way when the scheduler sent none), and
#: ``inline``: window loads with ``inline_reads`` on (read from ``start_load_kv``, polled)
MODES = {"window": None, "ahead": None, "overlapped": True, "claims_first": False,
         "inline": None}
#: the mode ``ratio`` reports
DEFAULT_MODE = "window"


def _in_raw_units(loads: list[float], raws: list[float]) -> float:
    """A pair's median load time over its median raw read of the same ranges."""
    return statistics.median(loads) / statistics.median(raws)


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _deployment_key(key: str | None) -> contextlib.AbstractContextManager[None]:
    """The environment's deployment key set to ``key`` (``None``: no key) meanwhile.

    Sockets take their key from the environment when they are made (P's side channel
    when its process starts, D's clients at a load's first message to a P), so each
    pair's loads run inside this with its own key."""
    from vllm_ascend.distributed.kv_transfer.core import auth

    return environ({auth.ENV_KEY_FILE: None, auth.ENV_KEY: key})


class _Pair:
    """A P process holding requests on command and the D worker in this process that
    loads from it, both with the deployment key ``key`` (``None``: none)."""

    def __init__(self, key: str | None, layers: int = LAYERS) -> None:
        from vllm_ascend.distributed.kv_transfer.core.net import free_port
        from vllm_ascend.distributed.kv_transfer.kv_p2p.pull.scheduler import ClaimAhead

        self.key = key
        self.layers = layers
        self.p_port = free_port()
        ctx = mp.get_context("spawn")
        self.q_in, self.q_out = ctx.Queue(), ctx.Queue()
        with _deployment_key(key):
            self.proc = ctx.Process(target=prefill_process,
                                    args=(self.p_port, self.q_in, self.q_out, layers),
                                    daemon=True)
            self.proc.start()
            self.d = _worker("kv_consumer", free_port())
            self.d.claim_ahead = ClaimAhead(lambda p_tp: {0: 1}, 10.0, reader="bench-scheduler",
                                            engine_id=self.d.engine_id)

    def connect(self) -> None:
        """Wait for P's caches; register D's."""
        self.session, self.p_addrs, self.p_strides, self.instance = self.q_out.get(timeout=120)
        with _deployment_key(self.key):
            self.d.register_kv_caches(_caches(fill=False, layers=self.layers))
        assert self.d.layout is not None and self.d.te is not None

    def raw(self, d_blocks: list[int], p_blocks: list[int], nbytes: int) -> float:
        return _raw_read(self.d, self.session, self.p_addrs, self.p_strides, d_blocks,
                         p_blocks, nbytes)

    def load(self, rid: str, d_blocks: list[int], p_blocks: list[int], mode: str) -> float:
        with _deployment_key(self.key):
            t = _connector_load(self.d, self.q_in, self.q_out, rid, self.p_port, d_blocks,
                                p_blocks, mode, self.instance)
        if self.d.get_block_ids_with_load_errors():
            raise RuntimeError(f"connector load {rid} failed")
        # the Done goes to P after the load was reported (off the load's path in vLLM): let
        # it go out before the next measurement, which would otherwise share the CPUs with it
        # (a raw read right after a load measured up to 2x its time on 2 CPUs)
        assert self.d.reader is not None
        self.d.reader.done_sent()
        return t

    def sealing(self) -> set[bool]:
        """Whether each client D opened to P seals its frames (one value per client)."""
        clients = [*self.d._clients.values(), *self.d.claim_ahead._clients.values()]
        return {c.auth is not None for c in clients}

    def stop(self) -> None:
        self.q_in.put(None)
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        self.d.claim_ahead.stop()
        self.d.shutdown()


def _measure(sizes: list[int], rounds: int, pairs: int, *, keyed: bool = False,
             layers: int = LAYERS, samples: list[dict[str, Any]] | None = None
             ) -> list[dict[str, Any]]:
    """``rounds`` rounds of alternating raw reads and connector loads per size, between a
    P process and a D worker without a deployment key; with ``keyed``, loads of a second
    pair with a fresh key (sealed frames, claim tokens, regions with the grant) alternate
    with them in the same rounds. Every time of the measured rounds (not of round 0, the
    warm-up) goes to ``samples``, a series per size and path (``ledger.series``)."""
    import random
    import secrets

    from .ledger import series

    plain = _Pair(None, layers)
    sealed = _Pair(secrets.token_hex(32), layers) if keyed else None
    rows: list[dict[str, Any]] = []
    try:
        plain.connect()
        if sealed is not None:
            sealed.connect()
        d = plain.d
        assert d.reader is not None
        inline = d.reader.new_inline_reads()  # on for the loads of mode "inline" only
        rng = random.Random(0)
        orders = random.Random(1)  # the order of the paths at each pair of loads
        auto = d.overlap_claims
        paths = ["raw", *MODES, *(["keyed", "raw_keyed"] if sealed is not None else [])]
        # per size: each round's ratio of each mode, and every time measured
        ratios: dict[int, dict[str, list[float]]] = {
            n: {m: [] for m in [*MODES, "keyed", "raw_keyed", "keyed_vs_plain"]}
            for n in sizes}
        times: dict[int, dict[str, list[float]]] = {n: {k: [] for k in paths} for n in sizes}
        # per size and path: each round's median time (the unit of the bootstrap)
        medians: dict[int, dict[str, list[float]]] = {n: {k: [] for k in paths} for n in sizes}
        unclaimed: dict[int, list[bool]] = {n: [] for n in sizes}
        per_round: dict[int, dict[str, list[list[float]]]] = {
            n: {k: [] for k in paths} for n in sizes}
        for rnd in range(rounds + 1):  # round 0 warms connections up
            for n in sizes:
                nbytes = n * d.layout.block_bytes
                got: dict[str, list[float]] = {k: [] for k in paths}
                for pair in range(pairs * max(1, min(SMALL_LOADS_MAX, SMALL_LOADS // n))):
                    p_blocks = rng.sample(range(NUM_BLOCKS), n)
                    d_blocks = rng.sample(range(NUM_BLOCKS), n)
                    # the same memory is warm for every path (one untimed read); the paths
                    # go in an order drawn afresh each time: what ran just before a read
                    # moves its time (one-block raw reads right after another took
                    # 0.30-0.31 ms, right after a connector load 0.36-0.37 ms), and an order
                    # that turned put every path after the same one (the raw read always
                    # after the keyed pair's raw read, the window load after the raw read)
                    plain.raw(d_blocks, p_blocks, nbytes)
                    if sealed is not None:
                        sealed.raw(d_blocks, p_blocks, nbytes)
                    for kind in orders.sample(paths, len(paths)):
                        rid = f"bench-{n}-{rnd}-{pair}-{kind}"
                        if kind == "raw":
                            t = plain.raw(d_blocks, p_blocks, nbytes)
                        elif kind == "keyed":
                            assert sealed is not None
                            t = sealed.load(rid, d_blocks, p_blocks, DEFAULT_MODE)
                        elif kind == "raw_keyed":  # the keyed pair's own raw read
                            assert sealed is not None
                            t = sealed.raw(d_blocks, p_blocks, nbytes)
                        else:
                            d.overlap_claims = auto if MODES[kind] is None else MODES[kind]
                            d.reader.inline = inline if kind == "inline" else None
                            before = d.recorder.total("p2p_window_reads")
                            t = plain.load(rid, d_blocks, p_blocks, kind)
                            if kind == "window" and rnd:
                                unclaimed[n].append(
                                    d.recorder.total("p2p_window_reads") > before)
                        got[kind].append(t)
                d.overlap_claims = auto
                d.reader.inline = None
                if not rnd:
                    continue
                raw = statistics.median(got["raw"])
                for m in paths[1:]:
                    ratios[n][m].append(raw / statistics.median(got[m]))
                if sealed is not None:
                    ratios[n]["keyed_vs_plain"].append(
                        _in_raw_units(got[DEFAULT_MODE], got["raw"])
                        / _in_raw_units(got["keyed"], got["raw_keyed"]))
                for kind in paths:
                    times[n][kind].extend(got[kind])
                    per_round[n][kind].append(list(got[kind]))
                    medians[n][kind].append(statistics.median(got[kind]))
        for n in sizes:
            rows.append(_row(n, n * d.layout.block_bytes, times[n], ratios[n], medians[n],
                             rounds))
            # how many of the window loads read unclaimed (the others ended after it)
            rows[-1]["window_reads"] = sum(unclaimed[n]) / max(1, len(unclaimed[n]))
            if samples is not None:
                samples.extend(series({"blocks": n, "bytes": n * d.layout.block_bytes,
                                       "layers": layers, "path": kind}, per_round[n][kind])
                               for kind in paths)
        # a comparison counts only if the keyed pair sealed every frame and the plain did not
        if plain.sealing() != {False} or (sealed is not None and sealed.sealing() != {True}):
            raise RuntimeError(f"the pairs did not run as set up: plain clients sealed "
                               f"{plain.sealing()}, keyed {sealed and sealed.sealing()}")
    finally:
        plain.stop()
        if sealed is not None:
            sealed.stop()
    return rows


def _row(n: int, nbytes: int, times: dict[str, list[float]], ratios: dict[str, list[float]],
         medians: dict[str, list[float]], rounds: int) -> dict[str, Any]:
    """One block count's result. ``ratio_low``/``ratio_high`` (and ``keyed_vs_plain_low``/
    ``_high``) are the 95% paired bootstrap interval over the rounds of the ratio of the
    rounds' medians (``bench.stats.compare``, as ``bench serve``)."""
    from .stats import compare

    raw = statistics.median(times["raw"])
    conn = statistics.median(times[DEFAULT_MODE])
    spread = _spread(ratios[DEFAULT_MODE])
    iv = compare(medians["raw"], medians[DEFAULT_MODE])
    inline = compare(medians["raw"], medians["inline"])
    row: dict[str, Any] = {
        "blocks": n, "bytes": nbytes, "raw_GBps": nbytes / raw / 1e9,
        "connector_GBps": nbytes / conn / 1e9, "ratio": spread["median"],
        "ratio_min": spread["min"], "ratio_max": spread["max"],
        "ratio_low": iv.low, "ratio_high": iv.high,
        "raw_ms": raw * 1e3, "connector_ms": conn * 1e3,
        **{f"ratio_{m}": statistics.median(ratios[m]) for m in MODES},
        "ratio_inline_low": inline.low, "ratio_inline_high": inline.high,
        "inline_ms": statistics.median(times["inline"]) * 1e3}
    line = (f"{n} blocks: ratio {spread['median']:.2f} ({spread['min']:.2f}-"
            f"{spread['max']:.2f} over {rounds} rounds, 95% interval {iv.low:.2f}-"
            f"{iv.high:.2f}; raw {raw * 1e3:.2f} ms, connector {conn * 1e3:.2f} ms; "
            + ", ".join(f"{m} {statistics.median(ratios[m]):.2f}" for m in MODES) + ")")
    if times.get("keyed"):
        cost = _spread(ratios["keyed_vs_plain"])
        # each round's load time in units of its own pair's raw read, compared over the rounds
        kiv = compare([c / r for c, r in zip(medians[DEFAULT_MODE], medians["raw"], strict=True)],
                      [c / r for c, r in zip(medians["keyed"], medians["raw_keyed"],
                                             strict=True)])
        plain_keyed = [c / k for c, k in zip(medians[DEFAULT_MODE], medians["keyed"],
                                             strict=True)]
        row.update(keyed_ms=statistics.median(times["keyed"]) * 1e3,
                   keyed_raw_ms=statistics.median(times["raw_keyed"]) * 1e3,
                   # the keyed connector against its own pair's raw read
                   ratio_keyed=statistics.median(r / k for r, k in zip(
                       medians["raw_keyed"], medians["keyed"], strict=True)),
                   keyed_vs_plain=cost["median"], keyed_vs_plain_min=cost["min"],
                   keyed_vs_plain_max=cost["max"], keyed_vs_plain_low=kiv.low,
                   keyed_vs_plain_high=kiv.high,
                   keyed_vs_plain_time=statistics.median(plain_keyed))
        line += (f"; keyed {row['keyed_ms']:.2f} ms (its raw read {row['keyed_raw_ms']:.2f} "
                 f"ms), plain / keyed in raw units {cost['median']:.2f} ({cost['min']:.2f}-"
                 f"{cost['max']:.2f}, 95% interval {kiv.low:.2f}-{kiv.high:.2f}; "
                 f"{row['keyed_vs_plain_time']:.2f} in time)")
    print(line, flush=True)
    return row


def run(args: argparse.Namespace) -> int:
    from vllm_ascend.distributed.kv_transfer.core.device import usable_cpus

    from .benchutil import (
        format_table,
        write_results,
    )

    sizes = args.sizes or ([1, 16] if args.quick else [1, 16, 128])
    rounds = 3 if args.quick else args.rounds
    pairs = 2 if args.quick else args.pairs
    cpus = usable_cpus()
    # the connector is measured over the transport of the raw read it is compared with: P
    # (spawned, with this environment) advertises no same-host reads, D makes none
    samples: list[dict[str, Any]] = []
    with environ({LOCAL_READS_ENV: "0"}):
        rows = _measure(sizes, rounds, pairs, keyed=args.auth, layers=args.layers,
                        samples=samples)
    cols = ["blocks", "bytes", "raw_GBps", "connector_GBps", "ratio", "ratio_min", "ratio_max",
            "raw_ms", "connector_ms", *(f"ratio_{m}" for m in MODES), "window_reads"]
    if args.auth:
        cols += ["keyed_ms", "keyed_vs_plain", "keyed_vs_plain_low", "keyed_vs_plain_high"]
    print(format_table(rows, cols))
    path = write_results("p2p", {
        "description": "MooncakeConnectorV1 load timed from the moment D's scheduler sees the "
                       "request (within P's read window: read at once, no claim; ahead: "
                       "params without the window, the scheduler sends the claim then, the "
                       "worker reads at once and gets the answer with the next step's "
                       f"metadata, one engine step every {ENGINE_STEP_S * 1e3:g} ms) until "
                       "the worker marks the request finished receiving, vs one raw Mooncake "
                       "batch read (its synchronous call) of the same "
                       "ranges, TCP on loopback (the connector's same-host reads off: "
                       "both over the same transport), P in another process; "
                       f"{rounds} rounds of {pairs} alternating loads of each ({SMALL_LOADS} / "
                       f"blocks times as many below that many blocks, at most "
                       f"{SMALL_LOADS_MAX} times), ratio = the "
                       "median over the rounds of raw / connector (each round's medians), "
                       "with min-max; ratio_overlapped / ratio_claims_first: the worker "
                       f"claiming itself, overlapped with the read or before it ({cpus} CPUs); "
                       "ratio_inline: window loads with inline_reads on (read from "
                       "start_load_kv, its end polled: no pull thread), with its 95% paired "
                       "bootstrap interval (ratio_inline_low / _high)"
                       + ("; keyed: a second P and D pair with a deployment key (sealed "
                          "frames, claim tokens, regions with the grant), its loads (made "
                          "as the plain pair's) and its own raw reads alternating with the "
                          "others in the same rounds; keyed_vs_plain = the median over the "
                          "rounds of plain connector time / keyed connector time, each in "
                          "units of its own pair's raw read (the two P processes' memory "
                          "reads at different speeds), with min-max and the 95% paired "
                          "bootstrap interval over the rounds; keyed_vs_plain_time: the "
                          "same in plain time" if args.auth else ""),
        "claim_mode": DEFAULT_MODE,
        "cpus": cpus,
        "rounds": rounds,
        "pairs": pairs,
        "goal": "ratio >= 0.9 (the 95% bootstrap interval over the rounds at or above 0.9 to "
                "count as met)",
        "layout": {"layers": args.layers, "block_bytes_per_layer": HEADS * BLOCK_TOKENS * 2 *
                   HEAD_SIZE * 2},
        "keyed": bool(args.auth),
        "results": rows}, args.out, args=args, samples=samples)
    print(f"results: {path}")
    return 0


def _sizes_arg(text: str) -> list[int]:
    """``--sizes``: distinct block counts of at least 1, in increasing order."""
    try:
        sizes = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of block counts: "
                                         f"{text!r}") from None
    if not sizes or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"block counts must be at least 1: {text!r}")
    return sizes


def add_parser(subparsers: Any) -> None:
    """Register ``vllm-ascend-kv bench p2p``."""
    from .benchutil import add_common_args

    p = subparsers.add_parser("p2p", help="pull connector transfer vs the raw Mooncake engine")
    add_common_args(p)
    p.add_argument("--rounds", type=int, default=7,
                   help="rounds per size (each gives one ratio; median and min-max reported)")
    p.add_argument("--pairs", type=int, default=3,
                   help="alternating loads of the raw engine and each claim mode per round")
    p.add_argument("--layers", type=int, default=LAYERS,
                   help="KV cache layers of both workers (each a byte range of every block "
                        "read; real models have 32-80; default: %(default)s)")
    p.add_argument("--sizes", type=_sizes_arg, default=None,
                   help="blocks a load, comma-separated (default 1,16,128; --quick 1,16)")
    p.add_argument("--auth", action="store_true",
                   help="a second pair with a deployment key, its loads alternating with the "
                        "others (keyed_* in each result)")
    p.set_defaults(func=run)
