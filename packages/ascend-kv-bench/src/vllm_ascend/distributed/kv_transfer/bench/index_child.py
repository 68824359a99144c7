# SPDX-License-Identifier: Apache-2.0
"""The child process of ``bench index``: one prefix index of the proxy, measured by rounds.

It is fed through the subscriber's decode-and-apply path. A child holds one index in fresh
memory (its resident set is what the index costs): a
:class:`~vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.prefix_index.PrefixIndex` (one
instance's device cache) filled to a number of blocks tracked, or a
:class:`~vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.prefix_index.PoolIndex` (a KV pool
shared by instances) stored past its bound. Every event reaches it as the proxy's do: a
``(topic, seq, payload)`` frame handed to :meth:`.EventStream.handle` (sequence check, msgpack
decode into the mirrors of vLLM's event classes, apply to the index), with no socket
(the subscriber's thread is not started; its ZeroMQ loop only receives frames and hands them
to this method). The payloads are what vLLM's ``ZmqEventPublisher`` sends, encoded with the
fleet simulator's mirror of vLLM's classes (:mod:`.fleet.events`). Block hashes are distinct
64-bit integers (vLLM's default integer hashes; the stream's hash check is off: hashing
``10^7`` blocks with sha256 would time the hash, not the index).

The parent (:mod:`.index`) talks to a child over its stdin and stdout, one JSON document a
line (``{"op": "round", "round": r}`` -> that round's samples; ``{"op": "exit"}``).
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import time
from typing import Any

#: An odd multiplier: ``i -> i * _MUL mod 2^64`` is one-to-one, so block ``i``'s key is
#: distinct from every other block's, and keys look like hashes (spread over 64 bits).
_MUL = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1
#: Block numbers of the warm-up batch (far from every measured block).
_WARM_START = 1 << 62
#: A 64-block prompt: the routing lookup timed.
PROMPT_BLOCKS = 64


def block_key(i: int) -> int:
    """The hash (as vLLM publishes it: a 64-bit int) of block number ``i``."""
    return (i * _MUL) & _MASK


def rss_bytes() -> int:
    """This process's resident set (``/proc/self/statm``), after a full collection."""
    gc.collect()
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Feed:
    """Frames of one publisher's KV events about consecutive block numbers, in vLLM's wire
    format: a batch (one engine step) of ``blocks_per_batch`` blocks, ``blocks_per_event``
    blocks a ``BlockStored`` (vLLM 0.32 sends one per block; older ones one per request), each
    with its ``block_size`` token ids; ``BlockRemoved`` one block each (vLLM's evictions)."""

    def __init__(self, block_size: int, blocks_per_batch: int, blocks_per_event: int,
                 medium: str) -> None:
        import msgspec

        from .fleet.events import BlockRemoved, BlockStored, KVEventBatch

        self._stored, self._removed, self._batch = BlockStored, BlockRemoved, KVEventBatch
        self._enc = msgspec.msgpack.Encoder()
        self.block_size = block_size
        self.blocks_per_batch = blocks_per_batch
        self.blocks_per_event = blocks_per_event
        self.medium = medium
        #: one block's token ids (the values do not matter to the index, their size does)
        self._tokens = [100 + (i * 7919) % 150_000 for i in range(block_size)]
        self._seq = 0

    def _frames(self, events: list[Any]) -> list[bytes]:
        payload = self._enc.encode(self._batch(time.time(), events, 0))
        seq, self._seq = self._seq, self._seq + 1
        return [b"", seq.to_bytes(8, "big"), payload]

    def stored(self, start: int, count: int) -> list[bytes]:
        """A batch storing blocks ``start .. start + count - 1`` (each chained to the one
        before it)."""
        events = []
        for j in range(start, start + count, self.blocks_per_event):
            n = min(self.blocks_per_event, start + count - j)
            events.append(self._stored([block_key(j + k) for k in range(n)],
                                       block_key(j - 1) if j else None, self._tokens * n,
                                       self.block_size, None, self.medium, None))
        return self._frames(events)

    def removed(self, start: int, count: int) -> list[bytes]:
        """A batch removing blocks ``start .. start + count - 1``, one event each."""
        return self._frames([self._removed([block_key(j)], self.medium)
                             for j in range(start, start + count)])


def _stream(index: Any, pool: Any = None) -> Any:
    """The proxy's subscriber of one instance, its thread not started (no socket)."""
    from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.events import (
        EventsEndpoint,
        EventStream,
    )

    return EventStream("bench-index", EventsEndpoint("tcp://127.0.0.1:9"), index, None,
                       pool=pool)


def _timed(stream: Any, frames: list[bytes]) -> float:
    t0 = time.perf_counter()
    stream.handle(frames)
    return time.perf_counter() - t0


def _check(stream: Any) -> None:
    bad = {k: v for k, v in stream.counts.items() if k != "batches"}
    if bad or stream.state != "live":
        raise RuntimeError(f"the subscriber did not apply the batches cleanly: state "
                           f"{stream.state}, counts {stream.counts}")


class InstanceIndex:
    """A :class:`PrefixIndex` holding ``blocks`` blocks, with its subscriber and a feed."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.prefix_index import PrefixIndex

        self.spec = spec
        self.blocks = int(spec["blocks"])
        self.feed = Feed(spec["block_size"], spec["blocks_per_batch"],
                         spec["blocks_per_event"], "GPU")
        # without the proxy's bound (PREFIX_MAX_BLOCKS, below 10^7): the structure alone
        self.index = PrefixIndex(spec["block_size"], max_blocks=None)
        self.stream = _stream(self.index)
        self.rng = random.Random(spec.get("seed", 0))
        #: the blocks held: numbers lo .. hi - 1 (stored in order, removed oldest first)
        self.lo = self.hi = 0

    def fill(self) -> dict[str, Any]:
        """Warm the decode path, then store ``blocks`` blocks: the fill's rate and the
        resident set it added."""
        bpb = self.feed.blocks_per_batch
        self.stream.handle(self.feed.stored(_WARM_START, bpb))
        self.stream.handle(self.feed.removed(_WARM_START, bpb))
        before = rss_bytes()
        spent = 0.0
        while self.hi < self.blocks:
            n = min(bpb, self.blocks - self.hi)
            spent += _timed(self.stream, self.feed.stored(self.hi, n))
            self.hi += n
        after = rss_bytes()
        _check(self.stream)
        if len(self.index) != self.blocks:
            raise RuntimeError(f"the index holds {len(self.index)} blocks, not {self.blocks}")
        return {"blocks": self.blocks, "fill_s": spent, "fill_blocks_per_s": self.blocks / spent,
                "rss_before": before, "rss_after": after,
                "rss_bytes_per_block": (after - before) / self.blocks}

    def _store(self, batches: int) -> list[float]:
        out = []
        for _ in range(batches):
            n = self.feed.blocks_per_batch
            out.append(_timed(self.stream, self.feed.stored(self.hi, n)))
            self.hi += n
        return out

    def _remove(self, batches: int) -> list[float]:
        out = []
        for _ in range(batches):
            n = self.feed.blocks_per_batch
            out.append(_timed(self.stream, self.feed.removed(self.lo, n)))
            self.lo += n
        return out

    def _lookup(self, count: int) -> list[float]:
        """``count`` longest-prefix matches of 64-block prompts the index holds whole, each
        starting at a random held block (the keys computed before the clock starts)."""
        out = []
        matched = self.index.matched
        for _ in range(count):
            s = self.rng.randrange(self.lo, self.hi - PROMPT_BLOCKS)
            keys = [block_key(i) for i in range(s, s + PROMPT_BLOCKS)]
            t0 = time.perf_counter()
            m = matched(keys)
            out.append(time.perf_counter() - t0)
            if m != PROMPT_BLOCKS:
                raise RuntimeError(f"a held prompt matched {m} of {PROMPT_BLOCKS} blocks")
        return out

    def round(self, r: int) -> dict[str, Any]:
        """Store and remove ``batches`` batches each (in turns: even rounds store first)
        and time ``lookups`` lookups (even rounds last, odd rounds first); the index holds
        ``blocks`` blocks before and after."""
        batches, lookups = self.spec["batches"], self.spec["lookups"]
        out: dict[str, Any] = {"round": r}
        if r % 2:
            out["lookup_s"] = self._lookup(lookups)
            out["remove_s"] = self._remove(batches)
            out["store_s"] = self._store(batches)
        else:
            out["store_s"] = self._store(batches)
            out["remove_s"] = self._remove(batches)
            out["lookup_s"] = self._lookup(lookups)
        _check(self.stream)
        ix = self.index
        out.update(held=len(ix), stored=ix.stored, removed=ix.removed,
                   # no bound of its own: it holds what was stored and not removed
                   held_is_stored_minus_removed=len(ix) == self.hi - self.lo,
                   rss=rss_bytes())
        return out


class PoolRounds:
    """One :class:`PoolIndex` of bound ``bound`` measured by rounds: the first round stores
    ``stored`` blocks (twice the bound: every batch past the bound evicts), each later round
    ``more`` blocks past the bound into the same index (a long-running pool's steady state,
    in seconds instead of a fresh index's twice-the-bound a round). Each round reports what
    the index holds after, the time of each batch it stored past the bound, whether the
    newest prompt is still matched whole and the oldest forgotten (the bound forgets the
    oldest stored first), and the resident set the index has added since it was made."""

    def __init__(self, spec: dict[str, Any]) -> None:
        from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.prefix_index import (
            POOL_MEDIUM,
            PoolIndex,
            PrefixIndex,
        )

        self.bound, self.first = int(spec["bound"]), int(spec["stored"])
        self.more = int(spec["more"])
        self.feed = Feed(spec["block_size"], spec["blocks_per_batch"],
                         spec["blocks_per_event"], POOL_MEDIUM)
        self.before = rss_bytes()
        self.pool = PoolIndex("bench-pool", spec["block_size"], max_blocks=self.bound)
        self.stream = _stream(PrefixIndex(spec["block_size"]), self.pool)
        #: blocks 0 .. hi - 1 were stored, in order
        self.hi = 0

    def round(self, r: int) -> dict[str, Any]:
        """Store the round's blocks (the first round's ``stored``, then ``more``)."""
        target = self.first if self.hi == 0 else self.hi + self.more
        past: list[float] = []
        while self.hi < target:
            n = min(self.feed.blocks_per_batch, target - self.hi)
            dt = _timed(self.stream, self.feed.stored(self.hi, n))
            if self.hi >= self.bound:
                past.append(dt)
            self.hi += n
        _check(self.stream)
        pool = self.pool
        newest = pool.matched([block_key(i) for i in range(self.hi - PROMPT_BLOCKS, self.hi)])
        oldest = pool.matched([block_key(i) for i in range(PROMPT_BLOCKS)])
        return {"round": r, "bound": self.bound, "stored": pool.stored, "held": len(pool),
                "evicted": pool.evicted, "newest_matched": newest, "oldest_matched": oldest,
                "store_past_bound_s": past, "rss_added": rss_bytes() - self.before,
                "instance_index_held": len(self.stream.index)}


def _warm_pool(spec: dict[str, Any]) -> None:
    """Import and warm the decode path (the event decoder) before a round measures the
    resident set a pool index adds."""
    from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.prefix_index import (
        POOL_MEDIUM,
        PoolIndex,
        PrefixIndex,
    )

    feed = Feed(spec["block_size"], spec["blocks_per_batch"], spec["blocks_per_event"],
                POOL_MEDIUM)
    stream = _stream(PrefixIndex(spec["block_size"]), PoolIndex("warm", spec["block_size"]))
    stream.handle(feed.stored(_WARM_START, feed.blocks_per_batch))


def _serve(spec: dict[str, Any]) -> int:
    """Answer the parent's requests until it says ``exit``."""
    index: InstanceIndex | PoolRounds
    if spec["kind"] == "instance":
        index = InstanceIndex(spec)
    else:
        _warm_pool(spec)
        index = PoolRounds(spec)

    def say(doc: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(doc) + "\n")
        sys.stdout.flush()

    say({"ready": True, **(index.fill() if isinstance(index, InstanceIndex) else {})})
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "exit":
            break
        r = int(req["round"])
        say(index.round(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(_serve(json.loads(sys.argv[1])))
