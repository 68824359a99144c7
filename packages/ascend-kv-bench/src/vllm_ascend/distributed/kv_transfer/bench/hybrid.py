# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench hybrid``: a sliding-window model through the P/D pull, HMA on and off.

vLLM's hybrid KV cache manager (HMA) keeps a sliding-window layer's KV for the window only;
without it every layer keeps the whole prompt's. ``MooncakeConnectorV1`` serves both (issue
52). This section measures what HMA changes for P/D on one model: bench serve's random Llama
(8 layers) whose ``layer_types`` alternate ``sliding_attention`` (``--window`` tokens) and
``full_attention``, untied embeddings, float32.

Four real vLLM CPU engines run side by side, each in its own process (bench serve's
:class:`~.serve.child.EngineChild`): P and D with HMA on,
P and D with it off (``disable_hybrid_kv_cache_manager``). Each round sends one new prompt of
each length (2,048 and 8,192 tokens by default) through both pairs, the pair that goes first
alternating round by round: P prefills it (``max_tokens=1``), D gets P's params and computes
its first token. Per request:

``bytes``
    KV bytes D read (the connector's ``p2p_transfer_bytes``): HMA on moves the window's
    blocks of the sliding layers, HMA off every layer's whole prompt.
``ttft``
    D's time from the request to its first token (the KV read included), as
    ``LLM.generate`` sees it in D's process.
``fit``
    requests of that length that fit in D's KV cache at once (vLLM's own
    ``get_max_concurrency_for_kv_cache_config``, each engine's cache of
    ``VLLM_CPU_KVCACHE_SPACE`` GiB; vLLM counts a window group's blocks for the window plus
    ``max_num_batched_tokens``, ``--max-batched-tokens``).

Reported per length: the medians, HMA on / off with the paired bootstrap interval over the
rounds (``stats.compare``), whether D's first tokens agree between the pairs, and every raw
sample in the ledger. Writes ``<out>/hybrid.json``; never fails on a number.
"""

from __future__ import annotations

import argparse
import logging
import math
import random
import statistics
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from vllm_ascend.distributed.kv_transfer.core.net import free_port

from .benchutil import add_common_args, format_table, write_results
from .ledger import series
from .serve.child import EngineChild
from .serve.scenarios import make_model
from .serve.spec import BENCH_MODEL, QUICK_MODEL
from .stats import compare

logger = logging.getLogger(__name__)

#: Prompt lengths of a full run and of --quick.
LENGTHS = (2048, 8192)
QUICK_LENGTHS = (256, 512)
MODES = ("on", "off")


def model_spec(window: int, quick: bool) -> dict[str, Any]:
    """The model: bench serve's (or --quick's) Llama with alternating window layers."""
    base: dict[str, Any] = dict(QUICK_MODEL if quick else BENCH_MODEL)
    layers = int(base["num_hidden_layers"])
    base.update(max_position_embeddings=16384, sliding_window=window, tie_word_embeddings=False,
                layer_types=["sliding_attention", "full_attention"] * (layers // 2))
    return base


# ---------------------------------------------------------------------- engine processes
#: this module, for the functions an engine runs (:meth:`EngineChild.probe`)
HERE = __name__


def kv_cache_groups(llm: Any) -> list[str]:
    """Runs in an engine: its KV cache groups' spec classes."""
    cfg = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config
    return [type(g.kv_cache_spec).__name__ for g in cfg.kv_cache_groups]


def bytes_moved(llm: Any) -> float:
    """Runs in an engine: the bytes its P/D connector moved so far (``p2p_transfer_bytes``)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    recorder = getattr(get_kv_transfer_group(), "recorder", None)
    return float(recorder.totals().get("p2p_transfer_bytes", 0)) if recorder else 0.0


def requests_that_fit(llm: Any, tokens: int) -> float:
    """Runs in an engine: requests of ``tokens`` tokens its KV cache holds at once (vLLM's own
    ``get_max_concurrency_for_kv_cache_config``)."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    core = llm.llm_engine.engine_core.engine_core
    vc, kcc = core.vllm_config, core.scheduler.kv_cache_config
    saved = vc.model_config.max_model_len
    try:
        vc.model_config.max_model_len = int(tokens)
        return float(get_max_concurrency_for_kv_cache_config(vc, kcc))
    finally:
        vc.model_config.max_model_len = saved


@contextmanager
def engines(model: Path, *, block_size: int, max_len: int, kv_space_gib: int, timeout: float,
            batched_tokens: int, logs: Path) -> Iterator[dict[tuple[str, str], EngineChild]]:
    """P and D with HMA on and off: ``{(mode, "p" or "d"): EngineChild}`` (bench serve's
    engine processes, their output in ``logs``)."""
    started: dict[tuple[str, str], EngineChild] = {}
    try:
        for mode in MODES:
            for role, kv_role in (("p", "kv_producer"), ("d", "kv_consumer")):
                kw: dict[str, Any] = dict(
                    model=str(model), skip_tokenizer_init=True, dtype="float32",
                    max_model_len=max_len, enforce_eager=True, max_num_seqs=4, seed=0,
                    block_size=block_size, enable_prefix_caching=True,
                    max_num_batched_tokens=batched_tokens,
                    kv_transfer_config={
                        "kv_connector": "MooncakeConnectorV1", "kv_role": kv_role,
                        "kv_port": free_port(), "engine_id": f"hybrid-{mode}-{role}",
                        "kv_load_failure_policy": "fail",
                        "kv_connector_extra_config": {"lease_ttl_s": 120,
                                                      "load_timeout_s": timeout}})
                if mode == "off":
                    kw["disable_hybrid_kv_cache_manager"] = True
                engine = EngineChild(kw, env={"VLLM_CPU_KVCACHE_SPACE": str(kv_space_gib)},
                                     log=logs / f"{mode}-{role}.log", timeout=timeout)
                started[(mode, role)] = engine
                found = engine.probe(f"{HERE}:kv_cache_groups")
                if (len(found) > 1) != (mode == "on"):
                    raise RuntimeError(f"HMA {mode} engine has KV cache groups {found}")
        yield started
    finally:
        for e in started.values():
            e.close()


# ---------------------------------------------------------------------- the rounds
def one_request(p: EngineChild, d: EngineChild, prompt: list[int]) -> dict[str, Any]:
    """P prefills ``prompt``, D computes its first token from P's KV."""
    [pre] = p.generate([prompt], kv_params=[{"do_remote_decode": True,
                                             "do_remote_prefill": False}])["outputs"]
    params = pre["kv_transfer_params"]
    if not isinstance(params, dict) or not params.get("do_remote_prefill"):
        raise RuntimeError(f"P returned no kv_transfer_params: {pre}")
    before = d.probe(f"{HERE}:bytes_moved")
    out = d.generate([prompt], kv_params=[params])
    [got] = out["outputs"]
    if got["finish_reason"] != "length":
        raise RuntimeError(f"D's request ended with {got['finish_reason']}")
    return {"ttft": out["seconds"], "bytes": d.probe(f"{HERE}:bytes_moved") - before,
            "token": got["tokens"][:1]}


def run_rounds(pairs: dict[tuple[str, str], EngineChild], lengths: tuple[int, ...], rounds: int,
               vocab: int) -> dict[str, Any]:
    """``rounds`` alternating rounds; the samples by mode, length and metric."""
    rng = random.Random(52)
    samples: dict[tuple[str, int, str], list[float]] = {}
    agree: dict[int, list[bool]] = {n: [] for n in lengths}
    for r in range(rounds):
        order = MODES if r % 2 == 0 else tuple(reversed(MODES))
        for n in lengths:
            prompt = [rng.randrange(3, vocab) for _ in range(n)]
            first: dict[str, list[int]] = {}
            for mode in order:
                got = one_request(pairs[(mode, "p")], pairs[(mode, "d")], prompt)
                samples.setdefault((mode, n, "ttft"), []).append(got["ttft"])
                samples.setdefault((mode, n, "bytes"), []).append(float(got["bytes"]))
                first[mode] = got["token"]
            agree[n].append(first["on"] == first["off"])
        print(f"\rround {r + 1}/{rounds}", end="", flush=True)
    print()
    fit = {(mode, n): pairs[(mode, "d")].probe(f"{HERE}:requests_that_fit", tokens=n)
           for mode in MODES for n in lengths}
    return {"samples": samples, "agree": agree, "fit": fit}


def summarize(measured: dict[str, Any], lengths: tuple[int, ...]) -> list[dict[str, Any]]:
    """Per length: medians, HMA on / off with its interval, fit, agreement."""
    s, rows = measured["samples"], []
    for n in lengths:
        row: dict[str, Any] = {"prompt_tokens": n}
        for metric in ("ttft", "bytes"):
            on, off = s[("on", n, metric)], s[("off", n, metric)]
            row[f"{metric}_on"] = statistics.median(on)
            row[f"{metric}_off"] = statistics.median(off)
            row[f"{metric}_on_over_off"] = compare(on, off).as_dict()
        fit_on, fit_off = measured["fit"][("on", n)], measured["fit"][("off", n)]
        row["fit_on"], row["fit_off"] = fit_on, fit_off
        row["fit_on_over_off"] = fit_on / fit_off if fit_off else math.nan
        row["first_token_agrees"] = all(measured["agree"][n])
        rows.append(row)
    return rows


# ---------------------------------------------------------------------- CLI
def run(args: argparse.Namespace) -> int:
    """Run the section; print and write the results."""
    lengths = tuple(args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS))
    rounds = args.rounds or (2 if args.quick else 9)
    spec = model_spec(args.window, args.quick)
    model = Path(args.model_dir or Path(args.out) / "hybrid-model")
    make_model(model, spec)
    max_len = max(lengths) + args.block_size
    batched = min(args.max_batched_tokens, max_len)
    with engines(model, block_size=args.block_size, max_len=max_len,
                 kv_space_gib=args.kv_space_gib, timeout=args.timeout,
                 batched_tokens=batched, logs=Path(args.out) / "hybrid-logs") as pairs:
        measured = run_rounds(pairs, lengths, rounds, int(spec["vocab_size"]))
    rows = summarize(measured, lengths)
    payload = {"model": spec, "block_size": args.block_size, "window": args.window,
               "kv_space_gib": args.kv_space_gib, "max_num_batched_tokens": batched,
               "rounds": rounds, "lengths": list(lengths),
               "rows": rows}
    samples = [series({"mode": mode, "prompt_tokens": n, "metric": metric},
                      [[x] for x in values], unit="s" if metric == "ttft" else "bytes")
               for (mode, n, metric), values in sorted(measured["samples"].items())]
    path = write_results("hybrid", payload, args.out, args=args, samples=samples)
    def interval(c: dict[str, Any]) -> str:
        return f"{c['ratio']:.3f} [{c['low']:.3f}, {c['high']:.3f}]" if c["low"] else "-"

    print(format_table([{
        "tokens": r["prompt_tokens"], "KV bytes on": r["bytes_on"], "off": r["bytes_off"],
        "on/off": r["bytes_on_over_off"]["ratio"], "D TTFT on (ms)": r["ttft_on"] * 1e3,
        "off (ms)": r["ttft_off"] * 1e3, "on/off [95%]": interval(r["ttft_on_over_off"]),
        "fit on": r["fit_on"], "fit off": r["fit_off"],
        "same 1st token": r["first_token_agrees"]} for r in rows]))
    print(f"results: {path}")
    return 0


def add_parser(subparsers: Any) -> None:
    """Add ``bench hybrid`` to the ``vllm-ascend-kv bench`` subcommands."""
    p = subparsers.add_parser("hybrid", help="a sliding-window model through the P/D pull with "
                                             "vLLM's hybrid KV cache manager on and off")
    add_common_args(p)
    p.add_argument("--lengths", type=int, nargs="+",
                   help=f"prompt lengths (default {' '.join(map(str, LENGTHS))}; --quick "
                        f"{' '.join(map(str, QUICK_LENGTHS))})")
    p.add_argument("--rounds", type=int, help="alternating rounds (default 9; --quick 2)")
    p.add_argument("--window", type=int, default=1024,
                   help="sliding window of the window layers, tokens (default %(default)s)")
    p.add_argument("--block-size", type=int, default=128,
                   help="KV block size (default %(default)s, as bench serve)")
    p.add_argument("--kv-space-gib", type=int, default=2,
                   help="VLLM_CPU_KVCACHE_SPACE of each engine (default %(default)s)")
    p.add_argument("--max-batched-tokens", type=int, default=2048,
                   help="max_num_batched_tokens of the engines (default %(default)s, vLLM's "
                        "chunked-prefill default; vLLM counts a window group's blocks a request "
                        "as window + this many tokens when it says how many requests fit)")
    p.add_argument("--model-dir", help="where the model is saved (default: under --out)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per engine call")
    p.set_defaults(func=run)
