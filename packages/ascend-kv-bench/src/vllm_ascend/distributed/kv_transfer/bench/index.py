# SPDX-License-Identifier: Apache-2.0
"""``vllm-ascend-kv bench index``: the proxy's prefix indexes against the blocks they track.

The ``kv_aware`` policy of our proxy keeps, per prefill instance, a ``PrefixIndex`` of the
blocks the instance's KV events say it holds, and per shared KV pool a ``PoolIndex`` bounded
to ``POOL_MAX_BLOCKS`` (``kv_p2p/proxy/prefix_index.py``). Both are fed through the proxy's
subscriber, :meth:`.EventStream.handle` (sequence check, msgpack decode, apply), here with
frames in vLLM's wire format and no socket (:mod:`.index_child` says how).

At each number of blocks tracked (``--sizes``: ``10^5``, ``10^6``, ``10^7``; ``--quick``
``10^4``, ``10^5``) a child process (fresh memory) fills one instance's index and reports
the resident set the index added per block (RSS, read from ``/proc/self/statm`` after a
full collection, before and after the fill: the dict, its keys and each key's set of media,
as the process holds them). The children then stay up and are measured in rounds
(``--rounds``, default 9), the sizes in turns (the order reversed every other round), each
round at each size:

* ``BlockStored`` ingest: ``--batches`` batches of vLLM's shape (an engine step of
  ``--blocks-per-batch`` blocks, ``--blocks-per-event`` a ``BlockStored``, each with its
  ``--block-size`` token ids), each timed;
* ``BlockRemoved`` ingest: as many batches removing the oldest blocks (one event a block,
  as vLLM evicts), each timed; the two in turns, so the index holds the size it was filled
  to before and after the round;
* the routing lookup: ``--lookups`` longest-prefix matches (``PrefixIndex.matched``) of a
  64-block prompt the index holds whole, starting at a random held block, each timed (the
  prompt's block hashes are computed before: hashing does not depend on what is tracked).

The proxy bounds each ``PrefixIndex`` at ``PREFIX_MAX_BLOCKS`` (``--kv-index-max-blocks``,
the oldest stored forgotten first), below 10^7: the instance indexes here are built without
it, to measure the structure at every size, and every round records what one holds against
the blocks stored minus removed; the report states the bound's memory at the measured
bytes a block. The shared pool's bound is measured in another child, on one
``PoolIndex`` of bound ``--pool-bound`` (default the proxy's ``POOL_MAX_BLOCKS``; ``--quick``
2^14) fed its pool's events (``medium`` ``cpu``): the first round stores twice the bound,
each later round an eighth of the bound more (every batch past the bound evicts; a fresh
index each round took 9 times twice the bound, minutes, for a count that does not vary).
Recorded each round: what it holds after, its evictions, the time of each batch stored past
the bound, whether the newest 64-block prompt still matches whole and the oldest is
forgotten, and the resident set the index has added since it was made.

Writes ``<out>/index.json`` and a ledger entry with every sample; never fails on a number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from .benchutil import add_common_args, format_table, write_results
from .ledger import series

#: Blocks tracked by a full run and by --quick.
SIZES = (100_000, 1_000_000, 10_000_000)
QUICK_SIZES = (10_000, 100_000)
#: The pool index's bound of a --quick run (a full run: the proxy's ``POOL_MAX_BLOCKS``).
QUICK_POOL_BOUND = 1 << 14
#: A later pool round stores the bound over this many blocks past it (the first: the bound).
POOL_MORE_DIVISOR = 8
#: The smallest size a run takes (a round removes and stores batches at every size).
MIN_SIZE = 1_000
#: The child's module (run as ``python -m``).
CHILD = "vllm_ascend.distributed.kv_transfer.bench.index_child"


class Child:
    """A child process holding one index (:mod:`.index_child`), spoken to a line at a time."""

    def __init__(self, spec: dict[str, Any], log: Path) -> None:
        self.spec = spec
        self.log = log
        self._err: IO[str] = log.open("w")
        self.proc = subprocess.Popen([sys.executable, "-m", CHILD, json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, text=True)
        self.ready = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=30)
            tail = (self.log.read_text().strip().splitlines() or ["no output"])[-1]
            raise RuntimeError(f"bench index: child {self.spec} exited "
                               f"{self.proc.returncode}: {tail}")
        doc: dict[str, Any] = json.loads(line)
        return doc

    def round(self, r: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "round", "round": r}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        finally:
            self._err.close()


def check_args(args: argparse.Namespace) -> None:
    """Refuse options no run can take (a clear message, exit status 1)."""
    sizes = args.sizes or ()
    problems = [f"--sizes {n}: at least {MIN_SIZE}" for n in sizes if n < MIN_SIZE]
    for opt in ("rounds", "batches", "lookups", "pool_bound"):
        v = getattr(args, opt)
        if v is not None and v < 1:
            problems.append(f"--{opt.replace('_', '-')} {v}: at least 1")
    for opt in ("block_size", "blocks_per_batch", "blocks_per_event"):
        if getattr(args, opt) < 1:
            problems.append(f"--{opt.replace('_', '-')} {getattr(args, opt)}: at least 1")
    if args.blocks_per_event > args.blocks_per_batch:
        problems.append(f"--blocks-per-event {args.blocks_per_event}: at most "
                        f"--blocks-per-batch ({args.blocks_per_batch})")
    if problems:
        raise SystemExit("bench index: " + "; ".join(problems))


def _median_rate(blocks: int, times: list[float]) -> float | None:
    return blocks / statistics.median(times) if times else None


def _p99(values: list[float]) -> float:
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def summarize(fills: dict[int, dict[str, Any]], rounds: dict[int, list[dict[str, Any]]],
              bpb: int) -> list[dict[str, Any]]:
    """A row per size: memory, fill rate, and over the rounds the median of the rounds'
    ingest rates (blocks/s) and lookup times."""
    rows = []
    for n, fill in fills.items():
        rs = rounds[n]
        look = [x for r in rs for x in r["lookup_s"]]
        rows.append({
            "blocks_tracked": n, "rss_bytes_per_block": fill["rss_bytes_per_block"],
            "rss_added": fill["rss_after"] - fill["rss_before"],
            "fill_blocks_per_s": fill["fill_blocks_per_s"],
            "store_blocks_per_s": statistics.median(
                [_median_rate(bpb, r["store_s"]) or 0.0 for r in rs]),
            "remove_blocks_per_s": statistics.median(
                [_median_rate(bpb, r["remove_s"]) or 0.0 for r in rs]),
            "lookup_median_us": statistics.median(
                [statistics.median(r["lookup_s"]) for r in rs]) * 1e6,
            "lookup_p99_us": _p99(look) * 1e6,
            "held": [r["held"] for r in rs],
            "held_is_stored_minus_removed": all(r["held_is_stored_minus_removed"] for r in rs)})
    return rows


def run_instances(sizes: tuple[int, ...], spec: dict[str, Any], rounds: int, logs: Path
                  ) -> tuple[dict[int, dict[str, Any]], dict[int, list[dict[str, Any]]]]:
    """Fill a child per size (one after the other), then measure them in rounds, the
    sizes in turns."""
    children: dict[int, Child] = {}
    try:
        for n in sizes:
            print(f"filling an instance index to {n} blocks", flush=True)
            children[n] = Child({**spec, "kind": "instance", "blocks": n},
                                logs / f"index-{n}.log")
        out: dict[int, list[dict[str, Any]]] = {n: [] for n in sizes}
        for r in range(rounds):
            order = list(sizes) if r % 2 == 0 else list(reversed(sizes))
            for n in order:
                out[n].append(children[n].round(r))
        return {n: c.ready for n, c in children.items()}, out
    finally:
        for c in children.values():
            c.close()


def run_pool(spec: dict[str, Any], rounds: int, logs: Path) -> list[dict[str, Any]]:
    """The pool index's rounds, in a child of their own."""
    print(f"storing {spec['stored']} blocks into a pool index bounded to {spec['bound']}, "
          f"then {spec['more']} more a round", flush=True)
    child = Child({**spec, "kind": "pool"}, logs / "index-pool.log")
    try:
        return [child.round(r) for r in range(rounds)]
    finally:
        child.close()


def run(args: argparse.Namespace) -> int:
    """Run the section; print and write the results."""
    from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.prefix_index import (
        POOL_MAX_BLOCKS,
        PREFIX_MAX_BLOCKS,
    )

    check_args(args)
    sizes = tuple(args.sizes or (QUICK_SIZES if args.quick else SIZES))
    rounds = args.rounds or (3 if args.quick else 9)
    batches = args.batches or (10 if args.quick else 50)
    lookups = args.lookups or (200 if args.quick else 1000)
    bound = args.pool_bound or (QUICK_POOL_BOUND if args.quick else POOL_MAX_BLOCKS)
    bpb = args.blocks_per_batch
    spec = {"block_size": args.block_size, "blocks_per_batch": bpb,
            "blocks_per_event": args.blocks_per_event, "batches": batches, "lookups": lookups}
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="bench-index-") as tmp:
        fills, measured = run_instances(sizes, spec, rounds, Path(tmp))
        more = max(1, bound // POOL_MORE_DIVISOR)
        pool = run_pool({**spec, "bound": bound, "stored": 2 * bound, "more": more}, rounds,
                        Path(tmp))
    rows = summarize(fills, measured, bpb)
    pool_summary: dict[str, Any] = {
        "bound": bound, "stored_first_round": 2 * bound, "stored_more_per_round": more,
        "stored": [p["stored"] for p in pool], "held": [p["held"] for p in pool],
        "evicted": [p["evicted"] for p in pool],
        "held_at_most_bound": all(p["held"] <= bound for p in pool),
        "newest_prompt_matched": [p["newest_matched"] for p in pool],
        "oldest_prompt_matched": [p["oldest_matched"] for p in pool],
        "rss_added": [p["rss_added"] for p in pool],
        "store_past_bound_blocks_per_s": statistics.median(
            [_median_rate(bpb, p["store_past_bound_s"]) or 0.0 for p in pool])}
    payload = {"driven": "EventStream.handle (no socket) -> PrefixIndex / PoolIndex",
               "sizes": list(sizes), "rounds": rounds, "batches_per_round": batches,
               "lookups_per_round": lookups, "block_size": args.block_size,
               "blocks_per_batch": bpb, "blocks_per_event": args.blocks_per_event,
               "prompt_blocks": 64, "memory": "RSS delta (/proc/self/statm) over the fill",
               "pool_default_bound": POOL_MAX_BLOCKS, "instance_index_bounded": True,
               "instance_default_bound": PREFIX_MAX_BLOCKS,
               "fills": [fills[n] for n in sizes], "rows": rows, "pool": pool_summary}
    samples = []
    for n in sizes:
        rs = measured[n]
        tags = {"index": "instance", "blocks_tracked": n}
        samples += [series({**tags, "metric": "store", "blocks": bpb},
                           [r["store_s"] for r in rs]),
                    series({**tags, "metric": "remove", "blocks": bpb},
                           [r["remove_s"] for r in rs]),
                    series({**tags, "metric": "lookup", "prompt_blocks": 64},
                           [r["lookup_s"] for r in rs]),
                    series({**tags, "metric": "held", "stored_minus_removed": n},
                           [[r["held"]] for r in rs], unit="blocks"),
                    series({**tags, "metric": "rss_per_block"},
                           [[fills[n]["rss_bytes_per_block"]]], unit="B")]
    # "stored": what the first round stored (every later round's index has more)
    ptags = {"index": "pool", "bound": bound, "stored": 2 * bound, "stored_more": more}
    samples += [series({**ptags, "metric": "held"}, [[p["held"]] for p in pool],
                       unit="blocks"),
                series({**ptags, "metric": "store_past_bound", "blocks": bpb},
                       [p["store_past_bound_s"] for p in pool]),
                series({**ptags, "metric": "newest_matched", "prompt_blocks": 64},
                       [[p["newest_matched"]] for p in pool], unit="blocks"),
                series({**ptags, "metric": "rss_added"}, [[p["rss_added"]] for p in pool],
                       unit="B")]
    path = write_results("index", payload, args.out, args=args, samples=samples)
    print(format_table([{
        "blocks tracked": r["blocks_tracked"], "RSS B/block": r["rss_bytes_per_block"],
        "fill blocks/s": r["fill_blocks_per_s"], "stored blocks/s": r["store_blocks_per_s"],
        "removed blocks/s": r["remove_blocks_per_s"], "lookup med (us)": r["lookup_median_us"],
        "p99 (us)": r["lookup_p99_us"],
        "held = stored - removed": r["held_is_stored_minus_removed"]} for r in rows]))
    print(format_table([{
        "pool bound": bound, "stored (last round)": pool_summary["stored"][-1],
        "held after (max)":
        max(pool_summary["held"]), "evicted (min)": min(pool_summary["evicted"]),
        "newest prompt matched (min)": min(pool_summary["newest_prompt_matched"]),
        "oldest matched (max)": max(pool_summary["oldest_prompt_matched"]),
        "RSS MiB (most)": max(pool_summary["rss_added"]) / 2**20,
        "stored past bound blocks/s": pool_summary["store_past_bound_blocks_per_s"]}]))
    print(f"results: {path}")
    return 0


def add_parser(subparsers: Any) -> None:
    """Add ``bench index`` to the ``vllm-ascend-kv bench`` subcommands."""
    p = subparsers.add_parser("index", help="the proxy's prefix indexes at 10^5-10^7 blocks "
                                            "tracked: memory, KV-event ingest, routing "
                                            "lookup, the pool index's bound")
    add_common_args(p)
    p.add_argument("--sizes", type=int, nargs="+",
                   help=f"blocks tracked (default {' '.join(map(str, SIZES))}; --quick "
                        f"{' '.join(map(str, QUICK_SIZES))})")
    p.add_argument("--rounds", type=int, help="rounds, the sizes in turns (default 9; "
                                              "--quick 3)")
    p.add_argument("--batches", type=int,
                   help="BlockStored and BlockRemoved batches a round (default 50; --quick 10)")
    p.add_argument("--lookups", type=int, help="routing lookups a round (default 1000; "
                                               "--quick 200)")
    p.add_argument("--block-size", type=int, default=128,
                   help="tokens a block (default %(default)s, vLLM-Ascend's)")
    p.add_argument("--blocks-per-batch", type=int, default=64,
                   help="blocks an event batch stores or removes (default %(default)s: an "
                        "engine step prefilling 8,192 tokens in blocks of 128)")
    p.add_argument("--blocks-per-event", type=int, default=1,
                   help="blocks a BlockStored (default %(default)s: vLLM 0.32 sends one "
                        "a block; older ones one a request)")
    p.add_argument("--pool-bound", type=int,
                   help="the pool index's bound (default: the proxy's POOL_MAX_BLOCKS; "
                        f"--quick {QUICK_POOL_BOUND})")
    p.set_defaults(func=run)
