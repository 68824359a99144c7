# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench fleet``: routers side by side in front of a simulated fleet.

For each fleet size N (half P, half D: :mod:`.fleet`, one child process), each trace
(``conversation``: the Mooncake conversation trace when found; ``deep-prefix-tree`` and
``zipf-scans`` of ``bench trace``), each router and policy (:mod:`.routers`) and each
request rate: the fleet's caches are emptied, the router is started anew, and the trace's
first ``rate * duration`` requests go at that rate (:mod:`.load`). Trace hash ids become
blocks of 16 token ids (one fixed random block an id; equal ids, equal prefix), at most
``--max-blocks`` blocks a prompt. With ``--churn``, one more run per router at the highest
rate with 10% of P added, drained and killed mid-run (a fresh fleet after it). With
``--rounds R`` every point is measured R times, the routers in turns (their order reversed
every other round): a run's ``round`` says which, and the ledger's series of a point hold
its rounds (the report's median and interval over them).

Results: ``<out>/fleet.json`` (every run's figures and raw samples) and, in a checkout, an
entry of the results ledger (``--ledger``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..benchutil import Steps, add_common_args, format_table, write_results
from ..ledger import series
from .load import Churn, churn_figures, drive, fleet_stats, summarize
from .routers import Router, parse_spec

logger = logging.getLogger(__name__)

NAME = "fleet"
BLOCK = 16
VOCAB = 8192
TRACES = ("conversation", "deep-prefix-tree", "zipf-scans")
DEFAULT_ROUTERS = ("none:round_robin", "ours:round_robin", "ours:kv_aware",
                   "vllm-router:round_robin", "vllm-router:cache_aware")


def trace_prompts(name: str, n: int, max_blocks: int, seed: int
                  ) -> tuple[list[list[int]], list[list[int]], str]:
    """The first ``n`` requests of trace ``name``: prompts of token ids, their hash-id
    chains, and where they came from."""
    from ..router_workload import default_trace, load_trace, scale, synthetic_trace
    from ..trace_gen import GENERATORS

    if name == "conversation":
        path = default_trace()
        if path is not None:
            hashes = load_trace(path, n, max_blocks)
            source = f"{path.name} (first {len(hashes)} requests)"
        else:
            hashes = synthetic_trace(n, max_blocks, seed)
            source = "synthetic conversation-shaped workload (no trace file found)"
    else:
        hashes = [ids[:max_blocks] for ids in GENERATORS[name](n, seed)]
        source = f"trace_gen.{name} (seed {seed})"
    return scale(hashes, BLOCK, VOCAB, seed), hashes, source


class FleetProc:
    """The fleet child process (:mod:`.fleet`)."""

    def __init__(self, n_prefill: int, n_decode: int, args: argparse.Namespace,
                 logs: Path) -> None:
        cmd = [sys.executable, "-m", "vllm_ascend.distributed.kv_transfer.bench.fleet.fleet",
               "--prefill", str(n_prefill), "--decode", str(n_decode),
               "--time-scale", str(args.time_scale), "--capacity", str(args.capacity)]
        if args.cost_model:
            cmd += ["--cost-model", args.cost_model]
        self.log = open(logs / f"fleet-{n_prefill}p{n_decode}d.log", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log,
                                     start_new_session=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fleet did not start (exit {self.proc.wait()})")
        info = json.loads(line)
        self.control: str = info["control"]
        self.prefill = [i for i in info["instances"] if i["role"] == "prefill"]
        self.decode = [i for i in info["instances"] if i["role"] == "decode"]

    def reset(self) -> None:
        import urllib.request

        req = urllib.request.Request(self.control + "/fleet/reset", data=b"{}", method="POST")
        urllib.request.urlopen(req, timeout=30).read()

    def stop(self) -> None:
        from ..procs import stop

        stop(self.proc, timeout=10)  # type: ignore[arg-type]
        self.log.close()


def one_run(fleet: FleetProc, kind: str, policy: str, prompts: list[list[int]],
            hashes: list[list[int]], rate: float, args: argparse.Namespace, logs: Path,
            churn: Churn | None = None) -> dict[str, Any]:
    """One router and policy at one rate on emptied caches; its row (with raw samples)."""
    from vllm_ascend.distributed.kv_transfer.core.net import free_port

    from ..router_workload import best_achievable

    fleet.reset()
    time.sleep(0.3)  # the cleared events reach the subscribers before the router starts
    base, _, replicas = parse_spec(f"{kind}:{policy}")
    router = Router(base, policy, fleet.prefill, fleet.decode, logs, free_port(), replicas)
    row: dict[str, Any] = {"router": kind, "policy": policy, "rate": rate,
                           "churn": churn is not None}
    try:
        router.start(args.startup_timeout)
    except Exception as exc:  # recorded, never fatal (start stopped the process)
        return {**row, "status": "failed", "reason": str(exc)[-800:]}
    cpu_before = router.cpu_seconds()
    try:
        samples, t0, wall = asyncio.run(drive(
            router, prompts, rate, fleet_url=fleet.control, prefill=fleet.prefill,
            decode=fleet.decode, output_len=args.output_len, seed=args.seed, churn=churn))
        stats = asyncio.run(fleet_stats(fleet.control)) if churn is not None else {}
        cpu_after = router.cpu_seconds()
    finally:
        router.stop()
    row.update(status="ok", wall_s=wall,
               **summarize(samples, best_achievable(hashes, BLOCK), wall))
    if cpu_before is not None and cpu_after is not None and row["completed"]:
        # the router process's CPU time a completed request (ms), health checks included
        row["router_cpu_ms_per_request"] = (cpu_after - cpu_before) * 1000 / row["completed"]
    if churn is not None:
        row["churn_figures"] = churn_figures(churn, stats)
    row["samples"] = [s.row(t0) for s in samples]
    return row


def run(args: argparse.Namespace) -> int:
    """Entry of ``vllm-ascend-kv bench fleet``."""
    logging.basicConfig(level=logging.INFO)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line a request otherwise
    if args.quick:  # a smoke run: 4 instances, one short trace, no vllm-router needed
        args.instances, args.rates, args.traces = "4", "20", "deep-prefix-tree"
        args.routers, args.duration = "none:round_robin,ours:round_robin", 2.0
    routers = [tuple(r.split(":", 1)) for r in args.routers.split(",")]
    for spec in args.routers.split(","):
        try:
            parse_spec(spec)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
    sizes = [int(n) for n in args.instances.split(",")]
    rates = [float(r) for r in args.rates.split(",")]
    traces = args.traces.split(",")
    out = Path(args.out)
    logs = out / "fleet-logs"
    logs.mkdir(parents=True, exist_ok=True)
    matrix = args.churn != "only"
    rounds = max(1, int(args.rounds))
    total = rounds * len(sizes) * (len(traces) * len(routers) * len(rates) * matrix
                                   + (len(routers) if args.churn != "no" else 0))
    steps = Steps(total, NAME)
    runs: list[dict[str, Any]] = []
    workloads: dict[str, Any] = {}
    for n in sizes:
        n_p, n_d = n // 2, n - n // 2
        fleet = FleetProc(n_p, n_d, args, logs)
        try:
            for trace in traces if matrix else ():
                for rate in rates:
                    count = max(1, int(rate * args.duration))
                    prompts, hashes, source = trace_prompts(trace, count, args.max_blocks,
                                                            args.seed)
                    workloads[f"{trace}@{count}"] = {
                        "source": source, "requests": len(prompts),
                        "prompt_tokens": sum(map(len, prompts))}
                    for rnd, (kind, policy) in turns(routers, rounds):
                        steps.step(f"N={n} {trace} {kind}:{policy} {rate:g}/s, round {rnd}")
                        row = {"instances": n, "prefill": n_p, "decode": n_d, "trace": trace,
                               "round": rnd, **one_run(fleet, kind, policy, prompts, hashes,
                                                       rate, args, logs)}
                        runs.append(row)
                        steps.note(_line(row))
            if args.churn != "no":
                rate, trace = max(rates), traces[0]
                count = max(1, int(rate * args.duration))
                prompts, hashes, _ = trace_prompts(trace, count, args.max_blocks, args.seed)
                for rnd, (kind, policy) in turns(routers, rounds):
                    fleet.stop()
                    fleet = FleetProc(n_p, n_d, args, logs)
                    steps.step(f"N={n} churn {kind}:{policy} {rate:g}/s, round {rnd}")
                    churn = Churn(max(1, n_p // 10))
                    row = {"instances": n, "prefill": n_p, "decode": n_d, "trace": trace,
                           "round": rnd, **one_run(fleet, kind, policy, prompts, hashes, rate,
                                                   args, logs, churn)}
                    runs.append(row)
                    steps.note(_line(row) + f"; churn {row.get('churn_figures', {})}")
        finally:
            fleet.stop()
    table = [{k: v for k, v in r.items() if k not in ("samples", "churn_figures")}
             for r in runs]
    print(format_table(table, ["instances", "trace", "router", "policy", "rate", "churn",
                               "achieved_rps", "failed", "router_p50_ms", "router_p99_ms",
                               "hit_rate", "best_hit_rate", "ttft_model_p99_ms"]))
    from .model import CostModel

    cost = CostModel.load(Path(args.cost_model) if args.cost_model else None, args.time_scale)
    payload = {
        "description": "routers in front of a simulated fleet (half P, half D; stand-ins for "
                       "vllm serve with a prefix cache, KV events and a cost model fitted on "
                       "the CPU engine): router-added latency, hit rate, modelled TTFT, churn",
        "config": {"instances": sizes, "rates": rates, "traces": traces,
                   "routers": [f"{k}:{p}" for k, p in routers], "duration_s": args.duration,
                   "rounds": rounds,
                   "output_len": args.output_len, "max_blocks": args.max_blocks,
                   "block_size": BLOCK, "capacity_blocks": args.capacity,
                   "cost_model": cost.describe(), "loadavg_start": list(os.getloadavg())},
        "workloads": workloads, "runs": runs,
        "status": "ok" if all(r.get("status") == "ok" for r in runs) else "partial"}
    path = write_results(NAME, payload, out, args=args, samples=ledger_series(runs))
    print(f"results: {path}")
    return 0


def turns(routers: Sequence[tuple[str, ...]], rounds: int
          ) -> Iterator[tuple[int, tuple[str, ...]]]:
    """``(round, router)`` in the order they run: every router once a round, the order
    reversed every other round (a router is not always the one after a fresh fleet)."""
    for rnd in range(rounds):
        for router in (routers if rnd % 2 == 0 else list(reversed(routers))):
            yield rnd, router


def ledger_series(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ledger's raw samples: for each point (fleet size, trace, router, policy, rate,
    churn) and each of ``router_s`` (router-added seconds of a completed request) and
    ``ttft_model_s``, one series whose rounds are the point's runs, each with every
    request's value (the per-request rows, status and tokens too, are in the result)."""
    points: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in runs:
        if r.get("status") == "ok":
            key = (r["instances"], r["trace"], r["router"], r["policy"], r["rate"], r["churn"])
            points.setdefault(key, []).append(r)
    out = []
    for (n, trace, router, policy, rate, churn), rs in points.items():
        rs = sorted(rs, key=lambda r: int(r.get("round") or 0))
        tags = {"instances": n, "trace": trace, "router": router, "policy": policy,
                "rate": rate, "churn": churn}
        for what in ("router_s", "ttft_model_s"):
            out.append(series({**tags, "what": what},
                              [[s[what] for s in r.get("samples", [])
                                if s.get("status") == 200 and s.get(what) is not None]
                               for r in rs]))
    return out


def _line(row: dict[str, Any]) -> str:
    def f(v: Any) -> str:
        return f"{v:.3g}" if isinstance(v, int | float) else "-"

    if row.get("status") != "ok":
        return f"{row['router']}:{row['policy']}: {row.get('reason', '')[-300:]}"
    return (f"{row['router']}:{row['policy']}: router p50 {f(row['router_p50_ms'])} ms p99 "
            f"{f(row['router_p99_ms'])} ms, hit {f(row['hit_rate'])} of best "
            f"{f(row['best_hit_rate'])}, TTFT p99 {f(row['ttft_model_p99_ms'])} ms, "
            f"{row['failed']} failed, {f(row['achieved_rps'])}/s")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench fleet`` (the ``vllm_ascend_kv.bench`` entry point)."""
    p = subparsers.add_parser(NAME, help="our proxy and vllm-router side by side in front of "
                                         "a simulated fleet (16-256 instances): router-added "
                                         "latency, prefix hit rate, churn")
    add_common_args(p)
    p.add_argument("--instances", default="16,64",
                   help="fleet sizes, comma-separated (half P, half D; default %(default)s)")
    p.add_argument("--rates", default="50,100,200", help="requests a second, comma-separated")
    p.add_argument("--traces", default=",".join(TRACES), help="traces, comma-separated")
    p.add_argument("--routers", default=",".join(DEFAULT_ROUTERS),
                   help="ROUTER:POLICY, comma-separated; routers: ours, vllm-router, none "
                        "(the client routes, the baseline), ours*N (N replicas of our proxy, "
                        "the requests spread over them in turn) (default: %(default)s)")
    p.add_argument("--duration", type=float, default=8.0,
                   help="seconds of load a run (rate * duration requests)")
    p.add_argument("--output-len", type=int, default=16, help="tokens each request decodes")
    p.add_argument("--max-blocks", type=int, default=64, help="blocks of 16 a prompt at most")
    p.add_argument("--capacity", type=int, default=8192, help="blocks each instance caches")
    p.add_argument("--time-scale", type=float, default=0.02,
                   help="the cost model's times times this (default %(default)s: the CPU "
                        "engine's prefill of 1,000 tokens, about 1 s, becomes 20 ms)")
    p.add_argument("--cost-model", default=None,
                   help="a costfit JSON (default: the committed fit, fleet/costmodel.json)")
    p.add_argument("--churn", choices=("no", "also", "only"), default="no",
                   help="also (or only) one run per router at the highest rate on the first "
                        "trace with 10%% of P added, drained and killed (default: no)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1,
                   help="measure every point this many times, the routers in turns (the "
                        "report's goal rows need 9; default %(default)s)")
    p.add_argument("--startup-timeout", type=float, default=120.0)
    p.set_defaults(func=run)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-ascend-kv bench")
    add_parser(parser.add_subparsers(dest="bench", required=True))
    args = parser.parse_args([NAME, *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
