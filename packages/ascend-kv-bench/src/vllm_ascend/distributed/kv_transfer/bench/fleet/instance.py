# SPDX-License-Identifier: Apache-2.0
"""One simulated ``vllm serve``: the endpoints routers use, a prefix cache, KV events.

It answers ``/v1/completions`` and ``/v1/chat/completions`` (not streamed), ``/health``,
``/v1/models``, ``/tokenize`` and ``/metrics`` (the vLLM series routers and ``bench router``
read), and plays vLLM's two P/D roles by the request's ``kv_transfer_params``:

* ``do_remote_decode`` (P): a prefill; the answer's ``kv_transfer_params`` name this instance
  for D (``remote_engine_id``, ``remote_host``, ``remote_port``, ``remote_block_ids``), as
  vLLM's ``MooncakeConnectorV1`` does;
* ``do_remote_prefill`` (D): the KV comes from P, only decode is modelled;
* neither: prefill and decode here.

The prefix cache holds vLLM's own block hashes (:class:`~...kv_p2p.proxy.prefix_index.
PrefixCacheHasher`, sha256 by default, as the instances' ``--prefix-caching-hash-algo``) of
``block_size`` tokens, least recently used first out, ``capacity`` blocks; a prompt hits its
longest cached leading run, never its last token (vLLM's rule). Stored and evicted blocks go
out as KV events (:mod:`.events`). ``usage.prompt_tokens_details.cached_tokens`` says the hit.

Time: prefills run one at a time (FIFO), each sleeping the cost model's prefill time of the
tokens not cached; decodes run side by side (one request's steps, no batching cost). Every
answer carries ``sim``: the instance, its ``service_s`` (request read to answer written,
queueing included) and the modelled parts, and, on D, P's part as P put it into
``kv_transfer_params`` (``sim_p``), so the driver can take every instance's time out of the
latency it measured and keep the routers' own.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from .events import MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored, Publisher
from .http import Request, Response, Server
from .model import CostModel

MODEL_NAME = "tiny"
BLOCK_SIZE = 16


class BlockHashes:
    """vLLM's block hashes of token blocks (low 64 bits, as published), memoized by
    ``(parent, tokens)``: the fleet's instances see the same prefixes again and again."""

    def __init__(self, algo: str = "sha256", limit: int = 1 << 20) -> None:
        from vllm_ascend.distributed.kv_transfer.kv_p2p.proxy.prefix_index import (
            PrefixCacheHasher,
            block_key,
        )

        self._hasher = PrefixCacheHasher(algo)
        self._key = block_key
        self._memo: dict[tuple[bytes | None, tuple[int, ...]], bytes] = {}
        self._limit = limit

    def keys(self, tokens: Sequence[int], block_size: int) -> list[int]:
        """Keys of the full blocks of ``tokens``."""
        out: list[int] = []
        parent: bytes | None = None
        for i in range(len(tokens) // block_size):
            blk = tuple(tokens[i * block_size:(i + 1) * block_size])
            h = self._memo.get((parent, blk))
            if h is None:
                if len(self._memo) >= self._limit:
                    self._memo.clear()
                h = self._hasher.hash_block(parent, blk)
                self._memo[(parent, blk)] = h
            out.append(self._key(h))
            parent = h
        return out


class PrefixCache:
    """An LRU set of block keys, ``capacity`` at most."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, keys: Sequence[int]) -> int:
        """The longest cached leading run of ``keys`` (touched: most recently used)."""
        n = 0
        for k in keys:
            if k not in self._blocks:
                break
            self._blocks.move_to_end(k)
            n += 1
        return n

    def store(self, keys: Sequence[int]) -> tuple[list[int], list[int]]:
        """Store ``keys``; the keys newly stored and those evicted for them."""
        new = []
        for k in keys:
            if k in self._blocks:
                self._blocks.move_to_end(k)
            else:
                self._blocks[k] = None
                new.append(k)
        evicted = []
        while len(self._blocks) > self.capacity:
            evicted.append(self._blocks.popitem(last=False)[0])
        return new, evicted

    def clear(self) -> None:
        self._blocks.clear()


def tokenize(text: str, vocab: int = 8192) -> list[int]:
    """The simulated tokenizer: a word is a token (a decimal word is its own id)."""
    return [int(w) if w.isdigit() else 3 + zlib.crc32(w.encode()) % (vocab - 3)
            for w in text.split()]


def prompt_of(body: dict[str, Any], chat: bool) -> list[int]:
    """A request's prompt token ids (a completions prompt of ids is taken as is)."""
    if chat:
        msgs = body.get("messages") or []
        return tokenize(" ".join(str(m.get("content", "")) for m in msgs
                                 if isinstance(m, dict)))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    return tokenize(str(prompt or ""))


class SimInstance:
    """One simulated instance (see the module docstring).

    Args:
        name: its engine id.
        cost: the cost model.
        hashes: the fleet's block hasher.
        publisher: where its KV events go (None: none).
        capacity: blocks its prefix cache holds.
        block_size: tokens a block.
        clock: the fleet's clock (``time.monotonic``: the driver's too, one clock per host).
    """

    def __init__(self, name: str, cost: CostModel, hashes: BlockHashes,
                 publisher: Publisher | None, capacity: int, block_size: int = BLOCK_SIZE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.cost = cost
        self.hashes = hashes
        self.publisher = publisher
        self.cache = PrefixCache(capacity)
        self.block_size = block_size
        self.clock = clock
        self.server = Server(self.handle)
        self._prefill = asyncio.Lock()
        self.state = "up"  # up | draining | dead
        self.running = self.waiting = 0
        self.counts = {"requests": 0, "prefills": 0, "decodes": 0, "query_tokens": 0,
                       "hit_tokens": 0, "prompt_tokens": 0, "generation_tokens": 0,
                       "refused": 0}
        self.first_request: float | None = None
        self.last_request: float | None = None
        self.died: float | None = None
        self.attempts_after_death: list[float] = []
        self.probes_after_death: list[float] = []

    async def start(self) -> SimInstance:
        await self.server.start()
        if self.publisher is not None:
            self.publisher.start()
        return self

    @property
    def url(self) -> str:
        return self.server.url

    # ------------------------------------------------------------------ endpoints
    async def handle(self, req: Request) -> Response:
        if self.state == "dead":  # the fleet closes a dead instance's sockets; belt and braces
            self.counts["refused"] += 1
            return Response(503, b"dead", "text/plain")
        if req.method == "GET" and req.path == "/health":
            return Response(200 if self.state == "up" else 503, b"", "text/plain")
        if req.method == "GET" and req.path == "/metrics":
            return Response(200, self.metrics().encode(), "text/plain; version=0.0.4")
        if req.method == "GET" and req.path == "/v1/models":
            return Response.of_json({"object": "list", "data": [
                {"id": MODEL_NAME, "object": "model", "owned_by": "vllm",
                 "max_model_len": 1 << 16}]})
        if req.method == "POST" and req.path == "/tokenize":
            body = req.json()
            toks = prompt_of(body, "messages" in body)
            return Response.of_json({"tokens": toks, "count": len(toks),
                                     "max_model_len": 1 << 16})
        if req.method == "POST" and req.path in ("/v1/completions", "/v1/chat/completions"):
            return await self.generate(req.json(), chat=req.path.endswith("chat/completions"))
        return Response.of_json({"error": {"message": f"no route {req.path}"}}, 404)

    async def generate(self, body: dict[str, Any], chat: bool) -> Response:
        start = self.clock()
        if self.first_request is None:
            self.first_request = start
        self.last_request = start
        self.counts["requests"] += 1
        tokens = prompt_of(body, chat)
        kv = body.get("kv_transfer_params") or {}
        max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        sim: dict[str, Any] = {"instance": self.name, "prompt_tokens": len(tokens)}
        out_params: dict[str, Any] | None = None
        self.running += 1
        try:
            if kv.get("do_remote_prefill"):
                # D: the prompt's KV came from P; the first token after one decode step
                first = self.cost.decode_s(1)
                await asyncio.sleep(self.cost.decode_s(max_tokens))
                self.counts["decodes"] += 1
                sim.update(role="decode", decode_s=self.cost.decode_s(max_tokens),
                           first_token_s=first, cached_tokens=len(tokens))
                if isinstance(kv.get("sim_p"), dict):
                    sim["p"] = kv["sim_p"]
                cached = len(tokens)
            else:
                cached, queue_s, prefill_s = await self.prefill(tokens)
                sim.update(role="prefill" if kv.get("do_remote_decode") else "both",
                           cached_tokens=cached, queue_s=queue_s, prefill_s=prefill_s)
                if kv.get("do_remote_decode"):
                    max_tokens = 1
                    out_params = {"do_remote_prefill": True, "do_remote_decode": False,
                                  "remote_engine_id": self.name, "remote_block_ids": [],
                                  "remote_host": self.server.host,
                                  "remote_port": self.server.port}
                else:
                    sim["first_token_s"] = self.cost.decode_s(1)
                    sim["decode_s"] = self.cost.decode_s(max_tokens)
                    await asyncio.sleep(self.cost.decode_s(max_tokens))
        finally:
            self.running -= 1
        self.counts["generation_tokens"] += max_tokens
        sim["service_s"] = self.clock() - start
        if out_params is not None:
            out_params["sim_p"] = dict(sim)
        usage = {"prompt_tokens": len(tokens), "completion_tokens": max_tokens,
                 "total_tokens": len(tokens) + max_tokens,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        text = " ".join(["x"] * max_tokens)
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        doc = {"id": f"cmpl-{self.name}-{self.counts['requests']}",
               "object": "chat.completion" if chat else "text_completion",
               "created": int(time.time()), "model": MODEL_NAME, "choices": [choice],
               "usage": usage, "kv_transfer_params": out_params, "sim": sim}
        return Response.of_json(doc)

    async def prefill(self, tokens: Sequence[int]) -> tuple[int, float, float]:
        """The prompt's prefill: cached tokens, seconds queued, seconds computing."""
        bs = self.block_size
        keys = self.hashes.keys(tokens, bs)
        queued = self.clock()
        self.waiting += 1
        started = False
        try:
            async with self._prefill:
                started = True
                self.waiting -= 1
                waited = self.clock() - queued
                hit = min(self.cache.match(keys), max(0, (len(tokens) - 1) // bs))
                cached = hit * bs
                seconds = self.cost.prefill_s(len(tokens) - cached)
                await asyncio.sleep(seconds)
        finally:
            if not started:  # cancelled while queued
                self.waiting -= 1
        new, evicted = self.cache.store(keys)
        self.counts["prefills"] += 1
        self.counts["query_tokens"] += len(tokens)
        self.counts["hit_tokens"] += cached
        self.counts["prompt_tokens"] += len(tokens)
        if self.publisher is not None and (new or evicted):
            events: list[Any] = []
            if evicted:
                events.append(BlockRemoved(evicted, MEDIUM_GPU))
            if new:
                first = keys.index(new[0])
                parent = keys[first - 1] if first > 0 else None
                events.append(BlockStored(new, parent, list(tokens[first * bs:(first + len(new))
                                                                  * bs]),
                                          bs, None, MEDIUM_GPU, None))
            self.publisher.publish(events)
        return cached, waited, seconds

    def metrics(self) -> str:
        """vLLM's Prometheus series that routers and ``bench router`` read."""
        c, lbl = self.counts, f'{{engine="0",model_name="{MODEL_NAME}"}}'
        used = len(self.cache) / max(1, self.cache.capacity)
        rows = [("gauge", "vllm:num_requests_running", self.running),
                ("gauge", "vllm:num_requests_waiting", self.waiting),
                ("gauge", "vllm:kv_cache_usage_perc", used),
                ("counter", "vllm:prefix_cache_queries_total", c["query_tokens"]),
                ("counter", "vllm:prefix_cache_hits_total", c["hit_tokens"]),
                ("counter", "vllm:prompt_tokens_total", c["prompt_tokens"]),
                ("counter", "vllm:generation_tokens_total", c["generation_tokens"]),
                ("counter", "vllm:request_success_total", c["requests"])]
        out = []
        for kind, name, value in rows:
            out += [f"# TYPE {name} {kind}", f"{name}{lbl} {float(value)}"]
        return "\n".join(out) + "\n"

    def reset(self) -> None:
        """An empty cache (``AllBlocksCleared`` published, as vLLM's
        ``/reset_prefix_cache``) and counters from 0."""
        self.cache.clear()
        if self.publisher is not None and self.state != "dead":
            self.publisher.publish([AllBlocksCleared()])
        self.counts = dict.fromkeys(self.counts, 0)
        self.first_request = self.last_request = None

    async def kill(self) -> None:
        """Dead: connections reset, events stop; each later request is reset at once, its
        time kept in ``attempts_after_death`` (those of ``/health`` probes apart, in
        ``probes_after_death``: a router probes a dead instance to see it come back)."""
        self.state = "dead"
        self.died = self.clock()

        def attempt(path: str) -> None:
            into = self.probes_after_death if path == "/health" else self.attempts_after_death
            into.append(self.clock())

        await self.server.close(on_attempt=attempt)
        if self.publisher is not None:
            self.publisher.close()

    async def close(self) -> None:
        """Gone for good (the fleet stops)."""
        await self.server.close()
        if self.publisher is not None and self.state != "dead":
            self.publisher.close()
