# SPDX-License-Identifier: Apache-2.0
"""The open-loop load of ``bench fleet`` and what it measures.

Requests leave at Poisson arrival times of a given rate, whatever the answers (open loop:
a slow router builds a queue, it does not slow the client), not streamed, through the router
(or, for ``none``, to a P and then a D chosen in turn by the client). For each request the
client keeps its latency and the instances' own account (``sim`` of the answer: P's and
D's ``service_s``, P's cached tokens, the modelled prefill, queueing and first decode
step); from them:

* router-added seconds: client latency minus P's and D's ``service_s`` (what is left is the
  router, loopback and the client; ``none`` measures the last two alone);
* modelled TTFT: P's queueing + P's prefill + D's first decode step (the cost model's
  seconds; a hop's loopback is not in it);
* hit rate: P's cached tokens over prompt tokens, against the offline best of the same
  requests (:func:`..router.best_achievable`: one unbounded cache that saw every earlier
  request).

Churn (:class:`Churn`) runs beside the load: at set shares of the run it adds P instances
(fleet, then router), drains some (router removes them, their requests finish, then they
die) and kills others (the router is not told). The fleet's stats then give the time from
the router's add to a new P's first request, and from a death to the last request routed
to the dead P (its health probes are counted apart).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .http import Client
from .routers import Router

MODEL = "tiny"


@dataclass
class Sample:
    """One request as the client saw it."""

    sent: float
    latency_s: float | None = None
    status: int = 0
    error: str | None = None
    sim: dict[str, Any] | None = None
    prompt_tokens: int = 0

    def row(self, t0: float) -> dict[str, Any]:
        s = self.sim or {}
        p = s.get("p") or {}
        out = {"t": round(self.sent - t0, 6), "latency_s": self.latency_s,
               "status": self.status, "prompt_tokens": self.prompt_tokens,
               "p": p.get("instance"), "d": s.get("instance"),
               "cached_tokens": p.get("cached_tokens"),
               "router_s": router_seconds(self), "ttft_model_s": ttft_model(self)}
        if self.error:
            out["error"] = self.error
        return out


def router_seconds(s: Sample) -> float | None:
    """Client latency minus P's and D's time inside the instances."""
    sim = s.sim or {}
    p = sim.get("p") or {}
    if s.latency_s is None or "service_s" not in sim or "service_s" not in p:
        return None
    return s.latency_s - float(sim["service_s"]) - float(p["service_s"])


def ttft_model(s: Sample) -> float | None:
    """P's queueing and prefill and D's first decode step, as modelled."""
    sim = s.sim or {}
    p = sim.get("p") or {}
    if "prefill_s" not in p:
        return None
    return (float(p.get("queue_s") or 0.0) + float(p["prefill_s"])
            + float(sim.get("first_token_s") or 0.0))


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile, linear between closest ranks."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(samples: Sequence[Sample], best: dict[str, Any], wall_s: float
              ) -> dict[str, Any]:
    """The run's figures (milliseconds, rates)."""
    ok = [s for s in samples if s.status == 200 and s.sim is not None]
    router = [r * 1000 for s in ok if (r := router_seconds(s)) is not None]
    ttft = [t * 1000 for s in ok if (t := ttft_model(s)) is not None]
    lat = [s.latency_s * 1000 for s in ok if s.latency_s is not None]
    hit = sum(int((s.sim or {}).get("p", {}).get("cached_tokens") or 0) for s in ok)
    prompt = sum(s.prompt_tokens for s in ok)
    rate = hit / prompt if prompt else None
    return {"requests": len(samples), "completed": len(ok), "failed": len(samples) - len(ok),
            "errors": sorted({s.error or f"HTTP {s.status}" for s in samples
                              if s not in ok})[:5],
            "achieved_rps": len(ok) / wall_s if wall_s > 0 else None,
            "router_p50_ms": percentile(router, 50), "router_p99_ms": percentile(router, 99),
            "latency_p50_ms": percentile(lat, 50), "latency_p99_ms": percentile(lat, 99),
            "ttft_model_p50_ms": percentile(ttft, 50), "ttft_model_p99_ms": percentile(ttft, 99),
            "hit_rate": rate, "best_hit_rate": best.get("rate"),
            "hit_vs_best": rate / best["rate"] if rate is not None and best.get("rate")
            else None}


@dataclass
class Churn:
    """Instances added, drained and killed mid-run (P instances; ``count`` of each)."""

    count: int
    add_at: float = 0.25
    drain_at: float = 0.4
    kill_at: float = 0.6
    events: list[dict[str, Any]] = field(default_factory=list)


async def _ctl(fleet: Client, method: str, path: str, doc: Any = None) -> Any:
    status, body = await fleet.request(method, path, doc)
    if status != 200:
        raise RuntimeError(f"fleet {path} answered {status}: {body[:300]!r}")
    return json.loads(body)


async def run_churn(churn: Churn, router: Router, fleet: Client, prefill: list[dict[str, Any]],
                    duration: float, t0: float) -> None:
    """Add, drain and kill P instances at their shares of ``duration``; each step in
    ``churn.events`` with its ``time.monotonic``."""
    loop = asyncio.get_running_loop()
    victims = prefill[-2 * churn.count:]
    drained, killed = victims[:churn.count], victims[churn.count:]

    async def at(share: float) -> None:
        await asyncio.sleep(max(0.0, t0 + share * duration - time.monotonic()))

    await at(churn.add_at)
    for _ in range(churn.count):
        inst = await _ctl(fleet, "POST", "/fleet/add", {"role": "prefill"})
        ok, answer = await loop.run_in_executor(None, router.add_prefill, inst)
        churn.events.append({"what": "add", "name": inst["name"], "at": time.monotonic(),
                             "router_ok": ok, "router_answer": answer})
    await at(churn.drain_at)
    for inst in drained:
        ok, answer = await loop.run_in_executor(None, router.remove_prefill, inst)
        churn.events.append({"what": "drain", "name": inst["name"], "at": time.monotonic(),
                             "router_ok": ok, "router_answer": answer})
        await _ctl(fleet, "POST", "/fleet/drain", {"name": inst["name"]})
    for inst in drained:  # its requests finish, then it goes
        for _ in range(100):
            stats = await _ctl(fleet, "GET", "/fleet/stats")
            if stats[inst["name"]]["running"] == 0:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.0)
        await _ctl(fleet, "POST", "/fleet/kill", {"name": inst["name"]})
    await at(churn.kill_at)
    for inst in killed:
        await _ctl(fleet, "POST", "/fleet/kill", {"name": inst["name"]})
        churn.events.append({"what": "kill", "name": inst["name"], "at": time.monotonic()})


def churn_figures(churn: Churn, stats: dict[str, Any]) -> dict[str, Any]:
    """Seconds to a new P's first request after the router's add, and from a death to the
    last request routed to the dead P (0: none came; health probes not counted)."""
    added, stopped = [], []
    for ev in churn.events:
        st = stats.get(ev["name"]) or {}
        if ev["what"] == "add":
            first = st.get("first_request")
            added.append(None if first is None or not ev["router_ok"]
                         else max(0.0, first - ev["at"]))
        elif ev["what"] == "kill":
            tries = st.get("attempts_after_death") or []
            stopped.append((max(tries) - st["died"]) if tries else 0.0)
            ev["attempts_after_death"] = len(tries)
            ev["probes_after_death"] = st.get("probes_after_death")
    return {"take_in_s": added, "stop_routing_s": stopped,
            "events": [{k: (round(v, 6) if isinstance(v, float) else v)
                        for k, v in ev.items()} for ev in churn.events]}


async def drive(router: Router, prompts: Sequence[list[int]], rate: float, *, fleet_url: str,
                prefill: list[dict[str, Any]], decode: list[dict[str, Any]], output_len: int,
                seed: int = 0, churn: Churn | None = None, timeout: float = 60.0
                ) -> tuple[list[Sample], float, float]:
    """Send ``prompts`` at Poisson arrivals of ``rate`` a second; the samples, the start
    (``time.monotonic``) and the wall seconds."""
    host, port = fleet_url.split("//", 1)[1].split(":")
    fleet = Client(host, int(port), size=8)
    rng = random.Random(seed)
    clients: dict[str, Client] = {}

    def client(url: str) -> Client:
        if url not in clients:
            h, p = url.split("//", 1)[1].split(":")
            clients[url] = Client(h, int(p), size=4096)
        return clients[url]

    samples: list[Sample] = []
    rr = [0]

    async def one(prompt: list[int], s: Sample) -> None:
        body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": output_len,
                                "temperature": 0.0, "ignore_eos": True}
        try:
            if router.kind == "none":
                i = rr[0]
                rr[0] += 1
                p_url, d_url = prefill[i % len(prefill)]["url"], decode[i % len(decode)]["url"]
                pb = {**body, "max_tokens": 1,
                      "kv_transfer_params": {"do_remote_decode": True}}
                status, data = await client(p_url).request("POST", "/v1/completions", pb,
                                                           timeout)
                if status == 200:
                    body["kv_transfer_params"] = json.loads(data)["kv_transfer_params"]
                    status, data = await client(d_url).request("POST", "/v1/completions",
                                                               body, timeout)
            else:  # replicas of our proxy take the requests in turn
                i = rr[0]
                rr[0] += 1
                url = router.urls[i % len(router.urls)]
                status, data = await client(url).request("POST", "/v1/completions", body,
                                                         timeout)
            s.latency_s = time.monotonic() - s.sent
            s.status = status
            if status == 200:
                s.sim = json.loads(data).get("sim")
            else:
                s.error = f"HTTP {status}: {data[:120]!r}"
        except Exception as exc:  # a failed request is a sample, never fatal
            s.error = f"{type(exc).__name__}: {str(exc)[:120]}"

    tasks = []
    t0 = time.monotonic()
    duration = len(prompts) / rate
    churn_task = (asyncio.create_task(run_churn(churn, router, fleet, prefill, duration, t0))
                  if churn is not None else None)
    at = t0
    for prompt in prompts:
        at += rng.expovariate(rate)
        delay = at - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        s = Sample(sent=time.monotonic(), prompt_tokens=len(prompt))
        samples.append(s)
        tasks.append(asyncio.create_task(one(prompt, s)))
    await asyncio.gather(*tasks)
    wall = time.monotonic() - t0
    if churn_task is not None:
        await churn_task
    for c in clients.values():
        await c.close()
    await fleet.close()
    return samples, t0, wall


async def fleet_stats(fleet_url: str) -> dict[str, Any]:
    host, port = fleet_url.split("//", 1)[1].split(":")
    c = Client(host, int(port), size=1)
    try:
        return dict(await _ctl(c, "GET", "/fleet/stats"))
    finally:
        await c.close()
