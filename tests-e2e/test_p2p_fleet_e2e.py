# SPDX-License-Identifier: Apache-2.0
"""2 P and 2 D ``vllm serve`` instances behind ``vllm-ascend-pd-proxy`` and vLLM's router, all
real: the fleet runs of issues 18 and 53, outside the default e2e session (``nox -s e2e-fleet``,
several minutes).

* Layerwise (``--mode layerwise``): completions equal a single instance's and the load
  spreads over all four instances.
* Pull mode, P's lease short (3 s):
  * vLLM's benchmark client at concurrency 8 and 16, random and ``prefix_repetition``
    datasets: nothing fails, and no block is left held on either P;
  * one P SIGKILLed while requests stream in: every request ends (200 through the other P,
    or a clear HTTP error, never a hang), new requests go to the other P, and the restarted
    P (same port) is taken back after the proxy's health check and gets requests again;
  * one D SIGKILLed (paused first, so requests are in flight on it): the same, and P holds
    no block afterwards: the proxy re-sends what D had to the other D, whose Done frees P's
    blocks, and two requests handed to the dead D directly (no proxy renewing, none
    re-sending) are freed by P's lease lapsing.
* Behind vLLM's router (``vllm-router==0.1.17 --vllm-pd-disaggregation --policy
  round_robin``), pull mode, P's lease the default: completions equal a single instance's,
  and vLLM's benchmark client at concurrency 8 and 16 fails nothing; every request D
  finished had its KV loaded from a P, every engine took a share, no block is left held.

The three fleets run one after the other (class-scoped fixtures), four engines at most.
"""

from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from ascend_kv_testing.models import make_served_llama
from ascend_kv_testing.pd import LAYERWISE, PREFILL, kv_config
from ascend_kv_testing.serving import (
    HELD,
    LOADED,
    MODEL_NAME,
    REQUESTS_DONE,
    Server,
    bench_client,
    http,
    metrics,
    proxy,
    start_all,
    started,
    vllm_router,
    vllm_serve,
    wait_metric,
)

TEXT = ("the quick brown fox jumps over the lazy dog while the small cat sleeps near the warm "
        "fire and the old man reads a long book about ships sailing far across the cold "
        "northern sea in the winter of a year nobody remembers any more")
WORDS = TEXT.split(" ")
ENGINES = ("p0", "p1", "d0", "d1")
#: P's lease on a request's blocks (pull mode): short, so a lapsed lease shows quickly.
LEASE_TTL_S = 3.0


def prompt(i: int, words: int = 60) -> str:
    """A distinct prompt of about ``words`` tokens (two blocks and a bit)."""
    rng = random.Random(i)
    return f"request {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_served_llama(tmp_path_factory.mktemp("fleet-model"))[0]


def fleet(model: Path, logs: Path, kv: Callable[[str, str], dict[str, Any]],
          proxy_args: tuple[str, ...], p_args: tuple[str, ...] = ()) -> Iterator[dict[str, Server]]:
    servers: dict[str, Server] = {}
    make: dict[str, Callable[[], Server]] = {}
    for i in range(2):
        make[f"p{i}"] = lambda i=i: vllm_serve(f"prefill{i}", model, logs,  # type: ignore[misc]
                                               kv("kv_producer", f"fleet-p{i}"), *p_args)
        make[f"d{i}"] = lambda i=i: vllm_serve(f"decode{i}", model, logs,  # type: ignore[misc]
                                               kv("kv_consumer", f"fleet-d{i}"))
    try:
        start_all(make, servers)
        servers["proxy"] = started(lambda: proxy(
            "proxy", logs, [servers["p0"].url, servers["p1"].url],
            [servers["d0"].url, servers["d1"].url], *proxy_args))
        yield servers
    finally:
        for s in reversed(list(servers.values())):
            s.stop()


def complete(base: str, text: str, timeout: float = 180.0) -> tuple[int, Any]:
    return http(base + "/v1/completions", {
        "model": MODEL_NAME, "prompt": text, "max_tokens": 8, "temperature": 0.0,
        "ignore_eos": True, "return_token_ids": True}, timeout=timeout)


def tokens(base: str, text: str) -> list[int]:
    status, out = complete(base, text)
    assert status == 200, out
    return list(out["choices"][0]["token_ids"])


def reference(d: Server, texts: list[str]) -> list[list[int]]:
    """Single-instance tokens (D without kv params is a plain engine), then a clean cache."""
    want = [tokens(d.url, t) for t in texts]
    assert http(d.url + "/reset_prefix_cache", {})[0] == 200
    return want


def status(base: str) -> dict[str, Any]:
    code, out = http(base + "/status")
    assert code == 200, out
    return dict(out)


def served_counts(base: str) -> dict[str, int]:
    """The proxy's count of requests each instance answered (p0, p1, d0, d1)."""
    out = status(base)
    return {f"{role[0]}{i}": int(inst["served"])
            for role in ("prefill", "decode") for i, inst in enumerate(out[role])}


def healthy(base: str, key: str) -> bool:
    role = "prefill" if key[0] == "p" else "decode"
    return bool(status(base)[role][int(key[1])]["healthy"])


def wait_healthy(base: str, key: str, want: bool, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while healthy(base, key) != want:
        assert time.monotonic() < deadline, status(base)
        time.sleep(0.25)


def spread_equals_single(servers: dict[str, Server], n: int = 8) -> None:
    """``n`` distinct prompts through the proxy (4 at a time): the single instance's tokens,
    and every instance took a share (the proxy's counts and the engines' own)."""
    router = servers["proxy"]
    texts = [prompt(100 + i) for i in range(n)]
    want = reference(servers["d0"], texts)
    served0 = served_counts(router.url)
    done0 = {k: metrics(servers[k].url).get(REQUESTS_DONE, 0.0) for k in ENGINES}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda t: tokens(router.url, t), texts))
    assert got == want
    served = {k: v - served0[k] for k, v in served_counts(router.url).items()}
    assert served["p0"] + served["p1"] == n and served["d0"] + served["d1"] == n, served
    assert min(served.values()) >= 1, served
    for k in ENGINES:
        done = wait_metric(servers[k].url, REQUESTS_DONE,
                           lambda v, k=k: v >= done0[k] + served[k])  # type: ignore[misc]
        assert done == done0[k] + served[k], (k, done, done0[k], served)


def prefilled(p_url: str, text: str) -> dict[str, Any]:
    """Prefill ``text`` on P as the proxy does; the kv_transfer_params P answers for D."""
    code, out = http(p_url + "/v1/completions", {
        "model": MODEL_NAME, "prompt": text, "max_tokens": 1, "temperature": 0.0,
        "kv_transfer_params": dict(PREFILL)})
    assert code == 200 and isinstance(out.get("kv_transfer_params"), dict), out
    return dict(out["kv_transfer_params"])


def to_decode(d_url: str, text: str, params: dict[str, Any]) -> int | str:
    """Send a prefilled request to D; its HTTP status, or how the connection failed."""
    try:
        return http(d_url + "/v1/completions", {
            "model": MODEL_NAME, "prompt": text, "max_tokens": 8, "temperature": 0.0,
            "ignore_eos": True, "kv_transfer_params": params}, timeout=120)[0]
    except OSError as exc:  # the connection died with D
        return f"{type(exc).__name__}: {exc}"


def nothing_held(servers: dict[str, Server], timeout: float = 30.0,
                 keys: tuple[str, ...] = ("p0", "p1")) -> None:
    """No P holds a block for D any more (P's held-requests gauge is 0)."""
    for k in keys:
        held = wait_metric(servers[k].url, HELD, lambda v: v == 0, timeout=timeout)
        assert held == 0, (k, held, metrics(servers[k].url))


@pytest.fixture(scope="class")
def layerwise_fleet(model: Path, tmp_path_factory: pytest.TempPathFactory
                    ) -> Iterator[dict[str, Server]]:
    """2P+2D layerwise behind ``--mode layerwise`` (stopped when its class is done)."""
    def kv(role: str, engine_id: str) -> dict[str, Any]:
        return kv_config(role, engine_id, connector=LAYERWISE, load_timeout_s=60,
                         prefill={"tp_size": 1}, decode={"tp_size": 1})

    yield from fleet(model, tmp_path_factory.mktemp("fleet-lw-logs"), kv,
                     ("--mode", "layerwise"), ("--max-num-batched-tokens", "64"))


@pytest.fixture(scope="class")
def pull_fleet(model: Path, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[dict[str, Server]]:
    """2P+2D pull mode, P's lease ``LEASE_TTL_S`` (stopped when its class is done); the
    proxy renews the leases of requests D has every second (its default, 5 s, is longer
    than this lease: a request queued on D under load would lose its blocks)."""
    def kv(role: str, engine_id: str) -> dict[str, Any]:
        return kv_config(role, engine_id, lease_ttl_s=LEASE_TTL_S)

    yield from fleet(model, tmp_path_factory.mktemp("fleet-pull-logs"), kv,
                     ("--policy", "least_loaded", "--lease-renew-interval", "1"))


@pytest.fixture(scope="class")
def router_fleet(model: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[dict[str, Server]]:
    """2P+2D pull mode, P's lease the default (30 s), and vLLM's router (``vllm-router
    --vllm-pd-disaggregation --policy round_robin``) in front of them beside our proxy (idle
    here). Not the pull fleet: nothing renews P's leases behind vLLM's router until D's
    scheduler looks at a request, and with that fleet's 3 s lease requests queued on D under
    load lost their blocks (2 of 32 failed at concurrency 16)."""
    logs = tmp_path_factory.mktemp("fleet-vllm-router-logs")
    engines = fleet(model, logs, lambda role, engine_id: kv_config(role, engine_id), ())
    servers = next(engines)
    try:
        servers["vllm-router"] = started(lambda: vllm_router(
            "vllm-router", logs, [servers["p0"].url, servers["p1"].url],
            [servers["d0"].url, servers["d1"].url]))
        yield servers
    finally:
        engines.close()  # stops every server of the dict, the router too


def engine_counts(servers: dict[str, Server]) -> dict[str, float]:
    """Each D's finished and loaded requests, each P's requests served to D."""
    out: dict[str, float] = {}
    for k in ENGINES:
        m = metrics(servers[k].url)
        if k[0] == "d":
            out[f"{k}.done"], out[f"{k}.loaded"] = m.get(REQUESTS_DONE, 0.0), m.get(LOADED, 0.0)
        else:
            out[f"{k}.served"] = m.get("vllm:ascend_kv_p2p_requests_served_total", 0.0)
    return out


def moved_through(servers: dict[str, Server], before: dict[str, float], n: int) -> None:
    """``n`` requests since ``before``: each D finished and loaded the same requests (every
    one's KV from a P), the P's served them, every engine took a share, no P holds a block."""
    nothing_held(servers)
    deadline = time.monotonic() + 30  # vLLM publishes a step's stats a little late
    while True:
        delta = {k: v - before[k] for k, v in engine_counts(servers).items()}
        if delta["d0.done"] + delta["d1.done"] >= n or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    for k in ("d0", "d1"):
        delta[f"{k}.loaded"] = wait_metric(
            servers[k].url, LOADED,
            lambda v, k=k: v >= before[f"{k}.loaded"] + delta[f"{k}.done"],  # type: ignore[misc]
        ) - before[f"{k}.loaded"]
    assert delta["d0.done"] + delta["d1.done"] == n, delta
    assert delta["d0.loaded"] == delta["d0.done"] and delta["d1.loaded"] == delta["d1.done"], \
        delta
    assert delta["p0.served"] + delta["p1.served"] == n, delta
    assert min(delta.values()) >= 1, delta


class TestLayerwise:
    @pytest.fixture
    def servers(self, layerwise_fleet: dict[str, Server]) -> dict[str, Server]:
        return layerwise_fleet

    def test_layerwise_spread_equals_single_instance(self, servers: dict[str, Server]) -> None:
        loaded0 = sum(metrics(servers[k].url).get(LOADED, 0.0) for k in ("d0", "d1"))
        spread_equals_single(servers)
        out = status(servers["proxy"].url)
        assert out["prefill_failures"] == 0, out
        loaded = sum(metrics(servers[k].url).get(LOADED, 0.0) for k in ("d0", "d1"))
        assert loaded - loaded0 == 8  # every request's layers were pushed into D


class TestPull:
    @pytest.fixture
    def servers(self, pull_fleet: dict[str, Server]) -> dict[str, Server]:
        return pull_fleet

    def test_pull_spread_equals_single_instance(self, servers: dict[str, Server]) -> None:
        spread_equals_single(servers)

    @pytest.mark.parametrize("concurrency", [8, 16])
    @pytest.mark.parametrize("dataset", ["random", "prefix_repetition"])
    def test_vllm_bench_client(self, servers: dict[str, Server], model: Path, tmp_path: Path,
                               dataset: str, concurrency: int) -> None:
        extra: tuple[str, ...] = ()
        if dataset == "prefix_repetition":  # 4 prefixes of 2 blocks, each shared by a few
            extra = ("--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len",
                     "64", "--prefix-repetition-suffix-len", "32",
                     "--prefix-repetition-num-prefixes", "4",
                     "--prefix-repetition-output-len", "8")
        n = 2 * concurrency
        fallbacks0 = status(servers["proxy"].url)["fallbacks"]
        row = bench_client(servers["proxy"].url, model, tmp_path, num_prompts=n,
                           concurrency=concurrency, input_len=64, output_len=8, seed=5,
                           extra=extra)
        assert row["failed"] == 0 and row["completed"] == n, row
        nothing_held(servers)
        assert status(servers["proxy"].url)["fallbacks"] == fallbacks0  # no KV load failed

    def load_while(self, servers: dict[str, Server], victim: str, act: Callable[[], None],
                   seed: int) -> list[tuple[int, Any, float]]:
        """Requests from 4 threads, 24 in all, while ``act`` runs after the 4th answer; each
        request's (status, answer, seconds)."""
        router = servers["proxy"]
        texts = [prompt(seed + i, words=40) for i in range(24)]
        want = reference(servers["d0" if victim != "d0" else "d1"], texts)
        answered: list[int] = []

        def one(i: int) -> tuple[int, Any, float]:
            start = time.monotonic()
            code, out = complete(router.url, texts[i])
            answered.append(i)
            if code == 200:
                assert list(out["choices"][0]["token_ids"]) == want[i], (i, out)
            return code, out, time.monotonic() - start

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(one, i) for i in range(24)]
            while len(answered) < 4:
                time.sleep(0.05)
            act()
            # every request ends: answered or failed, none hangs
            done, pending = concurrent.futures.wait(futures, timeout=240)
            assert not pending, f"{len(pending)} requests still open"
        return [f.result() for f in futures]

    def assert_clear(self, results: list[tuple[int, Any, float]]) -> None:
        for code, out, _ in results:
            if code != 200:  # a failed request says why
                assert code >= 400 and "error" in str(out).lower(), (code, out)

    def test_p_killed_while_requests_stream(self, servers: dict[str, Server]) -> None:
        router, p1 = servers["proxy"], servers["p1"]
        results = self.load_while(servers, "p1", p1.kill, seed=300)
        self.assert_clear(results)
        ok = sum(1 for code, _, _ in results if code == 200)
        print(f"P killed: {ok} of {len(results)} requests answered 200")
        assert ok >= len(results) - 4, results  # at most the in-flight ones fail
        wait_healthy(router.url, "p1", False)
        before = served_counts(router.url)
        for i in range(4):  # new requests go to the other P
            assert complete(router.url, prompt(400 + i, words=20))[0] == 200
        after = served_counts(router.url)
        assert after["p1"] == before["p1"] and after["p0"] == before["p0"] + 4, after
        nothing_held(servers, keys=("p0",))

        started(lambda: p1.restart())  # same port: taken back after its health check
        wait_healthy(router.url, "p1", True)
        before = served_counts(router.url)
        for i in range(4):
            assert complete(router.url, prompt(500 + i, words=20))[0] == 200
        after = served_counts(router.url)
        assert after["p1"] > before["p1"], after
        nothing_held(servers)

    def test_d_killed_while_requests_stream(self, servers: dict[str, Server]) -> None:
        router, d1 = servers["proxy"], servers["d1"]
        expired0 = sum(metrics(servers[k].url).get("vllm:ascend_kv_p2p_expired_leases_total",
                                                   0.0) for k in ("p0", "p1"))

        p0 = servers["p0"]
        orphans: list[concurrent.futures.Future[Any]] = []
        side = concurrent.futures.ThreadPoolExecutor(2)

        def pause_then_kill() -> None:  # requests pile up on the paused D, then it dies
            os.killpg(d1.proc.pid, signal.SIGSTOP)
            # and two requests P prefilled for it, handed to it directly (no proxy to renew
            # their lease, none to re-send them): only their lease frees P's blocks
            for i in range(2):
                params = prefilled(p0.url, prompt(650 + i))
                orphans.append(side.submit(to_decode, d1.url, prompt(650 + i), params))
            time.sleep(2.0)
            d1.kill()

        results = self.load_while(servers, "d1", pause_then_kill, seed=600)
        self.assert_clear(results)
        ok = sum(1 for code, _, _ in results if code == 200)
        print(f"D killed: {ok} of {len(results)} requests answered 200, "
              f"{status(router.url)['fallbacks']} plain re-sends in all")
        assert ok >= len(results) - 4, results
        for fut in orphans:  # D died with them: an error, not an answer
            assert fut.result(timeout=60) != 200
        side.shutdown()
        wait_healthy(router.url, "d1", False)
        before = served_counts(router.url)
        for i in range(4):  # new requests go to the other D
            assert complete(router.url, prompt(700 + i, words=20))[0] == 200
        after = served_counts(router.url)
        assert after["d1"] == before["d1"] and after["d0"] == before["d0"] + 4, after
        # what P held for the dead D is freed: D's Done, or the lease lapsing
        nothing_held(servers, timeout=LEASE_TTL_S + 30)
        expired = sum(metrics(servers[k].url).get("vllm:ascend_kv_p2p_expired_leases_total",
                                                   0.0) for k in ("p0", "p1")) - expired0
        assert expired >= 2, expired  # the orphans' leases lapsed; P freed their blocks

        started(lambda: d1.restart())
        wait_healthy(router.url, "d1", True)
        before = served_counts(router.url)
        for i in range(4):
            assert complete(router.url, prompt(800 + i, words=20))[0] == 200
        after = served_counts(router.url)
        assert after["d1"] > before["d1"], after
        nothing_held(servers)


class TestVllmRouter:
    """The pull fleet's checks behind vLLM's router instead of our proxy."""

    @pytest.fixture
    def servers(self, router_fleet: dict[str, Server]) -> dict[str, Server]:
        return router_fleet

    def test_vllm_router_equals_single_instance(self, servers: dict[str, Server]) -> None:
        """Behind vLLM's router: 8 prompts (4 at a time) give a single instance's tokens."""
        texts = [prompt(900 + i) for i in range(8)]
        want = reference(servers["d0"], texts)
        before = engine_counts(servers)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda t: tokens(servers["vllm-router"].url, t), texts))
        assert got == want
        moved_through(servers, before, len(texts))

    @pytest.mark.parametrize("concurrency", [8, 16])
    def test_vllm_router_bench_client(self, servers: dict[str, Server], model: Path,
                                      tmp_path: Path, concurrency: int) -> None:
        """vLLM's benchmark client through vLLM's router: nothing fails, every request's KV
        was loaded by a D from a P, nothing is left held."""
        n = 2 * concurrency
        before = engine_counts(servers)
        row = bench_client(servers["vllm-router"].url, model, tmp_path, num_prompts=n,
                           concurrency=concurrency, input_len=64, output_len=8, seed=9)
        assert row["failed"] == 0 and row["completed"] == n, row
        moved_through(servers, before, n)
        print(f"vllm-router, 2P+2D, {n} prompts at concurrency {concurrency}: {row}")
