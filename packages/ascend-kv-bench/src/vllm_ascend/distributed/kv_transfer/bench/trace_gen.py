# SPDX-License-Identifier: Apache-2.0
"""Synthetic request traces for ``bench trace``: reuse unlike the conversation trace.

Each generator returns requests as lists of block hash ids, like the ``hash_ids``
of a Mooncake trace: a block id stands for its whole prefix (ids are chained), so
two requests share a block only if they share every block before it, and a
request hits only its longest stored leading run. Seeded and deterministic.

``deep_prefix_tree``
    A tree of shared prefixes several levels deep (system prompts, then tool or
    document contexts, then conversations that grow turn by turn); a request
    walks a popular path and adds blocks of its own.
``zipf_scans``
    A catalogue of documents read with Zipf-skewed popularity, with one-off
    scans (long prompts never seen again) mixed in: a recency-only policy lets
    the scans push out the popular documents.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

logger = logging.getLogger(__name__)


class _Ids:
    """Fresh block ids."""

    def __init__(self, start: int = 1 << 40) -> None:
        self.next = start

    def take(self, n: int) -> list[int]:
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (i + 1) ** s for i in range(n)]


def deep_prefix_tree(n_requests: int, seed: int = 0) -> list[list[int]]:
    """Requests walking a deep tree of shared prefixes (see the module docstring)."""
    rng = random.Random(seed)
    ids = _Ids()
    systems = [ids.take(rng.randint(8, 24)) for _ in range(4)]
    contexts = [[s + ids.take(rng.randint(4, 16)) for _ in range(6)] for s in systems]
    flat = [c for per_system in contexts for c in per_system]
    ctx_weights = _zipf_weights(len(flat), 1.0)
    conversations: list[list[int]] = []
    out: list[list[int]] = []
    for _ in range(n_requests):
        r = rng.random()
        if conversations and r < 0.45:
            # next turn of a recent conversation: its whole history plus the new turn
            i = len(conversations) - 1 - min(int(rng.expovariate(1 / 12)), len(conversations) - 1)
            conv = conversations[i] + ids.take(rng.randint(1, 3))
            conversations[i] = conv
            out.append(list(conv))
            continue
        ctx = rng.choices(flat, ctx_weights)[0]
        conv = ctx + ids.take(rng.randint(1, 4))
        if r < 0.85:
            conversations.append(conv)
            if len(conversations) > 400:
                conversations.pop(0)
        out.append(list(conv))
    return out


def zipf_scans(n_requests: int, seed: int = 0, scan_share: float = 0.25) -> list[list[int]]:
    """Zipf-popular documents with one-off scans mixed in (see the module docstring)."""
    rng = random.Random(seed)
    ids = _Ids()
    root = ids.take(2)  # a short system prompt every request shares
    docs = [root + ids.take(rng.randint(4, 12)) for _ in range(300)]
    weights = _zipf_weights(len(docs), 1.1)
    out: list[list[int]] = []
    for _ in range(n_requests):
        if rng.random() < scan_share:
            out.append(root + ids.take(rng.randint(16, 48)))  # a one-off long prompt
            continue
        doc = rng.choices(docs, weights)[0]
        out.append(doc + ids.take(rng.randint(1, 2)))
    return out


#: Generators by trace name.
GENERATORS: dict[str, Callable[[int, int], list[list[int]]]] = {
    "deep-prefix-tree": deep_prefix_tree,
    "zipf-scans": zipf_scans,
}
