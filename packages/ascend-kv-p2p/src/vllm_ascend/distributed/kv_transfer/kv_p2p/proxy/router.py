# SPDX-License-Identifier: Apache-2.0
"""The ``kv_aware`` policy's scores: longest cached prefix on P, traded against load.

:class:`.policies.KvAware` asks them: the prefill instance with the longest cached prefix,
traded against load.

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

KV pool deployments (``AscendStoreConnector`` on the P instances, one store shared by
them): with ``pool_shared`` (or ``pools``, instance -> pool name) the pool's events
(``medium="cpu"``) on any member's stream feed one :class:`.PoolIndex` per pool, which
counts for every member. vLLM loads the device-cache prefix, and the connector then the
pool's prefix from the first block on, so a member's predicted hit is
``max(device(i), pool(i))`` where ``pool(i)`` is the pool's leading blocks (up to the
prompt's last token: ``min(blocks * block_size, prompt_len - 1)``). At equal score the
instance with more of it in its device cache wins (a device hit costs no load from the
pool). A pool index is used while at least one member's stream is live and its hashes
agree; a member's lost events make it forget what that member announced.
``vllm_ascend_pd_proxy_predicted_hit_source_tokens`` splits the predicted hits into
``device`` and ``pool`` tokens.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .events import EventsEndpoint, EventStream
from .prefix_index import (
    POOL_MAX_BLOCKS,
    POOL_MEDIUM,
    PREFIX_MAX_BLOCKS,
    PoolIndex,
    PrefixCacheHasher,
    PrefixIndex,
    block_key,
)

if TYPE_CHECKING:
    import httpx

    from .instances import Instance
    from .metrics import Metrics

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
    #: every P instance writes to one KV pool they share (its events count for all)
    pool_shared: bool = False
    #: P instance URL -> the name of the shared KV pool it writes to (several pools)
    pools: dict[str, str] = field(default_factory=dict)
    #: the ``medium`` of the pool's events
    pool_medium: str = POOL_MEDIUM
    #: blocks a pool index keeps at most
    pool_max_blocks: int = POOL_MAX_BLOCKS
    #: blocks one instance's index keeps at most
    index_max_blocks: int = PREFIX_MAX_BLOCKS

    def pool_of(self, url: str) -> str | None:
        """The shared pool ``url`` writes to (None: none)."""
        return self.pools.get(url) or (SHARED_POOL if self.pool_shared else None)


#: The pool's name under ``pool_shared``.
SHARED_POOL = "pool"


@dataclass
class Decision:
    """One routing decision: the preferred instance and why."""

    reason: str
    instance: str = ""
    prompt_tokens: int = 0
    predicted_tokens: int = 0
    #: the predicted hit of every instance with a usable index (a failover's check)
    cached: dict[str, int] = field(default_factory=dict)
    #: the part of ``cached`` in each instance's device cache (the rest: in the pool)
    device: dict[str, int] = field(default_factory=dict)


class KvRouter:
    """Prefix indexes of the P instances and the ``kv_aware`` ordering."""

    def __init__(self, settings: KvAwareSettings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.hasher = PrefixCacheHasher(settings.hash_algo, settings.hash_seed)
        self.streams: dict[str, EventStream] = {}
        self.indexes: dict[str, PrefixIndex] = {}
        #: pool name -> its index; P instance URL -> its pool's name
        self.pools: dict[str, PoolIndex] = {}
        self.members: dict[str, str] = {}

    # ------------------------------------------------------------ instances
    def add(self, url: str, where: EventsEndpoint | None, pool: str | None = None) -> None:
        """Follow ``url``'s events (None: it has no events; it is routed by load, and by
        its pool's index if it shares one). ``pool``: the shared pool it writes to
        (default: the settings')."""
        # a re-added instance: its pool's forgetting must not race its new stream's replay
        self.remove(url, forget_now=True)
        index = PrefixIndex(self.settings.block_size, self.settings.index_max_blocks)
        self.indexes[url] = index
        group = pool or self.settings.pool_of(url)
        pool_index = None
        if group:
            self.members[url] = group
            pool_index = self.pools.get(group)
            if pool_index is None:
                pool_index = self.pools[group] = PoolIndex(
                    group, self.settings.block_size, self.settings.pool_max_blocks)
        if where is None:
            return

        def count(what: str) -> None:
            if self.metrics is not None:
                self.metrics.kv_events.labels(url, what).inc()

        self.streams[url] = EventStream(url, where, index, self.hasher, count,
                                        pool=pool_index,
                                        pool_medium=self.settings.pool_medium).start()

    def remove(self, url: str, wait: bool = False, forget_now: bool = False) -> None:
        """Stop following ``url`` (its subscriber thread ends on its own unless ``wait``);
        its pool forgets what it announced (its removals would go unheard), in a thread of
        its own unless ``wait`` or ``forget_now``."""
        stream = self.streams.pop(url, None)
        self.indexes.pop(url, None)
        group = self.members.pop(url, None)
        if stream is not None:
            stream.stop(wait)
            pool = self.pools.get(group) if group is not None else None
            if pool is not None and (wait or forget_now):
                pool.forget(url)
            elif pool is not None:  # O(pool size): off the event loop (admin removals)
                threading.Thread(target=pool.forget, args=(url,), daemon=True,
                                 name=f"pool-forget-{url}").start()

    def stop(self) -> None:
        for stream in self.streams.values():  # every thread told first: they end together
            stream.stop(wait=False)
        for url in list(self.streams):
            self.remove(url, wait=True)

    def instance_down(self, url: str) -> None:
        """The instance failed a health check: it may be restarting with an empty cache
        (a shared pool outlives it: a restart shows in its stream's sequence numbers)."""
        index = self.indexes.get(url)
        if index is not None and len(index):
            index.clear()

    def status(self, url: str) -> dict[str, Any]:
        index = self.indexes.get(url)
        stream = self.streams.get(url)
        group = self.members.get(url)
        pool = self.pools.get(group) if group is not None else None
        return {"prefix_index": index.as_dict() if index is not None else None,
                "events": stream.as_dict() if stream is not None else {"state": "none"},
                "pool_index": ({**pool.as_dict(), "usable": self.pool_usable(url) is not None}
                               if pool is not None else None)}

    def usable(self, url: str) -> PrefixIndex | None:
        """``url``'s device-cache index, if its stream is live and aligned."""
        stream = self.streams.get(url)
        return stream.index if stream is not None and stream.usable else None

    def pool_usable(self, url: str) -> PoolIndex | None:
        """The index of the pool ``url`` shares, if some member's stream is live and the
        pool's hashes and block size agree with the proxy's."""
        group = self.members.get(url)
        pool = self.pools.get(group) if group is not None else None
        if pool is None or not pool.aligned or not pool.block_size:
            return None
        return pool if group in self._live_groups() else None

    def usable_pools(self, instances: Sequence[Instance]) -> dict[str, PoolIndex]:
        """:meth:`pool_usable` of each of ``instances`` that has one, by URL (the members'
        streams looked at once, not once per instance)."""
        if not self.members:
            return {}
        live = self._live_groups()
        out = {}
        for inst in instances:
            group = self.members.get(inst.url)
            pool = self.pools.get(group) if group in live else None
            if pool is not None and pool.aligned and pool.block_size:
                out[inst.url] = pool
        return out

    def _live_groups(self) -> set[str]:
        """The pools with a member whose stream is live."""
        live = set()
        for member, group in list(self.members.items()):
            stream = self.streams.get(member)
            if stream is not None and stream.state == "live":
                live.add(group)
        return live

    # ------------------------------------------------------------ decisions
    def order(self, candidates: list[Instance], tokens: Sequence[int] | None
              ) -> tuple[list[Instance], Decision]:
        """``candidates`` (healthy first, least loaded first) reordered by score."""
        healthy = [i for i in candidates if i.healthy]
        rest = [i for i in candidates if not i.healthy]
        if not healthy:
            return rest, Decision("no_index")
        usable = {i.url: ix for i in healthy if (ix := self.usable(i.url)) is not None}
        pools = self.usable_pools(healthy)
        if not usable and not pools:
            return healthy + rest, Decision("no_index", healthy[0].url, len(tokens or ()))
        if not tokens:
            return healthy + rest, Decision("no_tokens", healthy[0].url)
        n = len(tokens)
        chains: dict[int, _Chain] = {}
        device = self.cached_tokens(usable, tokens, chains)
        pooled = self.pool_tokens(pools, tokens, chains)
        cached = {u: max(device.get(u, 0), pooled.get(u, 0)) for u in {*usable, *pools}}
        w = self.settings.load_weight
        ranked = sorted(healthy, key=lambda i: (-(cached.get(i.url, 0) / n - w * i.in_flight),
                                                -device.get(i.url, 0)))
        best = max(cached.values())
        top = ranked[0]
        got = cached.get(top.url, 0)
        reason = "no_hit" if best == 0 else ("prefix" if got == best else "load")
        return ranked + rest, Decision(reason, top.url, n, got, cached, device)

    def check(self, decision: Decision, chosen: str, resp: httpx.Response) -> None:
        """Record ``decision`` against P's answer ``resp`` from instance ``chosen``."""
        if resp.status_code != 200:
            return
        try:
            reported = reported_cached_tokens(resp.json())
        except ValueError:
            reported = None
        self.record(decision, chosen, reported)

    def cached_tokens(self, usable: dict[str, PrefixIndex], tokens: Sequence[int],
                      chains: dict[int, _Chain] | None = None) -> dict[str, int]:
        """Predicted device-cache hit (tokens) of each instance. Blocks are hashed one at a
        time and only while some index still holds the prefix so far: a miss everywhere
        costs one hash (``chains``: the hashes computed so far, shared with the pools)."""
        n = len(tokens)
        chains = {} if chains is None else chains
        by_size: dict[int, dict[str, PrefixIndex]] = {}
        for url, ix in usable.items():
            by_size.setdefault(int(ix.block_size or 0), {})[url] = ix
        cached = dict.fromkeys(usable, 0)
        for bs, alive in by_size.items():
            chain = chains.setdefault(bs, _Chain(self.hasher, tokens, bs))
            for b in range((n - 1) // bs):
                key = chain.key(b)
                for url in [u for u, ix in alive.items() if not ix.holds(key)]:
                    del alive[url]
                if not alive:
                    break
                for url in alive:
                    cached[url] += bs
        return cached

    def pool_tokens(self, pools: dict[str, PoolIndex], tokens: Sequence[int],
                    chains: dict[int, _Chain] | None = None) -> dict[str, int]:
        """Predicted pool hit (tokens) of each instance: its pool's leading blocks, as the
        pool connector looks them up (every full block; at most ``prompt_len - 1``)."""
        n = len(tokens)
        chains = {} if chains is None else chains
        per_pool: dict[int, int] = {}
        for pool in pools.values():
            if id(pool) in per_pool:
                continue
            bs = int(pool.block_size or 0)
            chain = chains.setdefault(bs, _Chain(self.hasher, tokens, bs))
            m = 0
            while m < n // bs and pool.holds(chain.key(m)):
                m += 1
            per_pool[id(pool)] = min(m * bs, n - 1)
        return {url: per_pool[id(pool)] for url, pool in pools.items()}

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
        on_device = min(predicted, decision.device.get(chosen, 0))
        source = self._source_counter()
        source.labels(chosen, "device").inc(on_device)
        source.labels(chosen, "pool").inc(predicted - on_device)
        if reported is None:
            outcome = "unreported"
        else:
            m.reported_hit.labels(chosen).inc(reported)
            outcome = ("exact" if reported == predicted
                       else "over" if predicted > reported else "under")
        m.hit_predictions.labels(outcome).inc()

    def _source_counter(self) -> Any:
        """``vllm_ascend_pd_proxy_predicted_hit_source_tokens`` on the metrics' registry."""
        metrics: Any = self.metrics
        counter = getattr(metrics, "predicted_hit_source", None)
        if counter is None:  # registered once per registry, beside the proxy's metrics
            from prometheus_client import Counter

            counter = Counter(
                "vllm_ascend_pd_proxy_predicted_hit_source_tokens",
                "Prompt tokens kv_aware predicted cached on the instance it chose, by "
                "where: device (its own cache) or pool (the KV pool it shares).",
                ["instance", "source"], registry=metrics.registry)
            metrics.predicted_hit_source = counter
        return counter


class _Chain:
    """The block keys of one prompt for one block size, hashed on demand, once."""

    def __init__(self, hasher: PrefixCacheHasher, tokens: Sequence[int], block_size: int) -> None:
        self.hasher = hasher
        self.tokens = tokens
        self.block_size = block_size
        self.keys: list[int] = []
        self._parent: bytes | None = None

    def key(self, b: int) -> int:
        """The key of block ``b`` (blocks before it are hashed first)."""
        bs = self.block_size
        while len(self.keys) <= b:
            i = len(self.keys)
            self._parent = self.hasher.hash_block(self._parent, self.tokens[i * bs:(i + 1) * bs])
            self.keys.append(block_key(self._parent))
        return self.keys[b]


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
