# SPDX-License-Identifier: Apache-2.0
"""``bench trace``: replay request traces against the ``local`` backend's eviction policies.

Every replay drives a real ``LocalBackend`` of the pool (``ascend_store.backend.local_backend``)
the way the pool does (lookup with ``exists``, load the leading hits with ``get``, save
the missing blocks with ``put``), with each policy of ``ascend_store.backend.eviction``
and with its ``BeladyOracle``, the offline optimum, so the
numbers are those of the code that serves. A request hits its longest stored
leading run of blocks. Traces: the Mooncake conversation trace (a file) and the
generated ones of :mod:`.trace_gen`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from .benchutil import progress
from .ledger import series

logger = logging.getLogger(__name__)

TRACE_ENV = "VLLM_ASCEND_KV_TRACE"
#: Hit rate at half capacity, as a share of the unbounded pool's, that meets the goal.
GOAL_VS_UNBOUNDED = 0.98
#: The capacity of the goal, as a fraction of the blocks an unbounded pool holds.
GOAL_FRACTION = 0.5
#: Consecutive segments of a trace whose hit sums the ledger keeps (its rounds).
SEGMENTS = 10


def load_trace(path: str | os.PathLike[str], limit: int | None = None) -> list[list[int]]:
    """Hash-id lists of the requests of a Mooncake trace (``hash_ids`` of each JSON line).

    Raises:
        ValueError: a line is not JSON or lacks a list of integer ``hash_ids``.
    """
    out: list[list[int]] = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["hash_ids"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a trace record ({exc})") from exc
            if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
                raise ValueError(f"{path}:{lineno}: hash_ids must be a list of integers")
            out.append(ids)
            if limit is not None and len(out) >= limit:
                break
    return out


def _keys(ids: list[int]) -> list[str]:
    return [f"trace@{i}" for i in ids]


def replay(requests: list[list[int]], backend: Any, block_bytes: int,
           oracle: Any = None, segments: int = 0) -> dict[str, Any]:
    """Serve every request: lookup its leading blocks, load them, save the missing ones.

    Args:
        requests: block hash ids per request.
        backend: the store (a ``LocalBackend``).
        block_bytes: bytes per block.
        oracle: a :class:`~..backend.eviction.BeladyOracle` the backend evicts with;
            told the number of the request being served.
        segments: with N > 0, also the hit blocks and blocks of each of N consecutive
            segments of the requests (``segment_hits``, ``segment_blocks``: the sums the hit
            rate comes from, kept for the ledger).

    Returns hit blocks, total blocks, hit rate and throughput (requests/s).
    """
    src = np.random.default_rng(0).integers(0, 255, block_bytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    s_addr, d_addr = [int(src.ctypes.data)], [int(dst.ctypes.data)]
    sizes = [block_bytes]
    hits = total = 0
    seg_hits, seg_blocks = [0] * max(segments, 0), [0] * max(segments, 0)
    start = time.perf_counter()
    for n, ids in enumerate(requests):
        if oracle is not None:
            oracle.now = n
        keys = _keys(ids)
        present = backend.exists(keys)
        lead = next((i for i, p in enumerate(present) if p != 1), len(keys))
        if lead:
            backend.get(keys[:lead], [d_addr] * lead, [sizes] * lead)
        missing = [k for k, p in zip(keys, present, strict=True) if p != 1]
        if missing:
            backend.put(missing, [s_addr] * len(missing), [sizes] * len(missing))
        hits += lead
        total += len(keys)
        if segments > 0:
            seg = n * segments // len(requests)
            seg_hits[seg] += lead
            seg_blocks[seg] += len(keys)
    elapsed = time.perf_counter() - start
    out: dict[str, Any] = {"hit_blocks": hits, "blocks": total, "hit_rate": hits / max(1, total),
                           "requests_per_s": len(requests) / elapsed, "seconds": elapsed}
    if segments > 0:
        out.update(segment_hits=seg_hits, segment_blocks=seg_blocks)
    return out


def compare_policies(requests: list[list[int]], fractions: list[float], block_bytes: int,
                     policies: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Hit rate of every policy and of the optimum at each capacity, against unbounded.

    Capacities are fractions of the distinct blocks of the trace (what an unbounded
    pool ends up holding).
    """
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.eviction import (
        DEFAULT_POLICY,
        POLICY_NAMES,
        BeladyOracle,
        uses_by_key,
    )
    from vllm_ascend.distributed.kv_transfer.kv_pool.ascend_store.backend.local_backend import (
        LocalBackend,
    )

    policies = policies or POLICY_NAMES
    unique = len({i for ids in requests for i in ids})
    best = replay(requests, LocalBackend(capacity=(unique + 1) * block_bytes), block_bytes,
                  segments=SEGMENTS)
    uses = uses_by_key(_keys(ids) for ids in requests)
    rows: list[dict[str, Any]] = []
    for frac in progress(fractions, "capacities"):
        cap_blocks = max(1, int(unique * frac))
        capacity = cap_blocks * block_bytes
        row: dict[str, Any] = {"capacity_fraction": frac, "capacity_blocks": cap_blocks,
                               "unbounded_hit_rate": best["hit_rate"]}
        for name in (*policies, "optimum"):
            oracle = BeladyOracle(capacity, uses) if name == "optimum" else None
            backend = LocalBackend(capacity=capacity, eviction_policy=name if oracle is None else oracle)
            res = replay(requests, backend, block_bytes, oracle=oracle, segments=SEGMENTS)
            row[name] = {"hit_rate": res["hit_rate"], "segment_hits": res["segment_hits"],
                         "vs_unbounded": (res["hit_rate"] / best["hit_rate"]
                                          if best["hit_rate"] else 1.0),
                         "requests/s": res["requests_per_s"], "evictions": backend.evictions}
        rows.append(row)
    goal_row = next((r for r in rows if r["capacity_fraction"] == GOAL_FRACTION), None)
    goal = None
    if goal_row is not None:
        goal = {p: goal_row[p]["vs_unbounded"] >= GOAL_VS_UNBOUNDED for p in policies}
    return {"requests": len(requests), "unique_blocks": unique,
            "blocks": best["blocks"], "unbounded": best, "policies": list(policies),
            "default_policy": DEFAULT_POLICY, "rows": rows, "goal_met": goal}


def run_trace(args: argparse.Namespace) -> dict[str, Any]:
    """Replay the conversation trace and the generated ones with every policy."""
    from .trace_gen import GENERATORS

    path = args.trace or os.environ.get(TRACE_ENV, "")
    if not path:
        raise FileNotFoundError(
            f"no trace given: pass a trace file (JSON lines with 'hash_ids', e.g. Mooncake's "
            f"conversation_trace.jsonl) or set ${TRACE_ENV}")
    if not Path(path).exists():
        raise FileNotFoundError(f"trace {path!r} not found; pass it as an argument")
    n = 1000 if args.quick else None
    traces = {"conversation": load_trace(path, limit=n)}
    for name, gen in GENERATORS.items():
        traces[name] = gen(n or 4000, 0)
    held_out = held_out_traces(getattr(args, "held_out", None) or [])
    for name, about in held_out.items():
        traces[name] = load_trace(about["path"], limit=n)
    fractions = [0.25, 0.5] if args.quick else [0.1, 0.25, 0.5]
    block_bytes = args.block_bytes
    results = {name: compare_policies(reqs, fractions, block_bytes)
               for name, reqs in progress(list(traces.items()), "traces")}
    conv = results["conversation"]
    default = conv["default_policy"]
    # ``rows``: the conversation trace with the default policy (the shape of earlier reports)
    rows = [{"capacity_blocks": r["capacity_blocks"], "capacity_fraction": r["capacity_fraction"],
             "hit_rate": r[default]["hit_rate"], "best_hit_rate": r["unbounded_hit_rate"],
             "vs_best": r[default]["vs_unbounded"], "requests/s": r[default]["requests/s"],
             "policy": default, "optimum_vs_best": r["optimum"]["vs_unbounded"]}
            for r in conv["rows"]]
    return {"ledger_samples": ledger_series(results),
            "config": {"trace": str(path), "requests": conv["requests"],
                       "unique_blocks": conv["unique_blocks"], "block_bytes": block_bytes,
                       "tokens_per_block": 512, "fractions": fractions,
                       "held_out": held_out,
                       "goal": f">= {GOAL_VS_UNBOUNDED} of unbounded at {GOAL_FRACTION} capacity"},
            "unbounded": conv["unbounded"], "rows": rows, "traces": results,
            "table": summary_table(results)}


def held_out_traces(specs: list[str]) -> dict[str, dict[str, str]]:
    """``NAME=PATH`` options as ``{name: {"path", "sha256"}}``: traces the eviction policies
    were not tuned on, replayed beside the others (the digest says which file it was).

    Raises:
        ValueError: a spec is not ``NAME=PATH``, reuses a name, or its file is missing.
    """
    import hashlib

    from .trace_gen import GENERATORS

    out: dict[str, dict[str, str]] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--held-out {spec!r}: expected NAME=PATH")
        if name in out or name == "conversation" or name in GENERATORS:
            raise ValueError(f"--held-out {spec!r}: the name {name!r} is taken")
        if not Path(path).is_file():
            raise ValueError(f"--held-out {spec!r}: no file {path!r}")
        digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        out[name] = {"path": str(path), "sha256": digest}
    return out


def ledger_series(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The ledger's samples of a replay: per trace, its blocks and the unbounded pool's hit
    blocks, and per capacity and policy (the optimum too) its hit blocks, each a series of
    :data:`SEGMENTS` rounds, one a consecutive segment of the trace (a replay is
    deterministic: the segments say how much a figure depends on the part of the trace)."""
    out = []
    for name, res in results.items():
        best = res["unbounded"]
        out.append(series({"trace": name, "what": "blocks"},
                          [[b] for b in best["segment_blocks"]], unit="blocks"))
        out.append(series({"trace": name, "what": "hit_blocks", "policy": "unbounded"},
                          [[h] for h in best["segment_hits"]], unit="blocks"))
        for r in res["rows"]:
            for p in (*res["policies"], "optimum"):
                out.append(series({"trace": name, "what": "hit_blocks", "policy": p,
                                   "capacity_fraction": r["capacity_fraction"]},
                                  [[h] for h in r[p]["segment_hits"]], unit="blocks"))
    return out


def summary_table(results: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per trace and capacity: each policy's and the optimum's hit rate / unbounded."""
    out = []
    for name, res in results.items():
        for r in res["rows"]:
            row: dict[str, Any] = {"trace": name, "capacity": r["capacity_fraction"],
                                   "unbounded hit rate": r["unbounded_hit_rate"]}
            for p in (*res["policies"], "optimum"):
                row[p] = r[p]["vs_unbounded"]
            out.append(row)
    return out
