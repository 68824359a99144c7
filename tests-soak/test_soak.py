# SPDX-License-Identifier: Apache-2.0
"""Soak: thousands of requests through P/D (pull and layerwise) and the pool on loopback,
with random client aborts and a sprinkling of virtual requests.

Real CPU engines (``EngineProcess``) and a real Mooncake transfer engine and store. Each
round sends a batch through the engines' own request loop
(:func:`ascend_kv_testing.soak.run_requests`): some clients abort at a random step (what
vLLM's API server does when a client goes away), some vanish between P and D, some
layerwise requests are virtual. Afterwards, for every part:

* requests in == answered + failed (with a reason) + aborted; nothing lost;
* every answered, non-virtual request has the single-instance tokens;
* no held blocks, no pending transfers, no pending saves on any engine;
* the transfer engine's registered memory is what it was after warm-up;
* resident memory flat after warm-up: vLLM's own memory keeps growing for a while as
  it meets new batch shapes, so every part runs a connector-less control engine on the
  same prompts and an engine may grow only as much as the control plus a small slack.

``VLLM_ASCEND_KV_SOAK_REQUESTS`` sets the requests of each part (default 1200),
``VLLM_ASCEND_KV_SOAK_REPORT`` a path for the JSON summary.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.faults import rss_bytes, start_in_parallel, wait_for
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.mooncake import MooncakeMaster, MooncakeSegmentHolder
from ascend_kv_testing.pd import PREFILL, PROBES, kv_config, prompts_of

RUN = "ascend_kv_testing.soak:run_requests"
REQUESTS = int(os.environ.get("VLLM_ASCEND_KV_SOAK_REQUESTS", "1200"))
BATCH = 16
MAX_TOKENS = 6
WARMUP = 0.25  # share of the rounds before the memory baseline is taken
#: Resident memory an engine may gain after warm-up beyond what the control engine gained.
RSS_SLACK = 64 << 20
LEASE_S = 5.0
SEED = int(os.environ.get("VLLM_ASCEND_KV_SOAK_SEED", "0"))

_summary: dict[str, Any] = {}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("soak-model"))


@pytest.fixture
def control(model: Path) -> Iterator[EngineProcess]:
    """A fresh engine without any connector for each part: the memory yardstick."""
    with EngineProcess(model) as plain:
        yield plain


@pytest.fixture(scope="module")
def corpus(model: Path) -> dict[tuple[int, ...], list[int]]:
    """96 prompts (5 to 300 tokens, some sharing prefixes) and their single-instance tokens."""
    rng = random.Random(SEED)
    prefixes = prompts_of([64, 96, 128], seed=SEED + 1)
    prompts = []
    for i, length in enumerate(rng.randrange(5, 300) for _ in range(96)):
        own = prompts_of([length], seed=SEED + 100 + i)[0]
        prompts.append((prefixes[i % 3] + own)[:max(length, 5)] if i % 4 == 0 else own)
    with EngineProcess(model) as plain:
        outs = plain.generate(prompts, max_tokens=MAX_TOKENS)
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs, strict=True)}


class Tally:
    """Outcomes of one part of the soak and the memory samples of its engines."""

    def __init__(self, name: str, engines: dict[str, EngineProcess],
                 control: EngineProcess) -> None:
        self.name = name
        self.engines = engines
        self.control = control
        self.control_rss: list[int] = []
        self.sent = 0
        self.counts: dict[str, int] = {}
        self.reasons: dict[str, int] = {}
        self.wrong: list[str] = []
        self.rss: dict[str, list[int]] = {n: [] for n in engines}
        self.registered: dict[str, int] = {}

    def add(self, outcome: dict[str, Any], want: list[int] | None) -> None:
        kind = outcome["outcome"]
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if "reason" in outcome:
            self.reasons[outcome["reason"].split(" at step")[0]] = self.reasons.get(
                outcome["reason"].split(" at step")[0], 0) + 1
        if kind == "answered" and want is not None and outcome["tokens"] != want:
            self.wrong.append(outcome["id"])

    def mirror(self, prompts: list[list[int]], max_tokens: int) -> None:
        """Run the same prompts on the control engine (its memory is the yardstick)."""
        self.control.call(RUN, timeout=600, requests=[
            {"id": f"c{self.sent}-{i}", "prompt": p, "max_tokens": max_tokens}
            for i, p in enumerate(prompts)])

    def sample(self) -> None:
        for name, engine in self.engines.items():
            self.rss[name].append(rss_bytes(engine.proc.pid))
        self.control_rss.append(rss_bytes(self.control.proc.pid))

    def warmed_up(self) -> None:
        for name, engine in self.engines.items():
            self.registered[name] = engine.call(f"{PROBES}:leak_state")["registered_bytes"]

    def check(self) -> dict[str, Any]:
        """The end-of-soak checks; returns the summary."""
        accounted = sum(self.counts.values()) - self.counts.get("lost", 0)
        states = {}
        for name, engine in self.engines.items():
            assert engine.wait_idle(60), f"{self.name}/{name} never went idle"
            # leases of requests whose client vanished after P lapse within LEASE_S
            assert wait_for(lambda e=engine: e.call(f"{PROBES}:step_for", seconds=0.2)
                            ["requests"] == 0, LEASE_S + 10)
            states[name] = engine.call(f"{PROBES}:leak_state")
        start = int(len(self.control_rss) * WARMUP)
        growth = {n: (r[-1] - r[start]) for n, r in self.rss.items() if r}
        control = self.control_rss[-1] - self.control_rss[start]
        summary = {"sent": self.sent, "outcomes": self.counts, "reasons": self.reasons,
                   "wrong_tokens": len(self.wrong), "leak_state": states,
                   "rss_growth_after_warmup_mib": {n: round(g / (1 << 20), 1)
                                                    for n, g in growth.items()},
                   "control_rss_growth_after_warmup_mib": round(control / (1 << 20), 1),
                   "rss_mib": {n: [round(x / (1 << 20)) for x in r[:: max(1, len(r) // 8)]]
                               for n, r in self.rss.items()}}
        _summary[self.name] = summary
        assert self.counts.get("lost", 0) == 0, summary
        assert accounted == self.sent, summary
        assert not self.wrong, f"{len(self.wrong)} answers differ from the single instance"
        for name, s in states.items():
            assert s["requests"] == 0 and s["used_blocks"] == 0, (name, s)
            assert s["p2p_held"] == 0 and s["p2p_pending"] == 0 and s["p2p_pushes"] == 0, s
            assert s["pool_pending_saves"] == 0, (name, s)
            if name in self.registered:
                assert s["registered_bytes"] == self.registered[name], (name, s)
        for name, g in growth.items():
            assert g < max(control, 0) + RSS_SLACK, (
                f"{self.name}/{name}: resident memory grew {g >> 20} MiB after warm-up, the "
                f"connector-less control {control >> 20} MiB")
        return summary


def _rounds() -> int:
    return max(2, REQUESTS // BATCH)


def _abort_at(rng: random.Random, share: float, steps: int) -> int | None:
    return rng.randrange(0, steps) if rng.random() < share else None


# ---------------------------------------------------------------------------------- pull


@pytest.fixture(scope="module", params=["threads", "inline"])
def pull(model: Path, request: pytest.FixtureRequest) -> Iterator[dict[str, EngineProcess]]:
    """P and D pulling; ``inline``: D with ``inline_reads`` and same-host reads off on both
    (what a D on another host does: its small window reads start on vLLM's thread)."""
    inline = request.param == "inline"
    env = {"VLLM_ASCEND_KV_LOCAL_READS": "0"} if inline else None
    d_extra = {"inline_reads": True} if inline else {}
    made = start_in_parallel({
        "p": lambda: EngineProcess(model, kv_config("kv_producer", "soak-p",
                                                    lease_ttl_s=LEASE_S), env=env),
        "d": lambda: EngineProcess(model, kv_config("kv_consumer", "soak-d",
                                                    policy="recompute", load_timeout_s=20,
                                                    **d_extra), env=env),
    })
    made_with: dict[str, Any] = {**made, "mode": request.param}
    yield made_with
    for e in made.values():
        e.close()


def test_soak_pull_pd(pull: dict[str, Any], corpus: dict[tuple[int, ...], list[int]],
                      control: EngineProcess) -> None:
    p, d = pull["p"], pull["d"]
    rng = random.Random(SEED + 7)
    mode = pull["mode"]
    tally = Tally("pull" if mode == "threads" else f"pull-{mode}", {"p": p, "d": d}, control)
    prompts = list(corpus)
    seq = 0
    rounds = _rounds()
    for rnd in range(rounds):
        batch = [list(rng.choice(prompts)) for _ in range(BATCH)]
        ids = [f"s{seq + i}" for i in range(BATCH)]
        seq += BATCH
        tally.sent += BATCH
        p_out = p.call(RUN, timeout=600, requests=[
            {"id": f"{rid}-p", "prompt": pr, "max_tokens": 1, "kv": dict(PREFILL),
             "abort_after": _abort_at(rng, 0.04, 3)} for rid, pr in zip(ids, batch, strict=True)])
        to_d = []
        for rid, pr, out in zip(ids, batch, p_out, strict=True):
            if out["outcome"] != "answered":
                tally.add({**out, "id": rid, "reason": f"prefill {out['outcome']}: "
                           + out.get("reason", "")}, None)
            elif rng.random() < 0.03:  # the client vanished between P and D: P's lease lapses
                tally.add({"id": rid, "outcome": "aborted",
                           "reason": "client gone after the prefill"}, None)
            else:
                to_d.append({"id": rid, "prompt": pr, "max_tokens": MAX_TOKENS,
                             "kv": out["kv_transfer_params"],
                             "abort_after": _abort_at(rng, 0.06, 6)})
        for out, req in zip(d.call(RUN, timeout=600, requests=to_d), to_d, strict=True):
            tally.add(out, corpus[tuple(req["prompt"])])
        tally.mirror(batch, 1)
        tally.sample()
        if rnd == int(rounds * WARMUP):
            tally.warmed_up()
    summary = tally.check()
    totals = d.call(f"{PROBES}:connector_totals")
    summary["d_totals"] = {k: v for k, v in totals.items() if k.startswith("p2p_")}
    assert totals.get("p2p_requests_loaded", 0) > 0
    if mode == "inline":  # the path under soak was taken
        assert totals.get("p2p_inline_reads", 0) > 0, summary["d_totals"]


# ---------------------------------------------------------------------------------- layerwise


class Metaserver:
    """Collects D's metaserver posts (the proxy's /v1/metaserver without forwarding)."""

    def __init__(self) -> None:
        self.posts: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.posts[body["request_id"]] = body
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/metaserver"

    def take(self) -> dict[str, dict[str, Any]]:
        with self.lock:
            out, self.posts = self.posts, {}
        return out

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def layerwise(model: Path) -> Iterator[Any]:
    # D's short write lease: the transfer engine's stall bound must stay well below it.
    env = {"MC_TCP_PROGRESS_TIMEOUT_SEC": "1"}
    made = start_in_parallel({
        "p": lambda: EngineProcess(model, kv_config(
            "kv_producer", "soak-lw-p", connector="MooncakeLayerwiseConnector"),
            max_num_batched_tokens=256, env=env),
        "d": lambda: EngineProcess(model, kv_config(
            "kv_consumer", "soak-lw-d", policy="recompute",
            connector="MooncakeLayerwiseConnector", load_timeout_s=20, lease_ttl_s=LEASE_S),
            env=env),
    })
    meta = Metaserver()
    yield type("LW", (), {**made, "meta": meta})
    meta.close()
    for e in made.values():
        e.close()


def test_soak_layerwise_with_virtual_requests(layerwise: Any,
                                              corpus: dict[tuple[int, ...], list[int]],
                                              control: EngineProcess) -> None:
    p, d, meta = layerwise.p, layerwise.d, layerwise.meta
    rng = random.Random(SEED + 8)
    tally = Tally("layerwise", {"p": p, "d": d}, control)
    prompts = list(corpus)
    virtual_sent = 0
    rounds = _rounds()
    for rnd in range(rounds):
        reqs = []
        for i in range(BATCH):
            rid = f"lw{rnd}-{i}"
            virtual = rng.random() < 0.06
            virtual_sent += virtual
            kv = {"do_remote_prefill": True, "metaserver": meta.url, "request_id": rid,
                  **({"do_virtual": True} if virtual else {})}
            # virtual requests share the prompts of real ones: their blocks, which hold no
            # KV, must never serve a later request (tests-faults/test_faults_virtual.py)
            reqs.append({"id": rid, "prompt": list(rng.choice(prompts)),
                         "max_tokens": MAX_TOKENS, "kv": kv, "virtual": virtual,
                         "abort_after": _abort_at(rng, 0.05, 8)})
        tally.sent += BATCH
        result: dict[str, Any] = {}

        def decode(batch: list[dict[str, Any]] = reqs, into: dict[str, Any] = result) -> None:
            try:
                into["out"] = d.call(RUN, timeout=600, requests=[
                    {k: v for k, v in r.items() if k != "virtual"} for r in batch])
            except BaseException as exc:  # surfaced below
                into["error"] = exc

        thread = threading.Thread(target=decode)
        thread.start()
        by_id = {r["id"]: r for r in reqs}
        while thread.is_alive():
            posted = meta.take()
            if posted:  # P prefills what D posted (P pushes into D's blocks)
                p.call(RUN, timeout=600, requests=[
                    {"id": f"{rid}-p", "prompt": by_id[rid]["prompt"], "max_tokens": 1,
                     "kv": params} for rid, params in posted.items()])
            else:
                time.sleep(0.01)
        thread.join()
        if "error" in result:
            raise result["error"]
        for out, req in zip(result["out"], reqs, strict=True):
            tally.add(out, None if req["virtual"] else corpus[tuple(req["prompt"])])
            if req["virtual"] and out["outcome"] == "answered":
                assert len(out["tokens"]) == MAX_TOKENS
        tally.mirror([r["prompt"] for r in reqs], 1)
        tally.sample()
        if rnd == int(rounds * WARMUP):
            tally.warmed_up()
    summary = tally.check()
    dt = d.call(f"{PROBES}:connector_totals")
    summary["virtual_sent"] = virtual_sent
    summary["d_totals"] = {k: v for k, v in dt.items() if k.startswith("p2p_")}
    assert dt.get("p2p_virtual_requests", 0) > 0 and dt.get("p2p_requests_loaded", 0) > 0


# ---------------------------------------------------------------------------------- pool


@pytest.fixture(scope="module")
def pool(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    work = tmp_path_factory.mktemp("soak-pool")
    master = MooncakeMaster(work / "mc").start()
    holder = MooncakeSegmentHolder(master, segment_size="256MB").start()
    kv = {"kv_connector": "AscendStoreConnector", "kv_role": "kv_both",
          "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {
              "backend": "mooncake", "mooncake": master.config(global_segment_size=0,
                                                               local_buffer_size="32MB")}}
    try:
        made = start_in_parallel({"a": lambda: EngineProcess(model, kv),
                                  "b": lambda: EngineProcess(model, kv)})
        yield made
        for e in made.values():
            e.close()
    finally:
        holder.stop()
        master.stop()


def test_soak_pool(pool: dict[str, EngineProcess], corpus: dict[tuple[int, ...], list[int]],
                   control: EngineProcess) -> None:
    rng = random.Random(SEED + 9)
    tally = Tally("pool", pool, control)
    prompts = list(corpus)
    names = sorted(pool)
    rounds = _rounds()
    for rnd in range(rounds):
        engine = pool[names[rnd % 2]]
        if rnd % 5 == 4:
            engine.reset_prefix_cache()  # hits must come from the pool, not vLLM's cache
        reqs = [{"id": f"pl{rnd}-{i}", "prompt": list(rng.choice(prompts)),
                 "max_tokens": MAX_TOKENS, "abort_after": _abort_at(rng, 0.05, 6)}
                for i in range(BATCH)]
        tally.sent += BATCH
        for out, req in zip(engine.call(RUN, timeout=600, requests=reqs), reqs, strict=True):
            tally.add(out, corpus[tuple(req["prompt"])])
        if rnd % 2 == 0:  # the control follows one of the two pool engines
            tally.mirror([r["prompt"] for r in reqs], MAX_TOKENS)
        tally.sample()
        if rnd == int(rounds * WARMUP):
            tally.warmed_up()
    summary = tally.check()
    totals = {n: e.call(f"{PROBES}:pool_totals") for n, e in pool.items()}
    summary["pool_totals"] = {n: {k: v for k, v in t.items() if "blocks" in k or "hit" in k}
                              for n, t in totals.items()}
    assert sum(t.get("pool_loaded_blocks", 0) for t in totals.values()) > 0


def teardown_module() -> None:
    path = os.environ.get("VLLM_ASCEND_KV_SOAK_REPORT")
    if path and _summary:
        Path(path).write_text(json.dumps(_summary, indent=2, default=str))
