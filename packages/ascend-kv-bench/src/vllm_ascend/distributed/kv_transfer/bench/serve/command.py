# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench serve``: real vLLM CPU engines with and without each connector.

Every engine runs in its own process (:mod:`.child`; vLLM keeps global
state) on the same model and the same token-id prompts, greedy, so the first
token of every run is checked against the engine without a connector.

The scenarios (:func:`scenarios`, declared as :class:`~.spec.Scenario`, run by the flows of
:mod:`.scenarios`): ``baseline`` (no connector: cold time to first token, TTFT = wall time
of ``generate(max_tokens=1)``; recompute after ``reset_prefix_cache()``; the hit of vLLM's
own device prefix cache, the floor of any external cache on this engine; throughput of a
batch) and vLLM's own connectors (:mod:`.builtin`); ours (:mod:`.p2p`, :mod:`.pool`,
:mod:`.offload`) and any other package's come through the ``vllm_ascend_kv.serve`` entry
points, with the comparisons against vLLM's they want reported. P/D scenarios (``pd/...``)
time D's TTFT with P's KV; pool and offload scenarios (``pool/...``,
``offload/...``) time the cold request (a miss, with the save) and the hit from
the connector's storage after ``reset_prefix_cache()`` (vLLM's cache only).

Prompt lengths are ``k*block``, ``k*block + 1`` (a length ``ExampleConnector``
never hits) and ``k*block + block/2``; P/D prompts are ``--pd-tokens`` long
(2,048 and 8,192). The scenarios are measured in ``--rounds`` alternating rounds
with their engines kept up (:mod:`.rounds`: P/D's, then the others' together), P/D under
each ``--pd-bindings`` thread binding. Writes ``<out>/serve.json`` with every
measurement, the per-round series with the overheads over the floor, and the
ratios with their intervals (:mod:`.report`, :mod:`.compare`:
connector / no connector, ours / peer at its best binding, with the declared
goals) and prints a table; never fails on a number.

Every engine first serves a request of the longest prompt and a throughput batch, reported
apart (``warm_up``), and runs with glibc's malloc keeping what it frees
(:data:`~..engine_env.STEADY_MALLOC_ENV`): the rounds then measure engines in their steady
state, not the first touch of memory that a shared machine makes slow.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.tooling import plugins

from ..benchutil import Steps, add_common_args, format_table, write_results
from .builtin import NOT_ON_CPU, builtin_scenarios
from .compare import interval_comparisons, ledger_series, round_series
from .needs import PEERS_DIR, PEERS_ENV, peers_path
from .report import summarize, table_rows
from .rounds import families, run_rounds
from .scenarios import Run, engine_malloc_env, make_model, prompt_lengths
from .spec import (
    BENCH_MODEL,
    FAMILY_ORDER,
    PD_BINDINGS,
    PD_THREADS_BIND,
    QUICK_MODEL,
    Scenario,
    ServeConfig,
)

logger = logging.getLogger(__name__)


def scenarios() -> list[Scenario]:
    """The built-in scenarios (:mod:`.builtin`) and those of every ``vllm_ascend_kv.serve``
    entry point, in run order: by family (:data:`~.spec.FAMILY_ORDER`, the baseline first),
    ours before vLLM's within one, then as declared."""
    found = list(builtin_scenarios())
    for ep in plugins.entry_points(plugins.SERVE_GROUP):
        try:
            found.extend(ep.load()())
        except Exception as exc:  # one broken plugin must not take the benchmark down
            logger.warning("%s %s unavailable: %s", plugins.SERVE_GROUP, ep.name, exc)

    def order(item: tuple[int, Scenario]) -> tuple[int, int, int]:
        i, sc = item
        fam = FAMILY_ORDER.index(sc.family) if sc.family in FAMILY_ORDER else len(FAMILY_ORDER)
        return fam, 0 if sc.who == "ours" else 1, i

    return [sc for _i, sc in sorted(enumerate(found), key=order)]


def quick_scenarios() -> tuple[str, ...]:
    """Names of the scenarios ``--quick`` runs."""
    return tuple(s.name for s in scenarios() if s.quick)


# ====================================================================== CLI
def build_config(args: argparse.Namespace) -> ServeConfig:
    """The run's configuration from the command line (``--quick``: tiny model)."""
    spec = QUICK_MODEL if args.quick else BENCH_MODEL
    block = args.block_size or (32 if args.quick else 128)
    target = args.prompt_tokens or (2 * block if args.quick else 2048)
    lengths = prompt_lengths(target, block)
    pd_lengths = _ints(args.pd_tokens) if args.pd_tokens else ([2048] if args.quick
                                                                else [2048, 8192])
    need = max(*lengths, *pd_lengths) + 256
    if need > int(spec["max_position_embeddings"]):  # long P/D prompts: a longer context
        spec = {**spec, "max_position_embeddings": 1 << (need - 1).bit_length()}
    model = args.model or str(make_model(
        Path(args.model_dir or Path(tempfile.gettempdir()) /
             ("vakv-serve-quick" if args.quick else "vakv-serve-llama")) / args.dtype,
        spec, args.dtype))
    if args.model:
        cfg_path = Path(args.model) / "config.json"
        if cfg_path.exists():
            spec = {**spec, **{k: v for k, v in json.loads(cfg_path.read_text()).items()
                               if k in spec}}
    thr_prompt = args.throughput_prompt or (block if args.quick else 512)
    if args.pd_threads_bind:  # one binding given: it alone
        bindings: tuple[str, ...] = (f"bind={args.pd_threads_bind}",)
    else:
        bindings = tuple(b.strip() for b in (args.pd_bindings or (
            "nobind" if args.quick else "pinned,nobind")).split(",") if b.strip())
        unknown = [b for b in bindings if b not in PD_BINDINGS and not b.startswith("bind=")]
        if unknown:
            raise SystemExit(f"bench serve: unknown --pd-bindings {unknown}; known: "
                             f"{sorted(PD_BINDINGS)} or bind=<VLLM_CPU_OMP_THREADS_BIND>")
    return ServeConfig(
        model=model, model_spec=dict(spec), dtype=args.dtype, block_size=block, lengths=lengths,
        throughput_batch=args.throughput_batch or (2 if args.quick else 4),
        throughput_prompt=thr_prompt,
        throughput_tokens=args.throughput_tokens or (8 if args.quick else 32),
        max_model_len=max(*lengths, *pd_lengths, thr_prompt) + 256, out=Path(args.out),
        nixl_python=args.nixl_python, peers_path=peers_path(args.peers_path),
        startup_timeout=args.startup_timeout,
        repeats=args.repeats or (1 if args.quick else 2),
        pd_threads_bind=args.pd_threads_bind,
        rounds=args.rounds or (2 if args.quick else 5), pd_lengths=pd_lengths,
        pd_bindings=bindings)


def _ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"bench serve: --pd-tokens takes numbers, got {text!r}") from None
    if not vals or min(vals) <= 0:
        raise SystemExit(f"bench serve: --pd-tokens takes positive numbers, got {text!r}")
    return vals


def select(args: argparse.Namespace) -> list[Scenario]:
    """The scenarios ``--only`` / ``--quick`` ask for (the baseline always runs first)."""
    all_sc = scenarios()
    names = [s.name for s in all_sc]
    if args.only:
        wanted = {n.strip() for n in args.only.split(",") if n.strip()}
        unknown = sorted(wanted - set(names))
        if unknown:
            raise SystemExit(f"bench serve: unknown scenario(s) {unknown}; known: {names}")
    elif args.quick:
        wanted = set(quick_scenarios())
    else:
        wanted = set(names)
    wanted.add("baseline")
    return [s for s in all_sc if s.name in wanted]


def run(args: argparse.Namespace) -> int:
    """Run ``bench serve``: every selected scenario, the summary, the table, ``serve.json``."""
    cfg = build_config(args)
    chosen = select(args)
    steps = Steps(len(chosen), "serve")
    state = Run(cfg, steps)
    try:
        results = run_rounds(state, chosen)
    finally:
        state.close()
    for name, why in NOT_ON_CPU.items():
        results[f"peer/{name}"] = {"family": "peer", "who": "vllm", "connector": name,
                                   "status": "unsupported", "reason": why}
    summary = summarize(results, cfg)
    rounds = {n: r for n, e in results.items() if (r := round_series(e)) is not None}
    comps = interval_comparisons(results, rounds, scenarios())
    rows = table_rows(results, summary)
    print(format_table(rows, ["scenario", "connector", "status", "ttft_s", "vs_recompute",
                              "cold_vs_base", "tput_vs_base", "kv_GBps", "tokens_ok", "note"]))
    measured = [c for c in comps if c["ratio"] is not None]
    if measured:
        print()
        print(format_table(measured, ["what", "ratio", "low", "high", "min", "max", "rounds",
                                      "goal", "met", "note"]))
    path = write_results("serve", {
        "description": "real vLLM CPU engines with and without each connector, same model and "
                       "prompts; TTFT = wall time of generate(max_tokens=1) in the engine "
                       "process",
        "config": {"model": cfg.model, "model_spec": cfg.model_spec, "dtype": cfg.dtype,
                   "block_size": cfg.block_size, "lengths": cfg.lengths,
                   "kv_bytes_per_token": cfg.kv_bytes_per_token,
                   "repeats": cfg.repeats, "rounds": cfg.rounds,
                   # the families measured in one set of rounds, each group's in turns
                   "round_groups": [list(dict.fromkeys(sc.family for sc in members))
                                    for _, members in families(chosen)],
                   "pd_lengths": cfg.pd_lengths, "pd_bindings": list(cfg.pd_bindings),
                   "pd_binding_env": {b: dict(zip(("prefill", "decode"),
                                                  PD_BINDINGS.get(b, (b[5:], b[5:])),
                                                  strict=True))
                                      for b in cfg.pd_bindings},
                   "throughput": {"batch": cfg.throughput_batch,
                                  "prompt_tokens": cfg.throughput_prompt,
                                  "max_tokens": cfg.throughput_tokens},
                   "pd_threads_bind": cfg.pd_threads_bind, "quick": bool(args.quick),
                   "engine_malloc": engine_malloc_env(),
                   "nixl_python": cfg.nixl_python or sys.executable},
        "scenarios": results, "summary": summary, "rounds": rounds, "comparisons": comps,
        "rows": rows}, cfg.out, args=args, samples=ledger_series(results))
    print(f"results: {path}")
    return 0


def add_parser(subparsers: Any) -> None:
    """Register ``vllm-ascend-kv bench serve``."""
    p = subparsers.add_parser(
        "serve", help="real vLLM CPU engines with and without each connector (ours and vLLM's "
                      "own): TTFT and throughput")
    add_common_args(p)
    known = scenarios()
    p.add_argument("--only", default="",
                   help="comma-separated scenarios (default: all; quick: "
                        f"{','.join(s.name for s in known if s.quick)}); known: "
                        + ",".join(s.name for s in known))
    p.add_argument("--model", help="model directory (default: a random Llama made on first use)")
    p.add_argument("--model-dir", help="where the default model is saved")
    p.add_argument("--dtype", default="float32",
                   help="model dtype (default float32: exact token checks; the peer report "
                        "used bfloat16)")
    p.add_argument("--block-size", type=int, default=None, help="KV block size (default 128, "
                                                                "quick 32; a multiple of 32)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="about how long the prompts are (default 2048, quick 2 blocks)")
    p.add_argument("--throughput-batch", type=int, default=None, help="requests of the batch")
    p.add_argument("--throughput-prompt", type=int, default=None, help="tokens per request")
    p.add_argument("--throughput-tokens", type=int, default=None,
                   help="tokens generated per request")
    p.add_argument("--nixl-python", default=os.environ.get("VLLM_ASCEND_KV_BENCH_NIXL_PYTHON"),
                   help="interpreter of an environment with nixl, vllm-cpu and ascend-kv-bench "
                        "for the NixlConnector engines (default: this one)")
    p.add_argument("--peers-path", default=None,
                   help=f"directory of the peer harness modules (default: ${PEERS_ENV}, else "
                        f"those shipped in {PEERS_DIR})")
    p.add_argument("--repeats", type=int, default=None,
                   help="samples of each hit / recompute within a round (median; default 2, "
                        "quick 1)")
    p.add_argument("--rounds", type=int, default=None,
                   help="alternating rounds: P/D's scenarios measured in turns, then the "
                        "others' (pool, offload), "
                        "engines kept up (default 5, quick 2)")
    p.add_argument("--pd-tokens", default=None,
                   help="comma-separated prompt lengths of the P/D scenarios (default "
                        "2048,8192; quick 2048)")
    p.add_argument("--pd-bindings", default=None,
                   help="comma-separated thread bindings the P/D scenarios run under: "
                        f"{', '.join(f'{k} (P {v[0]}, D {v[1]})' for k, v in PD_BINDINGS.items())}"
                        " or bind=<value> (default pinned,nobind; quick nobind)")
    p.add_argument("--pd-threads-bind", default=PD_THREADS_BIND,
                   help="VLLM_CPU_OMP_THREADS_BIND of every P/D engine, one binding only "
                        "(overrides --pd-bindings)")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds an engine may take to start")
    p.set_defaults(func=_checked_run)


def _checked_run(args: argparse.Namespace) -> int:
    if args.rounds is not None and args.rounds < 1:
        raise SystemExit(f"bench serve: --rounds must be at least 1, got {args.rounds}")
    if args.block_size is not None and (args.block_size <= 0 or args.block_size % 32):
        raise SystemExit(f"bench serve: --block-size must be a positive multiple of 32 on CPU, "
                         f"got {args.block_size}")
    return run(args)


if __name__ == "__main__":
    sys.exit("use: vllm-ascend-kv bench serve")
