# SPDX-License-Identifier: Apache-2.0
"""The ``kv_aware`` policy: the prefill instance with the longest cached prefix, traded
against load.

For each request the router gets the prompt's token ids (given, or from a P instance's
``/tokenize``), computes vLLM's block hashes of its full blocks (:mod:`.prefix_index`) and
looks up, per P instance, how many leading blocks its prefix index (fed by its KV events,
:mod:`.events`) holds. vLLM never reuses the last prompt token (``max_cache_hit_length =
prompt_len - 1``), so the predicted hit of instance ``i`` is
``cached(i) = block_size * min(matched_blocks(i), (prompt_len - 1) // block_size)`` tokens.

It then orders the healthy instances by::

    score(i) = cached(i) / prompt_len  -  load_weight * in_flight(i)

(highest first; ties keep the least-loaded, round-robin order). ``in_flight(i)`` counts the
proxy's requests in P's prefill now. With the default ``load_weight`` 0.25, a full-prompt
hit outweighs up to 3 more requests in flight, half a prompt 1. An instance whose event
stream is not live (starting, replaying, dropped, restarted, misaligned hashes) counts as
holding nothing, so it is chosen by load alone.

The reason of each decision is counted in ``vllm_ascend_pd_proxy_routing_decisions``:
``prefix`` (the chosen instance has the best hit), ``load`` (a lower hit won on load),
``no_hit`` (no instance holds a block of the prompt), ``no_index`` (no instance's index is
usable), ``no_tokens`` (the prompt could not be tokenized or hashed).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .events import EventsEndpoint, EventStream
from .prefix_index import BlockHasher, PrefixIndex, block_key

if TYPE_CHECKING:
    import httpx

    from .balancer import Instance
    from .model import Metrics

logger = logging.getLogger(__name__)


@dataclass
class KvAwareSettings:
    """How the proxy computes the instances' block hashes, and the load trade-off."""

    #: the instances' ``--prefix-caching-hash-algo``
    hash_algo: str = "sha256"
    #: their ``PYTHONHASHSEED``; None: the proxy's own, else vLLM's default seed
    hash_seed: str | None = None
    #: their block size; None: read from their BlockStored events
    block_size: int | None = None
    #: the weight of one request in flight against a whole-prompt hit
    load_weight: float = 0.25
    #: the topic of ``--kv-events-config``
    topic: str = ""
    #: P instance URL -> its events endpoint(s)
    events: dict[str, EventsEndpoint] = field(default_factory=dict)


@dataclass
class Decision:
    """One routing decision: the preferred instance and why."""

    reason: str
    instance: str = ""
    prompt_tokens: int = 0
    predicted_tokens: int = 0
    #: the predicted hit of every instance with a usable index (a failover's check)
    cached: dict[str, int] = field(default_factory=dict)


class KvRouter:
    """Prefix indexes of the P instances and the ``kv_aware`` ordering."""

    def __init__(self, settings: KvAwareSettings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.hasher = BlockHasher(settings.hash_algo, settings.hash_seed)
        self.streams: dict[str, EventStream] = {}
        self.indexes: dict[str, PrefixIndex] = {}

    # ------------------------------------------------------------ instances
    def add(self, url: str, where: EventsEndpoint | None) -> None:
        """Follow ``url``'s events (None: it has no events; it is routed by load)."""
        self.remove(url)
        index = PrefixIndex(self.settings.block_size)
        self.indexes[url] = index
        if where is None:
            return

        def count(what: str) -> None:
            if self.metrics is not None:
                self.metrics.kv_events.labels(url, what).inc()

        self.streams[url] = EventStream(url, where, index, self.hasher, count).start()

    def remove(self, url: str, wait: bool = False) -> None:
        """Stop following ``url`` (its subscriber thread ends on its own unless ``wait``)."""
        stream = self.streams.pop(url, None)
        self.indexes.pop(url, None)
        if stream is not None:
            stream.stop(wait)

    def stop(self) -> None:
        for url in list(self.streams):
            self.remove(url, wait=True)

    def instance_down(self, url: str) -> None:
        """The instance failed a health check: it may be restarting with an empty cache."""
        index = self.indexes.get(url)
        if index is not None and len(index):
            index.clear()

    def status(self, url: str) -> dict[str, Any]:
        index = self.indexes.get(url)
        stream = self.streams.get(url)
        return {"prefix_index": index.as_dict() if index is not None else None,
                "events": stream.as_dict() if stream is not None else {"state": "none"}}

    def usable(self, url: str) -> PrefixIndex | None:
        stream = self.streams.get(url)
        return stream.index if stream is not None and stream.usable else None

    # ------------------------------------------------------------ decisions
    def order(self, candidates: list[Instance], tokens: Sequence[int] | None
              ) -> tuple[list[Instance], Decision]:
        """``candidates`` (healthy first, least loaded first) reordered by score."""
        healthy = [i for i in candidates if i.healthy]
        rest = [i for i in candidates if not i.healthy]
        if not healthy:
            return rest, Decision("no_index")
        usable = {i.url: ix for i in healthy if (ix := self.usable(i.url)) is not None}
        if not usable:
            return healthy + rest, Decision("no_index", healthy[0].url, len(tokens or ()))
        if not tokens:
            return healthy + rest, Decision("no_tokens", healthy[0].url)
        n = len(tokens)
        cached = self.cached_tokens(usable, tokens)
        w = self.settings.load_weight
        ranked = sorted(healthy, key=lambda i: -(cached.get(i.url, 0) / n - w * i.in_flight))
        best = max(cached.values())
        top = ranked[0]
        got = cached.get(top.url, 0)
        reason = "no_hit" if best == 0 else ("prefix" if got == best else "load")
        return ranked + rest, Decision(reason, top.url, n, got, cached)

    def check(self, decision: Decision, chosen: str, resp: httpx.Response) -> None:
        """Record ``decision`` against P's answer ``resp`` from instance ``chosen``."""
        if resp.status_code != 200:
            return
        try:
            reported = reported_cached_tokens(resp.json())
        except ValueError:
            reported = None
        self.record(decision, chosen, reported)

    def cached_tokens(self, usable: dict[str, PrefixIndex], tokens: Sequence[int]
                      ) -> dict[str, int]:
        """Predicted hit (tokens) of each instance. Blocks are hashed one at a time and only
        while some instance still holds the prefix so far: a miss everywhere costs one hash."""
        n = len(tokens)
        by_size: dict[int, dict[str, PrefixIndex]] = {}
        for url, ix in usable.items():
            by_size.setdefault(int(ix.block_size or 0), {})[url] = ix
        cached = dict.fromkeys(usable, 0)
        for bs, alive in by_size.items():
            parent: bytes | None = None
            for b in range((n - 1) // bs):
                parent = self.hasher.hash_block(parent, tokens[b * bs:(b + 1) * bs])
                key = block_key(parent)
                for url in [u for u, ix in alive.items() if not ix.holds(key)]:
                    del alive[url]
                if not alive:
                    break
                for url in alive:
                    cached[url] += bs
        return cached

    def record(self, decision: Decision, chosen: str, reported: int | None) -> None:
        """Count the decision's prediction against what the instance reported
        (``usage.prompt_tokens_details.cached_tokens``; None: not reported)."""
        if self.metrics is None or decision.reason in ("no_tokens",):
            return
        m = self.metrics
        predicted = (decision.predicted_tokens if chosen == decision.instance
                     else decision.cached.get(chosen, 0))
        m.prompt_tokens.labels(chosen).inc(decision.prompt_tokens)
        m.predicted_hit.labels(chosen).inc(predicted)
        if reported is None:
            outcome = "unreported"
        else:
            m.reported_hit.labels(chosen).inc(reported)
            outcome = ("exact" if reported == predicted
                       else "over" if predicted > reported else "under")
        m.hit_predictions.labels(outcome).inc()


async def prompt_tokens(client: httpx.AsyncClient, base_url: str, path: str,
                        body: dict[str, Any]) -> list[int] | None:
    """The token ids the engine will see for ``body`` (None: unknown).

    A completions prompt given as token ids is used as is; a text prompt or chat messages
    are tokenized by the instance's ``/tokenize`` (one round trip to P, its tokenizer and
    chat template, so exactly what the engine will hash).
    """
    import httpx

    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        req: dict[str, Any] = {"messages": messages,
                               "add_generation_prompt": body.get("add_generation_prompt", True)}
        for key in ("continue_final_message", "chat_template", "chat_template_kwargs",
                    "tools", "add_special_tokens"):
            if key in body:
                req[key] = body[key]
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, list):
            ok = all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
            return list(prompt) if ok and prompt else None
        if not isinstance(prompt, str):
            return None
        req = {"prompt": prompt, "add_special_tokens": body.get("add_special_tokens", True)}
    if "model" in body:
        req["model"] = body["model"]
    try:
        resp = await client.post(base_url + "/tokenize", json=req, timeout=10.0)
        tokens = resp.json().get("tokens") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        logger.debug("/tokenize on %s failed: %s", base_url, exc)
        return None
    if not isinstance(tokens, list):
        return None
    return [int(t) for t in tokens if isinstance(t, int)]


def reported_cached_tokens(answer: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of an OpenAI answer, if present
    (vLLM sends it with ``--enable-prompt-tokens-details``)."""
    try:
        value = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    except (KeyError, TypeError):
        return None
    return value if isinstance(value, int) else None
