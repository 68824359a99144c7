# SPDX-License-Identifier: Apache-2.0
"""Uneven TP between P and D on real vLLM CPU engines (a tiny Llama, float32, TP ranks as
worker processes on gloo), real Mooncake over TCP:

* pull, D wider than P: P TP=1 holds both KV heads, each D rank (TP=2) reads its own;
* layerwise, P wider than D: P TP=2 ranks each push their head into D TP=1's blocks (D
  stages and merges them: a P rank's head is not contiguous in D's CPU block);
* layerwise with replicated heads: a model with one KV head on D TP=2 (vLLM gives both
  ranks the same head), P TP=1 pushes it to both.

(P TP=2 to D TP=1 pull is in ``test_p2p_hetero_tp_e2e``.) Each pair of engines lives only
as long as its test class, so no more than two engines run at once. Checked: D's tokens
equal a single instance's; in every full block of the prompt, every head each D rank holds
is byte for byte the head P computed (head ownership from ``kernels.heads``); and the
bytes moved are each D rank's heads once per block and layer, nothing more.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from ascend_kv_testing.engines import EngineProcess
from ascend_kv_testing.faults import start_in_parallel
from ascend_kv_testing.models import make_tiny_llama
from ascend_kv_testing.pd import (
    LAYERWISE,
    PROBES,
    Metaserver,
    baseline,
    kv_config,
    prefill,
    prompts_of,
)
from vllm_ascend.distributed.kernels.heads import kv_heads_of_rank

KB = "ascend_kv_testing.kv_bytes"
BS = 32  # engine_kwargs' block size
LAYERS = 2
HEAD_DIM = 64
#: k * block + 1 and a partial last block
LENGTHS = [2 * BS + 1, 3 * BS + 10]
NOBIND = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """KV heads -> a tiny Llama with that many (2: split over TP=2; 1: replicated)."""
    return {2: make_tiny_llama(tmp_path_factory.mktemp("tp-2kv")),
            1: make_tiny_llama(tmp_path_factory.mktemp("tp-1kv"), num_key_value_heads=1)}


def start_pair(model: Path, p_cfg: dict[str, Any], p_tp: int, d_cfg: dict[str, Any],
               d_tp: int) -> tuple[EngineProcess, EngineProcess]:
    """P and D side by side (a TP=2 engine takes a minute on 2 cores)."""
    def engine(cfg: dict[str, Any], tp: int) -> Callable[[], EngineProcess]:
        return functools.partial(EngineProcess, model, cfg, tensor_parallel_size=tp,
                                 startup_timeout=600, env=NOBIND)

    out = start_in_parallel({"p": engine(p_cfg, p_tp), "d": engine(d_cfg, d_tp)})
    return out["p"], out["d"]


def moved(engine: EngineProcess) -> float:
    """Bytes the engine's connector moved, over all its TP ranks."""
    return sum(t.get("p2p_transfer_bytes", 0.0)
               for t in engine.call(f"{KB}:worker_connector_totals"))


def check_heads(p: EngineProcess, p_tp: int, d: EngineProcess, d_tp: int, prompt: list[int],
                kv_heads: int) -> int:
    """Every head of every full block on every D rank equals P's; returns the full blocks."""
    p_blocks = p.call(f"{KB}:cached_blocks", prompt=prompt)
    d_blocks = d.call(f"{KB}:cached_blocks", prompt=prompt)
    full = (len(prompt) - 1) // BS
    assert len(p_blocks) == len(d_blocks) == full, (p_blocks, d_blocks)
    p_ranks, d_ranks = p.call(f"{KB}:head_digests", block_ids=p_blocks), \
        d.call(f"{KB}:head_digests", block_ids=d_blocks)
    assert len(p_ranks) == p_tp and len(d_ranks) == d_tp

    def owner(tp: int, head: int) -> tuple[int, int]:
        """(a rank holding ``head``, its index there)."""
        for r in range(tp):
            heads = list(kv_heads_of_rank(kv_heads, tp, r))
            if head in heads:
                return r, heads.index(head)
        raise AssertionError(f"no rank holds head {head}")

    for d_rank, ranked in enumerate(d_ranks):
        mine = list(kv_heads_of_rank(kv_heads, d_tp, d_rank))
        assert ranked["heads"] == len(mine), ranked["shape"]
        for layer, blocks in ranked["layers"].items():
            for i, heads in enumerate(blocks):
                for local, head in enumerate(mine):
                    pr, pi = owner(p_tp, head)
                    assert heads[local] == p_ranks[pr]["layers"][layer][i][pi], \
                        (layer, i, d_rank, head)
    some = p_ranks[0]["layers"][next(iter(p_ranks[0]["layers"]))]
    assert len({h for blk in some for h in blk}) == full * len(some[0])  # real, distinct KV
    return full


def head_block_bytes(engine: EngineProcess) -> int:
    """Bytes of one head of one block of one layer (K and V)."""
    rank = engine.call(f"{KB}:head_digests", block_ids=[])[0]
    assert rank["head_bytes"] == BS * 2 * HEAD_DIM * 4, rank  # float32 K and V
    return int(rank["head_bytes"])


def d_heads_total(kv_heads: int, d_tp: int) -> int:
    """Heads over all D ranks (a replicated head counts on each rank that holds it)."""
    return sum(len(kv_heads_of_rank(kv_heads, d_tp, r)) for r in range(d_tp))


# ---------------------------------------------------------------- pull, D TP > P TP
@pytest.fixture(scope="class")
def pull_p1_d2(models: dict[int, Path]) -> Iterator[tuple[EngineProcess, EngineProcess]]:
    p, d = start_pair(models[2],
                      kv_config("kv_producer", "tp-pull-p1", prefill={"tp_size": 1},
                                lease_ttl_s=60), 1,
                      kv_config("kv_consumer", "tp-pull-d2", prefill={"tp_size": 1},
                                decode={"tp_size": 2}), 2)
    yield p, d
    d.close()
    p.close()


class TestPullDecodeWider:
    def test_p_tp1_to_d_tp2(self, pull_p1_d2: Any) -> None:
        p, d = pull_p1_d2
        prompts = prompts_of(LENGTHS, seed=61)
        want = baseline(d, prompts)
        before = moved(d)
        params = prefill(p, prompts)
        assert all(x["remote_tp_size"] == 1 for x in params)
        got = d.generate(prompts, max_tokens=8, kv_params=params)
        assert [g.token_ids for g in got] == want
        assert all(g.finish_reason == "length" for g in got)
        per_head = head_block_bytes(d)
        blocks = sum(-(-len(x) // BS) for x in prompts)
        # each D rank read its own head only: one copy of the KV over the two ranks
        assert moved(d) - before == blocks * d_heads_total(2, 2) * per_head * LAYERS
        for prompt in prompts:
            check_heads(p, 1, d, 2, prompt, kv_heads=2)
        assert p.wait_idle(30) and d.wait_idle(30)


# ---------------------------------------------------------------- layerwise
def lw_pair(model: Path, p_tp: int, d_tp: int, tag: str) -> Any:
    tps = {"prefill": {"tp_size": p_tp}, "decode": {"tp_size": d_tp}}
    p, d = start_pair(model, kv_config("kv_producer", f"{tag}-p", connector=LAYERWISE, **tps),
                      p_tp, kv_config("kv_consumer", f"{tag}-d", connector=LAYERWISE, **tps),
                      d_tp)
    return SimpleNamespace(p=p, d=d, meta=Metaserver(), p_tp=p_tp, d_tp=d_tp)


def close_lw(lw: Any) -> None:
    lw.meta.close()
    lw.d.close()
    lw.p.close()


def push_all(lw: Any, prompts: list[list[int]], tag: str) -> list[Any]:
    """D gets the requests first and posts its blocks; P prefills with what D posted."""
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.update(d=lw.d.generate(
        prompts, max_tokens=8, kv_params=[lw.meta.params(r) for r in rids])))
    t.start()
    posted = lw.meta.wait(rids)
    assert all(x["remote_tp_size"] == lw.d_tp for x in posted)
    lw.p.generate(prompts, max_tokens=1, kv_params=posted)
    t.join(300)
    assert "d" in out, "D did not finish"
    return list(out["d"])


def run_layerwise(lw: Any, kv_heads: int, seed: int) -> None:
    # every D rank published its address to D's scheduler (vLLM's handshake metadata)
    hosts = lw.d.call(f"{PROBES}:published_rank_hosts")
    assert hosts is not None and sorted(hosts) == list(range(lw.d_tp)), hosts
    prompts = prompts_of(LENGTHS, seed=seed)
    want = baseline(lw.d, prompts)
    before = moved(lw.p)
    got = push_all(lw, prompts, f"lw-{seed}")
    assert [g.token_ids for g in got] == want
    per_head = head_block_bytes(lw.d)
    blocks = sum(-(-len(x) // BS) for x in prompts)
    # what P wrote: every D rank's heads, once per block and layer
    assert moved(lw.p) - before == blocks * d_heads_total(kv_heads, lw.d_tp) * per_head * LAYERS
    for prompt in prompts:
        check_heads(lw.p, lw.p_tp, lw.d, lw.d_tp, prompt, kv_heads=kv_heads)
    assert lw.p.wait_idle(30) and lw.d.wait_idle(30)


@pytest.fixture(scope="class")
def lw_p2_d1(models: dict[int, Path]) -> Iterator[Any]:
    lw = lw_pair(models[2], 2, 1, "tp-lw21")
    yield lw
    close_lw(lw)


class TestLayerwisePrefillWider:
    def test_p_tp2_to_d_tp1(self, lw_p2_d1: Any) -> None:
        run_layerwise(lw_p2_d1, kv_heads=2, seed=62)


@pytest.fixture(scope="class")
def lw_p1_d2_replicated(models: dict[int, Path]) -> Iterator[Any]:
    lw = lw_pair(models[1], 1, 2, "tp-lw12r")
    yield lw
    close_lw(lw)


class TestLayerwiseReplicatedHeads:
    def test_p_tp1_to_d_tp2_one_kv_head(self, lw_p1_d2_replicated: Any) -> None:
        """More D ranks than KV heads: both D ranks hold the one head, P fills both."""
        run_layerwise(lw_p1_d2_replicated, kv_heads=1, seed=63)
