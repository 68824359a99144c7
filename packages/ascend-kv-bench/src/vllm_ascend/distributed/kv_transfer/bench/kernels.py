# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench kernels``: block gather/scatter throughput against memcpy.

For each block size (16 KiB to 2 MiB) it moves the same number of bytes
several ways in one run: a plain ``copy_`` of one contiguous tensor (the
memcpy baseline), a gather of randomly chosen blocks of a cache twice that
size into a contiguous buffer, the scatter back, and both across several
layers (separate caches, one call for all of them).

Measured for a shared, noisy machine: in every round each kernel and its
memcpy baseline run alternately, call by call, in this one process with the
same threads, and the round's ratio divides their median call times. A row
reports the median ratio of the rounds (at least 5 in a full run) with its
min-max; the goal (>= 0.8 from 64 KiB blocks) is judged on the median at
each point, the worst over block sizes and the four forms. It writes
``<out>/kernels.json``, appends its run with every call time to the results ledger
(``--ledger``, :mod:`.ledger`) and prints a table, and never fails on a number.

Registered under the ``vllm_ascend_kv.bench`` entry-point group (core's CLI
adds it as ``vllm-ascend-kv bench kernels``); ``python -m
vllm_ascend.distributed.kv_transfer.bench.kernels`` runs it without the CLI. It needs only
ascend-kernels and torch (it formats its own output, as it did inside ascend-kernels).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_ascend.distributed.kernels.__about__ import __version__
from vllm_ascend.distributed.kernels.ops import (
    gather_blocks,
    gather_blocks_all_layers,
    scatter_blocks,
    scatter_blocks_all_layers,
)

from .ledger import add_ledger_arg, record, series

logger = logging.getLogger(__name__)

NAME = "kernels"
DEFAULT_OUT_DIR = "bench-results"
KIB = 1024
FULL_BLOCK_SIZES = tuple(k * KIB for k in (16, 32, 64, 128, 256, 512, 1024, 2048))
QUICK_BLOCK_SIZES = tuple(k * KIB for k in (16, 64, 2048))
#: The goal the issue sets on CPU: gather and scatter at >= 0.8 of memcpy from 64 KiB blocks up.
GOAL_RATIO, GOAL_FROM_BYTES = 0.8, 64 * KIB
#: The forms the goal judges: one layer and all layers, gather and scatter.
GOAL_KERNELS = ("gather", "scatter", "gather_layers", "scatter_layers")
#: Rounds and alternating call pairs a round: full runs (the issue asks >= 5 rounds), quick runs.
FULL_ROUNDS, FULL_PAIRS = 9, 9
QUICK_ROUNDS, QUICK_PAIRS = 3, 3
# vLLM's CPU layout with bf16: (num_blocks, kv_heads, block_size=32, 2*head_size=128).
TOKENS_PER_BLOCK, ROW = 32, 128


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add the ``kernels`` benchmark to ``subparsers`` (the entry point core's CLI calls)."""
    p = subparsers.add_parser(
        NAME, help="KV block gather/scatter throughput as a ratio of memcpy",
        description=__doc__.split("\n\n")[1] if __doc__ else None)
    p.add_argument("--quick", action="store_true",
                   help="three block sizes, 16 MiB moved, fewer samples (a smoke run, seconds)")
    p.add_argument("--out", default=os.environ.get("VLLM_ASCEND_KV_BENCH_DIR", DEFAULT_OUT_DIR),
                   help="directory of kernels.json (default: %(default)s)")
    add_ledger_arg(p)
    p.add_argument("--total-mib", type=int, default=None,
                   help="bytes moved per operation, MiB (default: 64, quick: 16)")
    p.add_argument("--device", default="cpu", help="device of the tensors (default: %(default)s)")
    p.add_argument("--layers", type=int, default=4,
                   help="layers of the all-layers forms (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads for the run (default: torch's); on a busy shared "
                        "machine 1 gives the steadiest ratios")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"rounds of alternating samples (default: {FULL_ROUNDS}, quick: "
                        f"{QUICK_ROUNDS})")
    p.add_argument("--reference", action="store_true",
                   help="also time the reference implementation (slow, for comparison)")
    p.set_defaults(func=run)
    return p


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize()  # type: ignore[attr-defined]


def _timed(fn: Callable[[], object], device: torch.device) -> float:
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def round_ratio(fn: Callable[[], object], nbytes: int, baseline: Callable[[], object],
                base_bytes: int, device: torch.device, *, pairs: int,
                times: list[tuple[list[float], list[float]]] | None = None
                ) -> tuple[float, float]:
    """One round: ``pairs`` calls of the kernel and of the baseline, alternating, each timed.

    The order within a pair alternates too (baseline first, then kernel first),
    so that neither always runs on the other's cache leftovers. Each side's
    rate is its bytes over its *median* call time: a call that lost its core
    to another process is an outlier the median ignores, on either side.

    Every call time goes to ``times`` (``(kernel's, baseline's)``) when given.

    Returns:
        ``(kernel rate / baseline rate, baseline bytes/s)``.
    """
    kernel_s, base_s = [], []
    for i in range(pairs):
        if i % 2:
            kernel_s.append(_timed(fn, device))
            base_s.append(_timed(baseline, device))
        else:
            base_s.append(_timed(baseline, device))
            kernel_s.append(_timed(fn, device))
    if times is not None:
        times.append((kernel_s, base_s))
    base_rate = base_bytes / statistics.median(base_s)
    return nbytes / statistics.median(kernel_s) / base_rate, base_rate


def summarize(ratios: Sequence[float]) -> dict[str, float]:
    """Median, min and max of the per-round ratios."""
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def measure(block_bytes: int, total_bytes: int, device: torch.device, *, layers: int,
            rounds: int, pairs: int, reference: bool, seed: int = 0,
            samples: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """One row of results: the memcpy rate and each kernel's ratio to it, over ``rounds`` rounds.

    A round visits every kernel in turn, and for each runs ``pairs`` alternating
    calls of it and of its memcpy baseline (:func:`round_ratio`): one ratio a
    kernel a round. Rounds are spread over the whole measurement of the block
    size, so a burst of load on a shared machine hits one round of each kernel
    rather than every round of one. The row holds, per kernel, the median of
    its rounds (``row[name]``), their min and max (``row["spread"][name]``)
    and every round's ratio (``row["ratios"][name]``); every call time goes to ``samples``,
    a series per kernel and one for its baseline (``ledger.series``).
    """
    dtype = torch.bfloat16
    heads = max(1, block_bytes // (TOKENS_PER_BLOCK * ROW * dtype.itemsize))
    block_shape = (heads, TOKENS_PER_BLOCK, ROW)
    real_block = heads * TOKENS_PER_BLOCK * ROW * dtype.itemsize
    n = max(1, total_bytes // real_block)
    nbytes = n * real_block
    g = torch.Generator().manual_seed(seed)
    cache = torch.empty((2 * n, *block_shape), dtype=dtype, device=device).fill_(1)
    ids = torch.randperm(2 * n, generator=g)[:n].tolist()
    buf = torch.empty((n, *block_shape), dtype=dtype, device=device).fill_(2)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(3)
    dst = torch.empty_like(src)
    per_layer = max(1, n // layers)
    layer_caches = [torch.empty((2 * per_layer, *block_shape), dtype=dtype, device=device)
                    .fill_(1) for _ in range(layers)]
    layer_ids = torch.randperm(2 * per_layer, generator=g)[:per_layer].tolist()
    layer_buf = torch.empty((layers, per_layer, *block_shape), dtype=dtype, device=device)
    layer_bytes = layers * per_layer * real_block
    layer_src = torch.empty(layer_bytes, dtype=torch.uint8, device=device).fill_(3)
    layer_dst = torch.empty_like(layer_src)

    def memcpy() -> None:
        dst.copy_(src)

    def layer_memcpy() -> None:
        layer_dst.copy_(layer_src)

    kernels: dict[str, tuple[Callable[[], object], int, Callable[[], None]]] = {
        "gather": (lambda: gather_blocks(cache, ids, buf), nbytes, memcpy),
        "scatter": (lambda: scatter_blocks(buf, cache, ids), nbytes, memcpy),
        "gather_layers": (lambda: gather_blocks_all_layers(layer_caches, layer_ids, layer_buf),
                          layer_bytes, layer_memcpy),
        "scatter_layers": (lambda: scatter_blocks_all_layers(layer_buf, layer_caches, layer_ids),
                           layer_bytes, layer_memcpy),
    }
    if reference:
        kernels["gather_reference"] = (
            lambda: gather_blocks(cache, ids, buf, impl="reference"), nbytes, memcpy)
        kernels["scatter_reference"] = (
            lambda: scatter_blocks(buf, cache, ids, impl="reference"), nbytes, memcpy)
    for fn, _, base in kernels.values():  # warm-up: first-touch page faults, allocator
        fn()
        base()
    _sync(device)
    ratios: dict[str, list[float]] = {name: [] for name in kernels}
    calls: dict[str, list[tuple[list[float], list[float]]]] = {name: [] for name in kernels}
    base_rates: list[float] = []
    for _ in range(rounds):
        for name, (fn, moved, base) in kernels.items():
            base_bytes = nbytes if base is memcpy else layer_bytes
            ratio, base_rate = round_ratio(fn, moved, base, base_bytes, device, pairs=pairs,
                                           times=calls[name])
            ratios[name].append(ratio)
            if base is memcpy:
                base_rates.append(base_rate)
    row: dict[str, Any] = {"block_kib": real_block // KIB, "blocks": n,
                           "memcpy_gbps": statistics.median(base_rates) / 1e9}
    stats = {name: summarize(r) for name, r in ratios.items()}
    row.update({name: st["median"] for name, st in stats.items()})
    row["spread"] = {name: [st["min"], st["max"]] for name, st in stats.items()}
    row["ratios"] = ratios
    if samples is not None:
        for name, (_fn, moved, base) in kernels.items():
            tags = {"block_kib": real_block // KIB, "kernel": name}
            samples.append(series({**tags, "role": "kernel", "bytes": moved},
                                  [k for k, _b in calls[name]]))
            samples.append(series({**tags, "role": "baseline",
                                   "bytes": nbytes if base is memcpy else layer_bytes},
                                  [b for _k, b in calls[name]]))
    return row


def worst_point(rows: Sequence[dict[str, Any]], names: Sequence[str] = GOAL_KERNELS,
                from_bytes: int = GOAL_FROM_BYTES) -> dict[str, Any] | None:
    """The judged point with the lowest median: ``{block_kib, kernel, median, min, max}``."""
    points = [{"block_kib": r["block_kib"], "kernel": k, "median": r[k],
               "min": r["spread"][k][0], "max": r["spread"][k][1]}
              for r in rows if r["block_kib"] * KIB >= from_bytes for k in names if k in r]
    return min(points, key=lambda p: p["median"], default=None)


def display_rows(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for the printed table: each kernel as ``median [min-max]`` of its rounds."""
    out = []
    for r in rows:
        shown: dict[str, Any] = {}
        for k, v in r.items():
            if k in ("spread", "ratios"):
                continue
            if k in r.get("spread", {}):
                lo, hi = r["spread"][k]
                v = f"{v:.3g} [{lo:.3g}-{hi:.3g}]"
            shown[k] = v
        out.append(shown)
    return out


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """Plain-text table, floats to 3 significant digits."""
    if not rows:
        return "(no rows)"
    cols = list(rows[0])
    body = [[f"{r[c]:.3g}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in cols]
            for r in rows]
    widths = [max(len(c), *(len(b[i]) for b in body)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


def machine_info(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            "machine": platform.machine(), "cpus": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "device": str(device), "ascend_kernels": __version__,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def run(args: argparse.Namespace) -> int:
    """Run the benchmark with parsed ``args``; returns the exit code (0 unless it could not run)."""
    device = torch.device(args.device)
    if getattr(args, "threads", None):
        torch.set_num_threads(int(args.threads))
    quick = bool(args.quick)
    sizes = QUICK_BLOCK_SIZES if quick else FULL_BLOCK_SIZES
    total = (args.total_mib or (16 if quick else 64)) * KIB * KIB
    rounds, pairs = (QUICK_ROUNDS, QUICK_PAIRS) if quick else (FULL_ROUNDS, FULL_PAIRS)
    rounds = int(getattr(args, "rounds", None) or rounds)
    rows = []
    samples: list[dict[str, Any]] = []
    for i, size in enumerate(sizes, 1):
        print(f"\rkernels: block size {size // KIB} KiB ({i}/{len(sizes)})", end="",
              file=sys.stderr, flush=True)
        rows.append(measure(size, total, device, layers=args.layers, rounds=rounds,
                            pairs=pairs, reference=args.reference, samples=samples))
    print(file=sys.stderr)
    worst = worst_point(rows)
    doc = {
        "benchmark": NAME,
        "machine": machine_info(device),
        "config": {"quick": quick, "bytes_per_op": total, "layers": args.layers,
                   "rounds": rounds, "pairs_per_round": pairs,
                   "dtype": "bfloat16", "block_layout": "(kv_heads, 32, 128), vLLM CPU layout",
                   "ids": "random distinct blocks of a cache twice the bytes moved, as a list",
                   "baseline": "torch copy_ of one contiguous tensor of the same bytes, same "
                               "process and threads",
                   "layers_baseline": "the same, of the all-layers forms' bytes (layers x "
                                      "blocks per layer x block; equal to the one-layer bytes "
                                      "when the blocks divide among the layers)",
                   "ratio": f"median over {rounds} rounds of kernel/baseline (min-max beside "
                            f"it); a round times {pairs} alternating calls of each and divides "
                            "the median call times"},
        "goal": {"min_ratio": GOAL_RATIO, "from_block_kib": GOAL_FROM_BYTES // KIB,
                 "kernels": list(GOAL_KERNELS), "judged_on": "median of the rounds, per point",
                 "worst_ratio": None if worst is None else worst["median"],
                 "worst_point": worst,
                 "met": None if worst is None else worst["median"] >= GOAL_RATIO},
        "results": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{NAME}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    record(args, NAME, doc, samples)
    print(format_table(display_rows(rows)))
    print(f"ratio: median [min-max] of {rounds} rounds, {pairs} alternating call pairs each")
    if worst is not None:
        print(f"worst median from {GOAL_FROM_BYTES // KIB} KiB blocks: {worst['median']:.3g} "
              f"[{worst['min']:.3g}-{worst['max']:.3g}] ({worst['kernel']}, "
              f"{worst['block_kib']} KiB; goal {GOAL_RATIO})")
    print(f"results: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m vllm_ascend.distributed.kv_transfer.bench.kernels [--quick] [--out DIR]``."""
    parser = argparse.ArgumentParser(prog="python -m vllm_ascend.distributed.kv_transfer.bench.kernels")
    sub = parser.add_subparsers(dest="bench", required=True)
    add_parser(sub)
    args = parser.parse_args([NAME, *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
