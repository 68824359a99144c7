# SPDX-License-Identifier: Apache-2.0
"""vLLM's own router (``vllm-router==0.1.17``, Rust, from the package index) in front of one
P and one D real ``vllm serve`` with ``MooncakeConnectorV1`` (pull mode), as a user runs it:
``vllm-router --vllm-pd-disaggregation --prefill P --decode D --policy round_robin``.

The router's two-stage flow (P with ``max_tokens=1`` and ``kv_transfer_params:
{"do_remote_decode": true}``, then D with the ``kv_transfer_params`` of P's answer) carries
our pull connector unchanged:

* greedy prompts below a block, of exactly a block, a block and one, and several blocks
  equal a single instance token for token; D loaded every request's blocks from P (D's
  ``requests_loaded`` and transfer bytes, the prompts' blocks times the block's bytes), and
  P holds nothing afterwards;
* vLLM's benchmark client at concurrency 8 through the router: nothing fails, every request
  D finished had its KV loaded from P, nothing is left held on P;
* the router listens on loopback only (its HTTP and Prometheus ports, both given).

One P, one D and the router, shared by the module: about two minutes on 2 cores. The 2 P +
2 D runs at concurrency 8 and 16 are in ``test_p2p_fleet_e2e`` (``nox -s e2e-fleet``).
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import pytest

from ascend_kv_testing.models import make_served_llama, tiny_llama_block_bytes
from ascend_kv_testing.pd import kv_config, prompts_of
from ascend_kv_testing.requires import require, require_binary
from ascend_kv_testing.serving import (
    BLOCK_SIZE,
    HELD,
    HOST,
    LOADED,
    REQUESTS_DONE,
    VLLM_ROUTER,
    RouterServer,
    Server,
    bench_client,
    completion,
    http,
    metrics,
    start_all,
    started,
    token_ids,
    vllm_router,
    vllm_serve,
    wait_metric,
)

# A mandatory dependency of the e2e session (noxfile.py installs it): missing, the module
# fails to collect; it never skips.
require_binary("vllm-router", VLLM_ROUTER)
psutil = require("psutil", "psutil", "the router's listening sockets")

#: D's bytes read from P, and P's requests D claimed (our connector's series).
TRANSFER_BYTES = "vllm:ascend_kv_p2p_transfer_bytes_total"
SERVED = "vllm:ascend_kv_p2p_requests_served_total"
#: KV bytes of one block of the tiny model (float32).
BLOCK_BYTES = tiny_llama_block_bytes(BLOCK_SIZE)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """The tiny Llama with its tokenizer; the vocabulary's size."""
    return make_served_llama(tmp_path_factory.mktemp("vllm-router-model"))


@pytest.fixture(scope="module")
def pd(model: tuple[Path, int], tmp_path_factory: pytest.TempPathFactory
       ) -> Iterator[dict[str, Server]]:
    """P and D ``vllm serve`` (started side by side) behind ``vllm-router``."""
    logs = tmp_path_factory.mktemp("vllm-router-logs")
    servers: dict[str, Server] = {}
    try:
        start_all({"p": lambda: vllm_serve("prefill", model[0], logs,
                                           kv_config("kv_producer", "vllm-router-p")),
                   "d": lambda: vllm_serve("decode", model[0], logs,
                                           kv_config("kv_consumer", "vllm-router-d"))},
                  servers)
        servers["router"] = started(lambda: vllm_router(
            "router", logs, [servers["p"].url], [servers["d"].url]))
        yield servers
    finally:
        for s in reversed(list(servers.values())):
            s.stop()


def complete(base: str, prompt: list[int]) -> list[int]:
    status, answer = completion(base, prompt, max_tokens=8, timeout=180.0)
    assert status == 200, answer
    return token_ids(answer)


def counters(servers: dict[str, Server]) -> dict[str, float]:
    """D's loads, bytes and finished requests, P's served requests."""
    d, p = metrics(servers["d"].url), metrics(servers["p"].url)
    return {"loaded": d.get(LOADED, 0.0), "bytes": d.get(TRANSFER_BYTES, 0.0),
            "d_done": d.get(REQUESTS_DONE, 0.0), "served": p.get(SERVED, 0.0)}


def nothing_held(p: Server) -> None:
    held = wait_metric(p.url, HELD, lambda v: v == 0)
    assert held == 0, metrics(p.url)


def test_router_listens_on_loopback_only(pd: dict[str, Server]) -> None:
    router = pd["router"]
    assert isinstance(router, RouterServer)
    root = psutil.Process(router.proc.pid)
    listening = [c.laddr for proc in (root, *root.children(recursive=True))
                 for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    ports = {a.port for a in listening}
    assert {router.port, router.prometheus_port} <= ports, listening
    assert all(a.ip == HOST for a in listening), listening
    status, text = http(router.prometheus_url + "/metrics")
    assert status == 200, text


def test_greedy_prompts_equal_single_instance(pd: dict[str, Server],
                                              model: tuple[Path, int]) -> None:
    p, d, router = pd["p"], pd["d"], pd["router"]
    # below a block, exactly a block, a block and one, several blocks
    lengths = [BLOCK_SIZE - 7, BLOCK_SIZE, BLOCK_SIZE + 1, 3 * BLOCK_SIZE + 5]
    prompts = prompts_of(lengths, seed=53, vocab=model[1])
    want = [complete(d.url, x) for x in prompts]  # D without kv params: a single instance
    assert http(d.url + "/reset_prefix_cache", {})[0] == 200
    before = counters(pd)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda x: complete(router.url, x), prompts))
    assert got == want
    n = len(prompts)
    wait_metric(d.url, LOADED, lambda v: v >= before["loaded"] + n)
    after = counters(pd)
    assert after["loaded"] - before["loaded"] == n, (before, after)  # each went through P
    assert after["served"] - before["served"] == n, (before, after)
    moved = sum(-(-x // BLOCK_SIZE) for x in lengths) * BLOCK_BYTES
    assert after["bytes"] - before["bytes"] == moved, (before, after)
    nothing_held(p)


def test_vllm_bench_client_concurrency_8(pd: dict[str, Server], model: tuple[Path, int],
                                         tmp_path: Path) -> None:
    p, d, router = pd["p"], pd["d"], pd["router"]
    before = counters(pd)
    n = 24
    row = bench_client(router.url, model[0], tmp_path, num_prompts=n, concurrency=8,
                       input_len=100, output_len=8, seed=53)
    assert row["failed"] == 0 and row["completed"] == n, row
    nothing_held(p)
    wait_metric(d.url, REQUESTS_DONE, lambda v: v >= before["d_done"] + n)
    wait_metric(d.url, LOADED, lambda v: v >= before["loaded"] + n)
    after = counters(pd)
    # every request D finished (the client's, nothing else) had its KV loaded from P, which
    # served it once
    assert after["d_done"] - before["d_done"] == n, (before, after)
    assert after["loaded"] - before["loaded"] == n, (before, after)
    assert after["served"] - before["served"] == n, (before, after)
    print(f"vllm-router, 1P+1D, {n} prompts at concurrency 8: {row}")
