# SPDX-License-Identifier: Apache-2.0
"""The shared-prefix workload of ``bench router`` and ``bench fleet``.

A Mooncake trace's ``hash_ids`` (or a synthetic trace of its shape) made token-id prompts,
and the best prefix hit rate any router could reach on it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TRACE_NAME = "data/mooncake-traces/conversation_trace.jsonl"


def default_trace() -> Path | None:
    """The shared conversation trace (``../shared`` beside the working directory, or
    ``/work/shared``), as ``noxfile.py`` finds it; None when neither holds it."""
    for base in (Path.cwd().parent / "shared", Path("/work/shared")):
        if (base / TRACE_NAME).exists():
            return base / TRACE_NAME
    return None


def load_trace(path: Path, n: int, max_blocks: int) -> list[list[int]]:
    """The ``hash_ids`` of the first ``n`` requests of a Mooncake trace, each cut to its first
    ``max_blocks`` (a cut keeps the prefix structure: a prefix of a chain is a chain)."""
    out: list[list[int]] = []
    with open(path) as f:
        for line in f:
            if len(out) >= n:
                break
            if line.strip():
                ids = [int(h) for h in json.loads(line)["hash_ids"]][:max_blocks]
                if ids:
                    out.append(ids)
    return out


def synthetic_trace(n: int, max_blocks: int, seed: int = 0) -> list[list[int]]:
    """A shared-prefix workload of the trace's shape: a common first block, conversations that
    grow turn by turn (a turn repeats the previous prompt and adds blocks), and one-off
    requests."""
    rng = random.Random(seed)
    convs: list[list[int]] = []
    out: list[list[int]] = []
    next_id = 1
    for _ in range(n):
        if convs and rng.random() < 0.6:
            conv = rng.choice(convs)
            add = rng.randrange(1, 3)
            conv.extend(range(next_id, next_id + add))
        else:
            add = rng.randrange(2, 6)
            conv = [0, *range(next_id, next_id + add)]
            convs.append(conv)
        next_id += add
        out.append(conv[:max_blocks])
    return out


def scale(hash_lists: Sequence[Sequence[int]], block: int, vocab: int,
          seed: int = 0) -> list[list[int]]:
    """Prompts of token ids: each hash id becomes one fixed random block of ``block`` ids in
    ``[3, vocab)`` (0-2 are the tokenizer's special tokens), the same block wherever it
    appears."""
    rng = random.Random(seed)
    blocks: dict[int, list[int]] = {}
    prompts = []
    for ids in hash_lists:
        prompt: list[int] = []
        for h in ids:
            if h not in blocks:
                blocks[h] = [rng.randrange(3, vocab) for _ in range(block)]
            prompt += blocks[h]
        prompts.append(prompt)
    return prompts


def best_achievable(hash_lists: Sequence[Sequence[int]], block: int) -> dict[str, Any]:
    """The prefix hit rate of one unbounded cache that saw every earlier request.

    Block ``j`` of a request is a hit when an earlier request's prompt began with the same
    ``j + 1`` blocks (its whole prefix chain was cached). As in vLLM, the last prompt token is
    always computed, so a prompt of ``n`` full blocks hits at most ``n - 1``. The rate is hit
    tokens over prompt tokens, what P's ``prefix_cache_hits / prefix_cache_queries`` count.
    """
    seen: set[tuple[int, ...]] = set()
    hits = queries = 0
    for ids in hash_lists:
        chain = tuple(ids)
        matched = 0
        while matched < len(chain) and chain[:matched + 1] in seen:
            matched += 1
        tokens = len(chain) * block
        hits += block * min(matched, (tokens - 1) // block)
        queries += tokens
        seen.update(chain[:j] for j in range(1, len(chain) + 1))
    return {"hit_tokens": hits, "query_tokens": queries,
            "rate": hits / queries if queries else None}
